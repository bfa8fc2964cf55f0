"""Paused conversations: device only vs CPU tier (LRU) vs CPU tier (session policy).

Workload: synthesized production-shaped agent sessions (``agentserve.workload.synth``,
profile ``sweep`` = fresh Claude Code sessions, sub-agent groups included) written to a
JSONL trace, or ``--trace FILE``. Pauses are the trace's idle gaps (production: 2 s
median, 24 s p90), times ``--gap-scale``, capped at ``--gap-cap``.

Sizing: ``live_kv`` simulates the closed-loop replay offline (K sessions at once, the
recorded pauses, ~``--service-s`` per request) and averages, over the run, the summed
current context of every live session (main agent + running sub-agents), in scaled
tokens. For each ratio R the device pool is ``live / R`` tokens and the CPU tier
``--cpu-x x live`` tokens worth of bytes (``--kv-bytes-per-token``, tiny model: 4096):
a CPU tier smaller than the sessions' footprint, so its retention policy matters.

For each (R, config) it starts ``agentserve serve``, runs ``agentserve bench --mode
sessions`` and reads TTFT p50/p90 (all requests, and resumed requests = every request
of a session but its first), output tok/s and the reusable tokens that were recomputed
(reuse ceiling minus cached) from the records, and restored / stored bytes, tier hit
tokens, evictions, restore decisions and where every restored block went (used, or
wasted: restored twice, already on the device, aborted, failed, preempted before its
first token) from /metrics. ``--kv-trace`` also records the engine's admissions and
device evictions and replays them offline under other device eviction orders
(``device_replay``: LRU, tail-first, agent-aware, and the Belady oracle as a bound), and
counts the restored blocks the device dropped while their request already waited
(``dropped_while_waiting``: what pinning at arrival could save).
Writes JSON, a table, and <out>_ttft.png / <out>_restored.png (``--plot-only`` redraws).

    .venv/bin/python benchmarks/kvtier_sessions.py --ratios 1.5,3,5 --sessions 16 \\
        --token-scale 2 --duration 45 --out benchmarks/results/kvtier_sessions.json
    .venv/bin/python benchmarks/kvtier_sessions.py --ratios 3,5 --cpu-x 0.4 --kv-trace \\
        --configs cpu-lru,cpu-arc,cpu-session --out benchmarks/results/kvtier_sessions_small_cpu.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

CLI = str(Path(sys.executable).parent / "agentserve")
# name -> CPU tier policy; a "-wb" name stores on eviction (--kv-store-on evict: write-back)
CONFIGS = {"device": None, "cpu-lru": "lru", "cpu-arc": "arc", "cpu-session": "session",
           "cpu-lru-wb": "lru", "cpu-session-wb": "session"}
COLORS = {"device": "tab:blue", "cpu-lru": "tab:orange", "cpu-arc": "tab:purple",
          "cpu-lru-wb": "tab:red", "cpu-session-wb": "tab:olive",
          "cpu-session": "tab:green"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not up after {timeout}s")


def scrape(url: str) -> dict[str, float]:
    """agentserve:kv_* and vllm:prefix_cache_* counters, summed per name{label}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith(("agentserve:kv_", "agentserve:prefix_", "vllm:prefix_cache_",
                          "vllm:num_preemptions")):
            head, _, val = ln.rpartition(" ")
            try:
                out[head] = out.get(head, 0.0) + float(val)
            except ValueError:
                pass
    return out


def metric(m: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] in (name, name + "_total")
               and label in k)


def labelled(m: dict[str, float], name: str, label: str) -> dict[str, float]:
    """{label value: sum} of one labelled counter."""
    out: dict[str, float] = {}
    for k, v in m.items():
        if k.split("{")[0] in (name, name + "_total") and f'{label}="' in k:
            lv = k.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[lv] = out.get(lv, 0.0) + v
    return out


# ---- offline sizing -------------------------------------------------------------------
def _scaled(tokens: int, ts: int, bs: int = 64) -> int:
    return max(1, round(tokens * ts / bs))


