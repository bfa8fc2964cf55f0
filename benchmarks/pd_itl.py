"""Decode ITL of streaming users while long prefills arrive: aggregated vs 1P1D, same cores.

Each round starts a real cluster with `agentserve.cluster.launch.Cluster` (what `agentserve up`
runs): ``--topology 2`` (two ``both`` engines behind the router) or ``--topology 1P1D``
(one prefill + one decode engine). Both get the same machine and the same OMP thread split
(``cpu_count // engines`` each), so P/D adds no compute here; the claim under test is only
that decode steps stop containing prefill chunks.

Same load on both:

* ``--users`` streaming users, each in a closed loop: a short distinct prompt
  (``--user-prompt`` tokens, below the router's P/D threshold, so it is prefilled where it
  decodes), ``--user-tokens`` output tokens with ``ignore_eos``;
* after a quiet phase (``--quiet-s``), an open-loop stream of long-prompt requests
  (``--long-lengths`` cycled, ``--long-max-tokens`` output) every ``--long-interval-s``
  for ``--loaded-s`` seconds.

ITL is measured on the client from SSE chunk arrival times: every gap between two content
chunks of one user request, split over the tokens of the later chunk (token-weighted),
assigned to the quiet or the loaded phase by the time it ends. Token-weighted quantiles
hide rare freezes (one 3 s gap is one token), so stalls are counted too: gaps over
``--stall-ms`` and the user time spent in them. Reported per round: ITL
p50/p90/p99/max in each phase, the long requests' client TTFT, and how many long
requests took the P/D path (``x-agentserve-pd`` header). Topologies alternate (A, B, A, B
for ``--rounds 2``); the summary is the median over rounds. Every process is stopped at
the end (also on Ctrl-C).

    .venv/bin/python benchmarks/pd_itl.py --out benchmarks/results/pd_itl.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from agentserve.cluster.launch import Cluster, parse_topology
from agentserve.cluster.procs import free_port


# ---- shared with docs/studies/pd_ttft/pd_ttft.py ----------------------------------------
@contextmanager
def cluster(topology: str, engine_args: list[str] | None = None):
    """A started cluster (router + engines) that is always stopped on exit."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"pd-bench-{topology}-"))
    c = Cluster(run_dir, port=free_port(), engine_args=engine_args or [])
    try:
        c.start(parse_topology(topology))
        yield c
    finally:
        c.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def prompt(length: int, rng: random.Random, vocab: int = 4000) -> list[int]:
    """Random token ids away from the special tokens: no shared prefix between prompts."""
    return [rng.randrange(16, vocab - 16) for _ in range(length)]


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """POST a streamed completion; absolute perf_counter times of every content chunk."""
    body = {**body, "stream": True}
    rec: dict = {"t_send": time.perf_counter(), "times": [], "tokens": [], "headers": {},
                 "status": 0, "error": None}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            rec["status"] = r.status
            rec["headers"] = {k.lower(): v for k, v in r.headers.items()
                              if k.lower().startswith("x-agentserve")}
            if r.status != 200:
                rec["error"] = (await r.text())[:200]
                return rec
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                n = 0
                for c in chunk.get("choices") or []:
                    ids = c.get("token_ids")
                    n += len(ids) if ids is not None else (1 if c.get("text") else 0)
                if n:
                    rec["times"].append(now)
                    rec["tokens"].append(n)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def model_id(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}, histogram buckets dropped."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_bucket{" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        except ValueError:
            pass
    return out


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def weighted_quantile(pairs: list[tuple[float, int]], q: float) -> float | None:
    """Quantile of values each repeated by its weight (token-weighted ITL)."""
    if not pairs:
        return None
    pairs = sorted(pairs)
    total = sum(w for _, w in pairs)
    acc = 0
    for v, w in pairs:
        acc += w
        if acc >= q * total:
            return v
    return pairs[-1][0]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- this benchmark -----------------------------------------------------------------------
