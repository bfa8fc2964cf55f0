"""Garbage-collector pauses in a serving engine: startup heap frozen (the default) vs not.

Two real engines (`agentserve serve`, tiny model, a CPU tier) run side by side on the same
machine and get the same load at the same time: ``frozen`` (default) and ``unfrozen``
(``AGENTSERVE_GC_FREEZE=0``). Load: ``--sessions`` concurrent agent-like sessions, each
``--turns`` streamed turns whose prompt grows by ``--delta`` random tokens a turn (the
previous turn's prompt + answer + new text), ``--max-tokens`` each.

Measured per engine: full (generation 2) collections and their pauses from the engine's
own ``/metrics`` (``agentserve:gc_pause_seconds{generation="2"}``, ``..._max_seconds``),
frozen objects, and on the client: TTFT and inter-token gaps (p50 / p99 / max) and gaps
over ``--stall-ms``. ``ratio`` = unfrozen / frozen.

    .venv/bin/python benchmarks/gc_pauses.py --out benchmarks/results/gc_pauses.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_itl import loadavg, prompt, quantile, stream

from agentserve.cluster.procs import ManagedProcess, agentserve_cmd, free_port, running, start_process

ENGINES = {"frozen": {}, "unfrozen": {"AGENTSERVE_GC_FREEZE": "0"}}


def start(run_dir: Path, name: str, env: dict[str, str], extra: list[str]) -> ManagedProcess:
    port = free_port()
    cmd = agentserve_cmd("serve", "--host", "127.0.0.1", "--port", str(port), *extra)
    return start_process(name, cmd, run_dir / f"{name}.log", f"http://127.0.0.1:{port}",
                         {"OMP_NUM_THREADS": "1", **env})


async def gc_stats(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Generation-2 collections, their total and longest pause, frozen objects."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()

    def one(pattern: str) -> float:
        m = re.search(pattern, text, re.M)
        return float(m.group(1)) if m else 0.0
    g2 = r'\{generation="2",model_name="[^"]*"\} (\S+)$'
    return {"gen2_count": one(r"^agentserve:gc_pause_seconds_count" + g2),
            "gen2_seconds": one(r"^agentserve:gc_pause_seconds_sum" + g2),
            "gen2_max_s": one(r"^agentserve:gc_pause_max_seconds" + g2),
            "frozen_objects": one(r"^agentserve:gc_frozen_objects\{[^}]*\} (\S+)$")}


async def session(s: aiohttp.ClientSession, url: str, seed: int, a: argparse.Namespace,
                  recs: list[dict]) -> None:
    rng = random.Random(seed)  # same seed on both engines: the same prompts
    ids = prompt(a.first, rng)
    for _ in range(a.turns):
        ids = ids + prompt(a.delta, rng)
        rec = await stream(s, url, {"prompt": ids, "max_tokens": a.max_tokens,
                                    "temperature": 0.0, "ignore_eos": True,
                                    "return_token_ids": True})
        if rec["error"]:
            raise RuntimeError(f"{url}: {rec['error']}")
        recs.append(rec)
        ids = ids + [16 + i % 1000 for i in range(len(rec["times"]))]  # the answer, roughly


def summarize(recs: list[dict], stall_ms: float) -> dict:
    ttft = [r["times"][0] - r["t_send"] for r in recs if r["times"]]
    gaps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:])]
    return {"requests": len(recs), "ttft_p50_ms": quantile(ttft, 0.5) * 1e3,
            "ttft_p99_ms": quantile(ttft, 0.99) * 1e3, "ttft_max_ms": max(ttft) * 1e3,
            "itl_p50_ms": quantile(gaps, 0.5) * 1e3, "itl_p99_ms": quantile(gaps, 0.99) * 1e3,
            "itl_max_ms": max(gaps) * 1e3,
            "stalls": sum(g * 1e3 > stall_ms for g in gaps)}


async def measure(a: argparse.Namespace, urls: dict[str, str]) -> dict:
    out: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        recs: dict[str, list[dict]] = {n: [] for n in urls}
        await asyncio.gather(*(session(s, url, a.seed + i, a, recs[n])
                               for n, url in urls.items() for i in range(a.sessions)))
        for n, url in urls.items():
            out[n] = {**summarize(recs[n], a.stall_ms), **(await gc_stats(s, url))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--first", type=int, default=1024, help="first prompt, tokens")
    ap.add_argument("--delta", type=int, default=256, help="new tokens a turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stall-ms", type=float, default=100.0)
    ap.add_argument("--engine-args", default="--kv-cache-tokens 16384 --max-model-len 8192 "
                    "--kv-cpu-gib 0.25", help="both engines' extra flags")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gc_pauses.json"))
    a = ap.parse_args()
    need = a.first + a.turns * (a.delta + a.max_tokens)
    flags = a.engine_args.split()
    if "--max-model-len" in flags and need > int(flags[flags.index("--max-model-len") + 1]):
        ap.error(f"the last turn needs {need} tokens, over the engines' --max-model-len: "
                 "lower --turns, --first or --delta")

    run_dir = Path(tempfile.mkdtemp(prefix="gc-pauses-"))
    procs = {n: start(run_dir, n, env, a.engine_args.split()) for n, env in ENGINES.items()}
    t0, load0 = time.perf_counter(), loadavg()
    with running(procs, run_dir):
        res = asyncio.run(measure(a, {n: p.url for n, p in procs.items()}))
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "loadavg_1m_5m_15m_start": load0, "loadavg_1m_5m_15m_end": loadavg(),
              "total_wall_s": round(time.perf_counter() - t0, 1), "engines": res}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))

    t = Table(title=f"GC pauses, {a.sessions} sessions x {a.turns} turns, side by side")
    t.add_column("")
    for n in res:
        t.add_column(n, justify="right")
    t.add_column("unfrozen / frozen", justify="right")
    for key in ("frozen_objects", "gen2_count", "gen2_seconds", "gen2_max_s", "ttft_p50_ms",
                "ttft_p99_ms", "ttft_max_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "stalls"):
        f, u = res["frozen"][key], res["unfrozen"][key]
        ratio = f"{u / f:.2f}" if f else "-"
        t.add_row(key, *(f"{res[n][key]:.4g}" for n in res), ratio)
    Console().print(t)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