def session_timeline(s, ts: int, gap_scale: float, cap: float, service: float):
    """[(start, end, context tokens)] of every request of a session, on its own clock."""
    from agentserve.workload.replay_plan import idle_gap, step_end, step_start, steps_of
    from agentserve.workload.schema import TraceRequest

    out, now = [], 0.0
    steps = steps_of(s)
    prev = step_start(steps[0]) if steps else 0.0
    for st in steps:
        now += idle_gap(step_start(st) - prev, gap_scale, cap)
        if isinstance(st, TraceRequest):
            out.append((now, now + service, _scaled(st.input_tokens + st.output_tokens, ts)))
            now += service
        else:
            ends = []
            for sub in st:
                t, pe = now, 0.0
                for r in sub.requests:
                    t += idle_gap(r.t - pe, gap_scale, cap)
                    out.append((t, t + service, _scaled(r.input_tokens + r.output_tokens, ts)))
                    t += service
                    pe = r.t + (r.api_time or 0.0)
                ends.append(t)
            now = max(ends, default=now)
        prev = step_end(st)
    return out, now


def live_kv(sessions, k: int, ts: int, gap_scale: float, cap: float, duration: float,
            service: float) -> dict:
    """Mean and p90 over the run of the summed live context of the sessions in flight."""
    grid = np.linspace(0, duration, 200)
    live = np.zeros_like(grid)
    workers = [0.0] * k
    heapq.heapify(workers)
    for s in sessions:
        t0 = heapq.heappop(workers)
        if t0 >= duration:
            break
        reqs, length = session_timeline(s, ts, gap_scale, cap, service)
        # Each agent's (main or sub-agent) context lives from its request until the next.
        # Approximation: a session's footprint = its latest main context + running subs.
        for i, (a, b, ctx) in enumerate(reqs):
            nxt = reqs[i + 1][0] if i + 1 < len(reqs) else length
            live[(grid >= t0 + a) & (grid < t0 + max(nxt, b))] += ctx
        heapq.heappush(workers, t0 + length + service)
    steady = live[grid >= duration * 0.25]
    return {"mean": float(steady.mean()), "p90": float(np.percentile(steady, 90))}


# ---- one run ---------------------------------------------------------------------------
def summarize(out_dir: Path, duration: float) -> dict:
    recs = [json.loads(ln) for ln in (out_dir / "requests.jsonl").read_text().splitlines() if ln]
    ok = [r for r in recs if r.get("ttft") is not None and not r.get("error")]
    ok.sort(key=lambda r: r["start"])
    seen: set[str] = set()
    resumed = []
    for r in ok:
        (resumed if r["session_id"] in seen else []).append(r)
        seen.add(r["session_id"])
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else None)
    t_all, t_res = [r["ttft"] for r in ok], [r["ttft"] for r in resumed]
    s = json.loads((out_dir / "summary.json").read_text())[0]
    return {"requests_ok": len(ok), "requests_failed": len(recs) - len(ok),
            "resumed_requests": len(resumed),
            "ttft_p50_s": pct(t_all, 50), "ttft_p90_s": pct(t_all, 90),
            "resumed_ttft_p50_s": pct(t_res, 50), "resumed_ttft_p90_s": pct(t_res, 90),
            "output_tok_s": s["output_tok_s"], "input_tokens": sum(r["input_tokens"] for r in ok),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
            # What an infinite prefix cache could have served, and what of it was recomputed
            # (the price of a tier miss): restoring less is only good if this does not grow.
            "reusable_tokens": sum(r.get("reusable_tokens") or 0 for r in ok),
            "recomputed_reusable_tokens": sum(max(0, (r.get("reusable_tokens") or 0)
                                                  - (r.get("cached_tokens") or 0)) for r in ok),
            "bench_duration_s": s.get("duration_s")}