async def run_round(c: Cluster, a: argparse.Namespace, seed: int) -> dict:
    url = c.state()["router"]
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        model = await model_id(s, url)
        # warm every engine once (first-step allocation, torch kernels) before timing
        await asyncio.gather(*[stream(s, url, {"model": model, "prompt": prompt(a.user_prompt, rng),
                                              "max_tokens": 8, "ignore_eos": True})
                               for _ in range(4)])
        engines = c.state()["engines"]
        before = {e["url"]: await scrape(s, e["url"]) for e in engines}
        load_start = loadavg()
        t0 = time.perf_counter()
        t_quiet = t0 + a.quiet_s
        t_end = t_quiet + a.loaded_s
        user_recs: list[dict] = []

        async def user(u: int) -> None:
            urng = random.Random(seed * 1000 + u)
            while time.perf_counter() < t_end:
                user_recs.append(await stream(s, url, {
                    "model": model, "prompt": prompt(a.user_prompt, urng), "max_tokens": a.user_tokens,
                    "ignore_eos": True, "temperature": 0.0}))

        async def long_stream() -> list[dict]:
            tasks, k = [], 0
            lengths = [int(x) for x in a.long_lengths.split(",")]
            lrng = random.Random(seed * 7919)
            while True:
                at = t_quiet + k * a.long_interval_s
                if at >= t_end:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                n = lengths[k % len(lengths)]
                tasks.append(asyncio.create_task(stream(s, url, {
                    "model": model, "prompt": prompt(n, lrng), "max_tokens": a.long_max_tokens,
                    "ignore_eos": True, "temperature": 0.0})))
                tasks[-1].prompt_len = n  # type: ignore[attr-defined]
                k += 1
            recs = await asyncio.gather(*tasks)
            for t, r in zip(tasks, recs):
                r["prompt_len"] = t.prompt_len  # type: ignore[attr-defined]
            return recs

        users = [asyncio.create_task(user(u)) for u in range(a.users)]
        long_recs = await long_stream()
        await asyncio.wait_for(asyncio.gather(*users), a.drain_timeout_s)
        wall = time.perf_counter() - t0
        after = {e["url"]: await scrape(s, e["url"]) for e in engines}
        load_end = loadavg()

    phases: dict[str, list[tuple[float, int]]] = {"quiet": [], "loaded": []}
    errors = sum(1 for r in user_recs + long_recs if r["error"])
    for r in user_recs:
        for prev, t, n in zip(r["times"], r["times"][1:], r["tokens"][1:]):
            if t0 + a.skip_s <= t < t_quiet:
                phases["quiet"].append(((t - prev) / n, n))
            elif t_quiet <= t <= t_end:
                phases["loaded"].append(((t - prev) / n, n))
    itl = {}
    for ph, pairs in phases.items():
        span = a.loaded_s if ph == "loaded" else a.quiet_s - a.skip_s
        itl[ph] = {"tokens": sum(w for _, w in pairs),
                   "user_tok_s": round(sum(w for _, w in pairs) / span, 1),
                   **{f"p{int(q * 100)}_ms": _ms(weighted_quantile(pairs, q)) for q in (0.5, 0.9, 0.99)},
                   "max_ms": _ms(max((v for v, _ in pairs), default=None)),
                   # stalls: user-visible freezes, which token-weighted quantiles hide
                   f"gaps_over_{int(a.stall_ms)}ms": sum(1 for v, w in pairs if v * w > a.stall_ms / 1e3),
                   "stall_s": round(sum(v * w for v, w in pairs if v * w > a.stall_ms / 1e3), 3)}
    ttfts = [r["times"][0] - r["t_send"] for r in long_recs if r["times"]]
    pd_hdr = [r["headers"].get("x-agentserve-pd", "") for r in long_recs]
    prefill_ms = [float(h.split("prefill_ms=")[1].split(";")[0]) for h in pd_hdr if "prefill_ms=" in h]
    delta = {e["url"]: {k: after[e["url"]].get(k, 0.0) - before[e["url"]].get(k, 0.0)
                        for k in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                  "vllm:num_preemptions_total", "agentserve:kv_transfer_pulls_total",
                                  "agentserve:kv_transfer_pull_seconds_total")}
             for e in engines}
    return {
        "wall_s": round(wall, 2), "loadavg_start": load_start, "loadavg_end": load_end,
        "user_requests": len(user_recs), "errors": errors, "itl": itl,
        "long": {"sent": len(long_recs), "completed": len(ttfts),
                 "prompt_lens": [r["prompt_len"] for r in long_recs],
                 "ttft_p50_s": _r(quantile(ttfts, 0.5)), "ttft_p90_s": _r(quantile(ttfts, 0.9)),
                 "ttft_max_s": _r(max(ttfts, default=None)),
                 "disaggregated": sum(1 for h in pd_hdr if "prefill_ms=" in h),
                 "fallbacks": sum(1 for h in pd_hdr if h.startswith("fallback")),
                 "prefill_leg_ms_p50": _r(quantile(prefill_ms, 0.5), 1)},
        "engines": [{"role": e["role"], **{k.split(":")[-1]: round(v, 3)
                                          for k, v in delta[e["url"]].items()}} for e in engines],
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", default="2,1P1D", help="A,B (alternated per round)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--user-prompt", type=int, default=64)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--long-lengths", default="4096,6144")
    ap.add_argument("--long-max-tokens", type=int, default=4)
    ap.add_argument("--long-interval-s", type=float, default=4.0)
    ap.add_argument("--quiet-s", type=float, default=6.0)
    ap.add_argument("--loaded-s", type=float, default=24.0)
    ap.add_argument("--skip-s", type=float, default=1.0, help="start of the quiet phase not counted")
    ap.add_argument("--stall-ms", type=float, default=250.0, help="a gap above this is a stall")
    ap.add_argument("--drain-timeout-s", type=float, default=120.0)
    ap.add_argument("--engine-args", default="", help="extra `agentserve serve` args for every engine")
    ap.add_argument("--out", default="benchmarks/results/pd_itl.json")
    a = ap.parse_args()
    topos = a.topologies.split(",")
    console = Console(width=160)
    rows = []
    t_start = time.time()
    for rnd in range(a.rounds):
        for topo in topos:
            console.print(f"round {rnd + 1}/{a.rounds}: topology {topo} ...")
            with cluster(topo, a.engine_args.split()) as c:
                res = asyncio.run(run_round(c, a, seed=rnd))
            rows.append({"round": rnd + 1, "topology": topo, **res})
            q, ld = res["itl"]["quiet"], res["itl"]["loaded"]
            console.print(f"  ITL quiet p50/p90 {q['p50_ms']}/{q['p90_ms']} ms, loaded "
                          f"{ld['p50_ms']}/{ld['p90_ms']} ms, long TTFT p50 {res['long']['ttft_p50_s']} s")
    summary = {}
    for topo in topos:
        rs = [r for r in rows if r["topology"] == topo]
        summary[topo] = {
            f"{ph}_{k}": _med([r["itl"][ph][k] for r in rs])
            for ph in ("quiet", "loaded") for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")}
        summary[topo]["loaded_user_tok_s"] = _med([r["itl"]["loaded"]["user_tok_s"] for r in rs])
        summary[topo]["loaded_stall_s"] = _med([r["itl"]["loaded"]["stall_s"] for r in rs])
        summary[topo]["long_ttft_p50_s"] = _med([r["long"]["ttft_p50_s"] for r in rs])
        summary[topo]["long_ttft_p90_s"] = _med([r["long"]["ttft_p90_s"] for r in rs])
    table = Table(title=f"Decode ITL (token-weighted, client SSE) with long prefills arriving - "
                        f"{a.users} users x {a.user_tokens} tok, long {a.long_lengths} every "
                        f"{a.long_interval_s}s, {os.cpu_count()} CPUs")
    for col in ("round", "topology", "quiet p50/p90 ms", "loaded p50/p90 ms", "loaded p99/max ms", "loaded stalls (s)", "loaded user tok/s",
                "long TTFT p50/p90 s", "long P/D", "errors", "load 1m"):
        table.add_column(col, justify="right")
    for r in rows:
        q, ld, lg = r["itl"]["quiet"], r["itl"]["loaded"], r["long"]
        table.add_row(str(r["round"]), r["topology"], f"{q['p50_ms']} / {q['p90_ms']}",
                      f"{ld['p50_ms']} / {ld['p90_ms']}", f"{ld['p99_ms']} / {ld['max_ms']}",
                      f"{ld[f'gaps_over_{int(a.stall_ms)}ms']} ({ld['stall_s']})", str(ld["user_tok_s"]),
                      f"{lg['ttft_p50_s']} / {lg['ttft_p90_s']}",
                      f"{lg['disaggregated']}/{lg['sent']}", str(r["errors"]),
                      f"{r['loadavg_start'][0]}->{r['loadavg_end'][0]}")
    for topo, sm in summary.items():
        table.add_row("median", topo, f"{sm['quiet_p50_ms']} / {sm['quiet_p90_ms']}",
                      f"{sm['loaded_p50_ms']} / {sm['loaded_p90_ms']}",
                      f"{sm['loaded_p99_ms']} / {sm['loaded_max_ms']}", f"({sm['loaded_stall_s']})",
                      str(sm["loaded_user_tok_s"]),
                      f"{sm['long_ttft_p50_s']} / {sm['long_ttft_p90_s']}", "", "", "",
                      style="bold")
    console.print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "config": {k: v for k, v in vars(a).items() if k != "out"}, "cpu_count": os.cpu_count(),
        "loadavg_1m_5m_15m_end": loadavg(), "total_wall_s": round(time.time() - t_start, 1),
        "statistic": "token-weighted ITL quantiles per round; summary = median over rounds",
        "summary": summary, "rounds": rows}, indent=2))
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
