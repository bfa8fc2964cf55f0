"""Can the engine know which paused session resumes last? An offline study on a real trace.

The session retention policy can only beat LRU on restored bytes if something the engine
knows predicts pause lengths. The engine knows one thing about every pause as it begins:
how the turn before it ended. A turn that ends in a tool call (``stop: tool_use`` in the
Weka trace) is followed by the tool's run; one that ends the agent's answer (``end_turn``)
waits for a person, or the session is over. This script

1. measures the idle gap after each main-agent turn by the turn's stop reason, and
2. replays the trace's sessions through one device cache at live KV ``R`` x the cache
   (K sessions at once, closed loop, recorded gaps x ``--gap-scale`` capped at
   ``--gap-cap``), evicting paused sessions' blocks chain tail first under three orders:
   ``lru`` (longest idle first), ``stop`` (sessions whose last turn ended the answer first,
   then longest idle), and ``belady`` (the session that resumes last first: the oracle),
   and counts the reusable blocks each order has to bring back (restore or recompute).
3. asks how good a hint from the agent harness would have to be (``--hint-sigmas``): the
   ``hint:S`` order is Belady on a told pause length that is off by a lognormal factor,
   ``gap x exp(S x N(0, 1))`` drawn once per pause (S = 0.5: typically within 1.6x; 1: 2.7x;
   2: 7x). No trace here says which tool ran, so whether a harness can know pauses that
   well is not measured; this says what precision the session policy would need.

The model is coarse on purpose: sessions are the unit (a resumed turn reuses the common
prefix with its previous turn; the cache holds each session's leading blocks), service time
is ``--service-s`` + ``--service-s-per-100k`` per 100K tokens, sub-agents are left out.

    .venv/bin/python benchmarks/kvtier_pause_signal.py --trace ../shared/traces/weka-cc-sample.jsonl.gz \\
        --out benchmarks/results/kvtier_pause_signal.json
"""

from __future__ import annotations

import argparse
import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from agentserve.workload.traces import load_sessions

POLICIES = ("lru", "stop", "belady")
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "src/agentserve/data/traces/weka-cc-mini.jsonl"


@dataclass(slots=True)
class Turn:
    gap_s: float  # idle time before this turn (after the previous one ended)
    blocks: list[int]  # hash ids of the input, one per trace block (grouped by --group)
    stop: str | None  # how this turn ended


@dataclass(slots=True)
class Live:
    turns: list[Turn]
    i: int = 0
    resident: int = 0  # leading blocks of the last turn still in the cache
    prev: list[int] = field(default_factory=list)
    last_end: float = 0.0
    next_start: float = 0.0
    told: float = 0.0  # the hinted resume time (hint:S orders)
    running: bool = False


def load_turns(path: str, group: int, gap_scale: float, gap_cap: float) -> tuple[list[list[Turn]], dict]:
    """Main-agent turns of every session, and the idle gaps after each stop reason."""
    sessions, gaps = [], {}
    for s in load_sessions(path, skip_bad=True).sessions:
        reqs = s.main_requests
        turns = []
        for j, r in enumerate(reqs):
            gap = 0.0
            if j:
                p = reqs[j - 1]
                gap = max(r.t - p.t - (p.api_time or 0.0), 0.0)
                gaps.setdefault(p.stop or "(none)", []).append(gap)
            turns.append(Turn(min(gap * gap_scale, gap_cap), r.hash_ids[::group], r.stop))
        if turns:
            sessions.append(turns)
    return sessions, gaps