def run_one(name: str, kv_tokens: int, cpu_gib: float, a: argparse.Namespace, trace: str,
            out_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [CLI, "serve", "--port", str(port), "--kv-cache-tokens", str(kv_tokens),
             "--max-num-batched-tokens", str(a.max_batched), "--log-level", "warning"]
    if CONFIGS[name]:
        serve += ["--kv-cpu-gib", f"{cpu_gib:.6f}", "--kv-cpu-policy", CONFIGS[name]]
        if name.endswith("-wb"):
            serve += ["--kv-store-on", "evict"]
    env = dict(os.environ)
    if a.kv_trace:  # debug: the engine's admission/eviction trace (see kv/offload/audit.py)
        env["AGENTSERVE_KV_TRACE"] = str(out_dir.parent / (out_dir.name + ".kvtrace.jsonl"))
        Path(env["AGENTSERVE_KV_TRACE"]).unlink(missing_ok=True)
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    t0 = time.monotonic()
    try:
        wait_up(url, proc)
        bench = [CLI, "bench", "--url", url, "--trace", trace, "--mode", "sessions",
                 "--sessions", str(a.sessions), "--token-scale", str(a.token_scale),
                 "--duration", str(a.duration), "--max-output", str(a.max_output),
                 "--gap-scale", str(a.gap_scale), "--gap-cap", str(a.gap_cap),
                 "--request-timeout", str(a.request_timeout), "--out", str(out_dir)]
        subprocess.run(bench, check=False, timeout=a.duration + a.request_timeout + 120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        m = scrape(url)
        load = os.getloadavg()[0]  # the 1-minute load average, ~ over the bench itself
    finally:
        proc.terminate()
        proc.wait(30)
    r = summarize(out_dir, a.duration)
    gib = 2**30
    r.update({
        "restored_gib": metric(m, "agentserve:kv_restore_bytes") / gib,
        "stored_gib": metric(m, "agentserve:kv_store_bytes", 'tier="cpu"') / gib,
        "cpu_hit_tokens": metric(m, "agentserve:kv_tier_hit_tokens", 'tier="cpu"'),
        "gpu_hit_tokens": metric(m, "agentserve:kv_tier_hit_tokens", 'tier="gpu"'),
        "cpu_evictions": metric(m, "agentserve:kv_tier_evictions", 'tier="cpu"'),
        "restore_decisions": metric(m, "agentserve:kv_restore_decisions", 'choice="restore"'),
        "stores_skipped": metric(m, "agentserve:kv_stores_skipped"),
        "recompute_decisions": metric(m, "agentserve:kv_restore_decisions", 'choice="recompute"'),
        "restore_outcome_blocks": labelled(m, "agentserve:kv_restore_outcome_blocks", "outcome"),
        "restore_sizes": labelled(m, "agentserve:kv_restore_size", "blocks"),
        "restore_device_age_blocks": labelled(m, "agentserve:kv_restore_device_age_blocks", "age"),
        "restore_preempted_blocks": metric(m, "agentserve:kv_restore_preempted_blocks"),
        "restore_joined_blocks": metric(m, "agentserve:kv_restore_joined_blocks"),
        "prefix_joined_tokens": metric(m, "agentserve:prefix_joined_tokens"),
        "preemptions": metric(m, "vllm:num_preemptions"),
        "loadavg_1m": load, "wall_s": time.monotonic() - t0})
    return r


# ---- device eviction order, replayed offline ---------------------------------------------
def read_kv_trace(trace: Path) -> list[dict]:
    """The events of an ``AGENTSERVE_KV_TRACE`` file, in order."""
    return [json.loads(ln) for ln in trace.read_text().splitlines() if ln.strip()]


def dropped_while_waiting(ev: list[dict]) -> dict:
    """Of the restored blocks, how many the device dropped after their request had arrived
    (between its ``add`` and ``admit``): what pinning a waiting request's device hits at
    arrival could have saved. The rest were dropped before the request arrived."""
    added: dict[str, float] = {}
    evicted: dict[str, float] = {}
    restored = waiting = 0
    for e in ev:
        if e["ev"] == "add":
            added[e["rid"]] = e["t"]
        elif e["ev"] == "evict":
            evicted[e["h"]] = e["t"]
        elif e["ev"] == "admit":
            t0 = added.get(e["rid"], float("inf"))
            for h in e["h"][e["dev"]:e["dev"] + e["res"]]:
                restored += 1
                waiting += evicted.get(h, float("-inf")) >= t0
    return {"restored_blocks": restored, "dropped_while_waiting_blocks": waiting}


def device_replay(ev: list[dict], capacity_blocks: int, block_size: int = 16,
                  policies: tuple[str, ...] = ("lru", "tail-first", "agent", "hazard", "belady"),
                  horizon_s: float = 2.0) -> dict:
    """Device prefix hits (blocks) had the device evicted in another order.

    Replays the engine's own admissions (``ev``, from ``read_kv_trace``: each request's block
    hashes, admitted at its recorded time, released at its finish) through a device pool of
    ``capacity_blocks`` (running requests pinned, freed chains tail-first as the engine does)
    under: ``lru`` (the engine: validates the replay against the measured device hits),
    ``tail-first`` (highest chain position of any session first: keep every session's head),
    ``agent`` (the session policy's knowledge: a main agent waiting on its sub-agents goes
    first; sub-agent chains go stale once the main agent resumes), ``hazard`` (the session
    least likely to resume within ``horizon_s``, by the pauses observed so far, then longest
    idle: what an online predictor of the pause can do), ``belady`` (an oracle that evicts
    the block whose next use is furthest: the bound for *any* order).
    """
    import bisect
    from collections import OrderedDict, defaultdict

    adm = [e for e in ev if e["ev"] == "admit"]
    fin = {e["rid"]: e["t"] for e in ev if e["ev"] == "finish"}
    order = sorted([(e["t"], 1, i) for i, e in enumerate(adm)]
                   + [(fin.get(e["rid"], float("inf")), 0, i) for i, e in enumerate(adm)])
    uses: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(adm):
        for h in e["h"][:(e["n"] - 1) // block_size]:
            uses[h].append(i)
    out = {"measured_device_hit_blocks": sum(e["dev"] for e in adm),
           "measured_restored_blocks": sum(e["res"] for e in adm)}
    for pol in policies:
        free: OrderedDict[str, str] = OrderedDict()  # hash -> session, eviction order
        pinned: dict[str, int] = defaultdict(int)
        used, hits, reusable, seen = 0, 0, 0, set()
        root: dict[str, str] = {}
        main: dict[str, set] = defaultdict(set)
        subs: dict[str, set] = defaultdict(set)
        waiting, stale = set(), set()
        pos_of: dict[str, int] = {}  # chain position of each hash
        last_end: dict[str, float] = {}
        active: dict[str, int] = defaultdict(int)
        pauses: list[float] = []  # observed pauses, sorted

        def surv(x: float) -> float:
            return 1 - bisect.bisect_right(pauses, x) / len(pauses) if pauses else 1.0

        def resume_p(sid: str, now: float) -> float:
            if active[sid]:
                return 1.0
            idle = now - last_end.get(sid, now)
            sx = surv(idle)
            return 0.0 if sx <= 0 else (sx - surv(idle + horizon_s)) / sx

        for now, kind, i in order:
            e = adm[i]
            sid, hs = e["sid"], e["h"]
            if kind == 0:
                active[sid] -= 1
                last_end[sid] = now
                used -= 1  # the partial last block
                for h in reversed(hs):
                    pinned[h] -= 1
                    if pinned[h] == 0:
                        del pinned[h]
                        free[h] = sid
                continue
            if hs and root.setdefault(sid, hs[0]) == hs[0]:  # a main-agent turn
                main[sid] = set(hs)
                waiting.discard(sid)
                stale |= subs.pop(sid, set()) - main[sid]
            elif hs:
                waiting.add(sid)
                subs[sid].update(hs)
            stale.difference_update(hs)
            if sid in last_end and not active[sid]:
                bisect.insort(pauses, now - last_end[sid])
            active[sid] += 1
            pre = hs[:(e["n"] - 1) // block_size]
            hits += next((j for j, h in enumerate(pre) if h not in free and not pinned.get(h)),
                         len(pre))
            reusable += next((j for j, h in enumerate(pre) if h not in seen), len(pre))
            seen.update(hs)
            need = 1
            for h in hs:
                if pinned.get(h):
                    pinned[h] += 1
                    continue
                if h in free:
                    del free[h]
                else:
                    need += 1
                pinned[h] = 1
            while used + need > capacity_blocks and free:
                if pol == "lru":
                    free.popitem(last=False)
                    used -= 1
                    continue
                if pol == "belady":
                    def nxt(h: str) -> float:
                        u = uses[h]
                        j = bisect.bisect_right(u, i)
                        return u[j] if j < len(u) else float("inf")
                    v = max(free, key=nxt)
                elif pol == "hazard":
                    v = min(free, key=lambda h: (resume_p(free[h], now),
                                                 -(now - last_end.get(free[h], now))))
                elif pol == "tail-first":  # the chain position is its index in any chain
                    v = max(free, key=lambda h: pos_of.get(h, 0))
                else:  # agent
                    v = next((h for h in free if h in stale), None) or next(
                        (h for h, s_ in free.items() if s_ in waiting and h in main[s_]),
                        next(iter(free)))
                del free[v]
                used -= 1
            used += need
            pos_of.update((h, j) for j, h in enumerate(hs))
        out[pol] = {"device_hit_blocks": hits, "reusable_prefix_blocks": reusable}
    return out


# ---- plots ----------------------------------------------------------------------------------
def write_plots(res: dict, prefix: Path) -> list[str]:
    """<prefix>_ttft.png (TTFT p50 / p90) and <prefix>_restored.png (restored GiB and reusable
    tokens recomputed) per config per live/device ratio."""
    from agentserve.workload.plots import _save, plt

    ratios = sorted({k.split("/")[0] for k in res["runs"]}, key=lambda r: float(r.rstrip("x")))
    names = [n for n in CONFIGS if any(k.endswith("/" + n) for k in res["runs"])]
    xs = np.arange(len(ratios))
    w = 0.8 / max(1, len(names))

    def panel(ax, key: str, scale: float, ylabel: str) -> None:
        for j, n in enumerate(names):
            ys = [(res["runs"].get(f"{r}/{n}") or {}).get(key) for r in ratios]
            ax.bar(xs + (j - (len(names) - 1) / 2) * w, [0 if y is None else y * scale for y in ys],
                   w, label=n, color=COLORS.get(n))
        ax.set_xticks(xs, [f"live = {r} device" for r in ratios])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")

    paths = []
    for suffix, panels in (("ttft", [("ttft_p50_s", 1.0, "TTFT p50 (s)"),
                                     ("ttft_p90_s", 1.0, "TTFT p90 (s)")]),
                           ("restored", [("restored_gib", 1.0, "restored GiB"),
                                         ("recomputed_reusable_tokens", 1e-3,
                                          "reusable tokens recomputed (K)")])):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (key, scale, label) in zip(axes, panels):
            panel(ax, key, scale, label)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"paused sessions: {res['args']['sessions']} sessions, "
                     f"{res['args']['duration']:g} s per run, CPU tier "
                     f"{res['args'].get('cpu_x', 1.0):g}x live KV")
        paths.append(str(_save(fig, Path(f"{prefix}_{suffix}.png"))))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="Weka JSONL; default: synthesize")
    ap.add_argument("--profile", default="sweep")
    ap.add_argument("--synth-sessions", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ratios", default="1.5,3,5")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--token-scale", type=int, default=4)
    ap.add_argument("--duration", type=float, default=50)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--gap-scale", type=float, default=1.0)
    ap.add_argument("--gap-cap", type=float, default=30)
    ap.add_argument("--service-s", type=float, default=0.3, help="sizing: seconds per request")
    ap.add_argument("--cpu-x", type=float, default=1.0, help="CPU tier size / live KV")
    ap.add_argument("--kv-bytes-per-token", type=int, default=4096, help="tiny model: 4096")
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--configs", default="device,cpu-lru,cpu-session", help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--kv-trace", action="store_true", help="debug: engine KV trace per run")
    ap.add_argument("--out", default="bench-out/kvtier_sessions.json",
                    help="JSON; the plots go next to it (<out>_ttft.png, <out>_restored.png)")
    ap.add_argument("--work-dir", default="bench-out", help="synthesized trace, per-run bench output")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plots of --out")
    a = ap.parse_args()
    Path(a.work_dir).mkdir(parents=True, exist_ok=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if a.plot_only:
        print("\n".join(write_plots(json.loads(Path(a.out).read_text()), Path(a.out).with_suffix(""))))
        return
    from agentserve.workload.traces import load_sessions, write_sessions

    trace = a.trace
    if trace is None:
        from agentserve.workload.synth import synthesize
        trace = str(Path(a.work_dir) / f"kvtier_sessions_{a.profile}_{a.synth_sessions}_s{a.seed}.jsonl")
        if not Path(trace).exists():
            write_sessions(synthesize(a.profile, a.synth_sessions, seed=a.seed), trace)
    sessions = load_sessions(trace).sessions
    live = live_kv(sessions, a.sessions, a.token_scale, a.gap_scale, a.gap_cap, a.duration,
                   a.service_s)
    cpu_tokens = int(a.cpu_x * live["mean"])
    cpu_gib = cpu_tokens * a.kv_bytes_per_token / 2**30
    res: dict = {"args": vars(a), "trace": trace, "live_kv_tokens": live,
                 "cpu_tier_tokens": cpu_tokens, "cpu_tier_gib": cpu_gib, "runs": {}}
    print(f"live KV ~{live['mean']:.0f} tokens (p90 {live['p90']:.0f}); CPU tier {cpu_tokens} "
          f"tokens = {cpu_gib:.4f} GiB", flush=True)
    for r in map(float, a.ratios.split(",")):
        kv_tokens = int(live["mean"] / r)
        for name in a.configs.split(","):
            out_dir = Path(a.work_dir) / f"kvtier_sessions_{r:g}x_{name}"
            v = res["runs"][f"{r:g}x/{name}"] = {"kv_cache_tokens": kv_tokens,
                                                 **run_one(name, kv_tokens, cpu_gib, a, trace, out_dir)}
            kvt = out_dir.parent / (out_dir.name + ".kvtrace.jsonl")
            if a.kv_trace and CONFIGS[name] and kvt.exists():
                ev = read_kv_trace(kvt)
                v["device_replay"] = device_replay(ev, kv_tokens // 16)
                v["restore_sources"] = dropped_while_waiting(ev)
            print(f"{r:g}x {name}: {json.dumps(v)}", flush=True)
            Path(a.out).write_text(json.dumps(res, indent=2))
    print(table(res))
    print("\n".join(write_plots(res, Path(a.out).with_suffix(""))))


def table(res: dict) -> str:
    lines = ["| live/device | config | requests | TTFT p50 s | TTFT p90 s | resumed TTFT p50 s | "
             "out tok/s | restored GiB | stored GiB | reusable tokens recomputed | load 1m |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = (lambda x, p=3: "-" if x is None else f"{x:.{p}f}")
    for k, v in res["runs"].items():
        ratio, name = k.split("/")
        lines.append(f"| {ratio} | {name} | {v['requests_ok']} | {f(v['ttft_p50_s'])} | "
                     f"{f(v['ttft_p90_s'])} | {f(v['resumed_ttft_p50_s'])} | {f(v['output_tok_s'], 1)} | "
                     f"{f(v['restored_gib'], 4)} | {f(v['stored_gib'], 4)} | "
                     f"{v.get('recomputed_reusable_tokens', '-')} | {f(v.get('loadavg_1m'), 1)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