def replay(sessions: list[list[Turn]], k: int, capacity: int, policy: str, service_s: float,
           service_per_block_s: float, seed: int = 0) -> dict[str, int]:
    """Closed-loop replay of `k` sessions at a time through a cache of `capacity` blocks."""
    sigma = float(policy.split(":", 1)[1]) if policy.startswith("hint:") else None
    rng = np.random.default_rng(seed)

    def told(now: float, gap: float) -> float:
        return now + gap * float(np.exp(sigma * rng.standard_normal())) if sigma else now + gap
    heap: list[tuple[float, int, int]] = []  # (time, 0 start / 1 end, slot id)
    live: dict[int, Live] = {}
    nxt, total, reusable, missed = 0, 0, 0, 0

    def open_session(now: float) -> None:
        nonlocal nxt
        if nxt < len(sessions):
            live[nxt] = Live(sessions[nxt], next_start=now + sessions[nxt][0].gap_s)
            live[nxt].told = told(now, sessions[nxt][0].gap_s)
            heapq.heappush(heap, (live[nxt].next_start, 0, nxt))
            nxt += 1

    for _ in range(k):
        open_session(0.0)
    while heap:
        now, kind, sid = heapq.heappop(heap)
        st = live[sid]
        turn = st.turns[st.i]
        if kind == 0:
            common = 0
            for a, b in zip(st.prev, turn.blocks, strict=False):  # the common prefix
                if a != b:
                    break
                common += 1
            reusable += common
            missed += common - min(st.resident, common)
            total += len(turn.blocks) - st.resident
            st.resident, st.prev, st.running = len(turn.blocks), turn.blocks, True
            while total > capacity:  # evict chain tails of paused sessions, by policy
                paused = [(i, s) for i, s in live.items() if not s.running and s.resident]
                if not paused:
                    break
                if policy == "lru":
                    _, victim = min(paused, key=lambda p: p[1].last_end)
                elif policy == "stop":
                    _, victim = min(paused, key=lambda p: (p[1].turns[p[1].i - 1].stop == "tool_use",
                                                           p[1].last_end))
                elif policy == "belady":
                    _, victim = max(paused, key=lambda p: p[1].next_start)
                else:  # hint:S
                    _, victim = max(paused, key=lambda p: p[1].told)
                take = min(victim.resident, total - capacity)
                victim.resident -= take
                total -= take
            heapq.heappush(heap, (now + service_s + service_per_block_s * len(turn.blocks), 1, sid))
        else:
            st.running, st.last_end = False, now
            st.i += 1
            if st.i < len(st.turns):
                st.next_start = now + st.turns[st.i].gap_s
                st.told = told(now, st.turns[st.i].gap_s)
                heapq.heappush(heap, (st.next_start, 0, sid))
            else:
                total -= st.resident
                del live[sid]
                open_session(now)
    return {"reusable_blocks": reusable, "missed_blocks": missed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--sessions", type=int, default=16, help="sessions at once (closed loop)")
    ap.add_argument("--ratios", default="1.5,3,5", help="live KV / cache size")
    ap.add_argument("--gap-scale", type=float, default=0.25)
    ap.add_argument("--gap-cap", type=float, default=120.0)
    ap.add_argument("--group", type=int, default=8, help="trace blocks per cache block")
    ap.add_argument("--service-s", type=float, default=0.5)
    ap.add_argument("--service-s-per-100k", type=float, default=0.5)
    ap.add_argument("--hint-sigmas", default="0.5,1,2",
                    help="hint:S orders: Belady on pause lengths off by exp(S x N(0,1)); '' for none")
    ap.add_argument("--out", default="bench-out/kvtier_pause_signal.json")
    a = ap.parse_args()

    sessions, gaps = load_turns(a.trace, a.group, a.gap_scale, a.gap_cap)
    policies = POLICIES + tuple(f"hint:{float(x):g}" for x in a.hint_sigmas.split(",") if x.strip())
    block_tokens = 64 * a.group  # Weka blocks are 64 tokens
    per_block = a.service_s_per_100k * block_tokens / 100_000
    # live KV: the mean context of a session (blocks), times the sessions at once
    mean_ctx = float(np.mean([np.mean([len(t.blocks) for t in s]) for s in sessions]))
    stops = {k: {"n": len(v), **{f"p{q}": float(np.percentile(v, q)) for q in (10, 50, 90)}}
             for k, v in sorted(gaps.items(), key=lambda kv: -len(kv[1]))}
    rows = []
    for r in (float(x) for x in a.ratios.split(",")):
        cap = int(a.sessions * mean_ctx / r)
        res = {p: replay(sessions, a.sessions, cap, p, a.service_s, per_block) for p in policies}
        lru = res["lru"]["missed_blocks"]
        rows.append({"ratio": r, "capacity_blocks": cap, **{
            p: {**res[p], "missed_vs_lru": res[p]["missed_blocks"] / lru - 1 if lru else None}
            for p in policies}})
    out = {"args": vars(a), "sessions": len(sessions), "gaps_after_stop_s": stops, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))

    con = Console(width=140)
    t = Table(title=f"idle gap after a turn, by how it ended ({len(sessions)} sessions)")
    for c in ("stop", "turns", "p10 s", "p50 s", "p90 s"):
        t.add_column(c, justify="right")
    for k, v in stops.items():
        t.add_row(k, str(v["n"]), f"{v['p10']:.1f}", f"{v['p50']:.1f}", f"{v['p90']:.1f}")
    con.print(t)
    t = Table(title=f"blocks to bring back, {a.sessions} sessions, gaps x{a.gap_scale:g} "
                    f"(cap {a.gap_cap:g} s)")
    others = [p for p in policies if p != "lru"]
    for c in ("live / cache", "reusable", "lru missed", *(f"{p} vs lru" for p in others)):
        t.add_column(c, justify="right")
    def rel(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1%}"

    for row in rows:
        t.add_row(f"{row['ratio']:g}x", f"{row['lru']['reusable_blocks']:,}",
                  f"{row['lru']['missed_blocks']:,}", *(rel(row[p]["missed_vs_lru"]) for p in others))
    con.print(t)
    con.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
