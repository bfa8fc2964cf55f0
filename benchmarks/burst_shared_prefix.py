"""A sub-agent group starting together over a shared prefix: restored once, computed once?

One engine (`agentserve serve`, tiny model). Each round, for a fresh shared prefix x of
``--prefix`` tokens (the session's sub-agent prompt), a burst (measured) of ``--group``
requests at once, each x + its own ``--task`` tokens, streamed: their time to first token,
and the engine's counters over the burst. Two modes:

- ``--mode restore`` (a CPU tier): before the burst, x + a task once (x reaches the device
  and, as it fills, the CPU tier), then a filler about the size of the device pool evicts x
  from the device. Without joining, every request restores x into its own device blocks
  (the same bytes up to ``--group`` times); with it, the first restores x and the others
  wait for that restore and hit x on the device (``agentserve:kv_restore_joined_blocks``).
- ``--mode compute`` (no tier): x is new. Without joining, every request admitted in the
  same step computes x itself; with it, the first computes x and the others wait for it and
  hit it in the prefix cache (``agentserve:prefix_joined_tokens``). Whether they would be
  admitted together depends on the step budget (``--max-batched``) and the per-request
  chunk cap (``--chunk-cap``, vLLM's long_prefill_token_threshold).

To compare two checkouts, run the script once per checkout (``PYTHONPATH=OTHER/src`` makes
the engine another checkout's) with ``--label`` and compare the JSON files.

    .venv/bin/python benchmarks/burst_shared_prefix.py --mode restore --out benchmarks/results/burst_restore.json
    .venv/bin/python benchmarks/burst_shared_prefix.py --mode compute --prefix 1536 \
        --chunk-cap 512 --out benchmarks/results/burst_compute.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_itl import loadavg, prompt, scrape

from agentserve.cluster.procs import agentserve_cmd, free_port, running, start_process

RESTORED = "agentserve:kv_restore_bytes_total"
JOINED = "agentserve:kv_restore_joined_blocks_total"
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
COMPUTE_JOINED = "agentserve:prefix_joined_tokens_total"


async def ttft(s: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Seconds to the first streamed token."""
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status} {await r.text()}")
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError("no tokens")
    return first - t0


async def measure(a: argparse.Namespace, url: str) -> list[dict]:
    rng = random.Random(a.seed)
    rows: list[dict] = []
    gen = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for i in range(-1, a.rounds):  # round -1 warms the engine up, unrecorded
            x = prompt(a.prefix, rng)
            if a.mode == "restore":  # x into the CPU tier, then off the device
                await ttft(s, url, {"prompt": x + prompt(a.task, rng), **gen})
                await ttft(s, url, {"prompt": prompt(a.kv_cache_tokens - a.prefix // 4, rng),
                                    **gen})
            tasks = [prompt(a.task, rng) for _ in range(a.group)]
            before = await scrape(s, url)
            t = await asyncio.gather(*[ttft(s, url, {"prompt": x + task, **gen}) for task in tasks])
            after = await scrape(s, url)
            if i < 0:
                continue
            d = {k: after.get(k, 0.0) - before.get(k, 0.0)
                 for k in (RESTORED, JOINED, QUERIES, HITS, COMPUTE_JOINED)}
            rows.append({"round": i, "ttft_ms": sorted(round(v * 1e3, 2) for v in t),
                         "restored_mib": d[RESTORED] / 2**20, "joined_blocks": d[JOINED],
                         "computed_tokens": d[QUERIES] - d[HITS],
                         "joined_computed_tokens": d[COMPUTE_JOINED]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("restore", "compute"), default="restore",
                    help="restore: x waits in the CPU tier only; compute: x is new")
    ap.add_argument("--prefix", type=int, default=4096, help="tokens of the shared prefix")
    ap.add_argument("--task", type=int, default=256, help="tokens of each request's own task")
    ap.add_argument("--group", type=int, default=4, help="requests in the burst")
    ap.add_argument("--kv-cache-tokens", type=int, default=24576, help="the device pool")
    ap.add_argument("--kv-cpu-gib", type=float, default=0.5, help="--mode restore only")
    ap.add_argument("--max-batched", type=int, default=2048, help="step token budget")
    ap.add_argument("--chunk-cap", type=int, default=0,
                    help="--long-prefill-token-threshold (0: off, as the recorded runs; the "
                    "engine's own default is half of --max-batched)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="names this run in the JSON (e.g. the checkout)")
    ap.add_argument("--out", default="benchmarks/results/burst_shared_prefix.json")
    a = ap.parse_args()
    t0, load_start = time.time(), loadavg()
    run_dir = Path(tempfile.mkdtemp(prefix="burst-shared-prefix-"))
    subprocess.run(agentserve_cmd("model", "make-tiny", "--out", str(run_dir / "model")),
                   check=True, capture_output=True)
    port = free_port()
    cmd = agentserve_cmd("serve", "--host", "127.0.0.1", "--port", str(port), "--model",
                         str(run_dir / "model"), "--max-model-len", str(a.kv_cache_tokens),
                         "--kv-cache-tokens", str(a.kv_cache_tokens),
                         "--max-num-batched-tokens", str(a.max_batched),
                         "--long-prefill-token-threshold", str(a.chunk_cap),
                         *(["--kv-cpu-gib", str(a.kv_cpu_gib)] if a.mode == "restore" else []))
    procs = {"engine": start_process("engine", cmd, run_dir / "engine.log",
                                     f"http://127.0.0.1:{port}")}
    with running(procs, run_dir):
        rows = asyncio.run(measure(a, procs["engine"].url))
    all_ttft = [v for r in rows for v in r["ttft_ms"]]
    summary = {"ttft_p50_ms": round(statistics.median(all_ttft), 2),
               "ttft_max_ms": round(max(all_ttft), 2),
               "burst_last_ttft_p50_ms": round(statistics.median(r["ttft_ms"][-1] for r in rows), 2),
               "restored_mib_per_burst": round(statistics.median(r["restored_mib"] for r in rows), 2),
               "prefix_mib": round(a.prefix * 4096 / 2**20, 2),  # tiny: 4096 KV bytes a token
               "joined_blocks_per_burst": statistics.median(r["joined_blocks"] for r in rows),
               "computed_tokens_per_burst": statistics.median(r["computed_tokens"] for r in rows),
               "joined_computed_tokens_per_burst": statistics.median(
                   r["joined_computed_tokens"] for r in rows)}
    where = "in the CPU tier only" if a.mode == "restore" else "never seen before"
    table = Table(title=f"{a.group} requests at once over a {a.prefix}-token prefix {where}, + "
                        f"{a.task} tokens each ({a.label or 'this checkout'}; median of "
                        f"{a.rounds}; {os.cpu_count()} CPUs, load {load_start[0]})")
    cols = {"ttft_p50_ms": "TTFT p50 ms", "burst_last_ttft_p50_ms": "last of burst p50 ms",
            "ttft_max_ms": "max ms", "restored_mib_per_burst": "restored MiB / burst",
            "prefix_mib": "prefix MiB", "joined_blocks_per_burst": "joined blocks / burst",
            "computed_tokens_per_burst": "computed tokens / burst",
            "joined_computed_tokens_per_burst": "joined tokens / burst"}
    if a.mode == "compute":
        for k in ("restored_mib_per_burst", "prefix_mib", "joined_blocks_per_burst"):
            del cols[k]
    for col in cols.values():
        table.add_column(col, justify="right")
    table.add_row(*(str(summary[k]) for k in cols))
    Console(width=140).print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "label": a.label, "config": {k: v for k, v in vars(a).items() if k != "out"},
        "cpu_count": os.cpu_count(), "loadavg_1m_5m_15m_start": load_start,
        "loadavg_1m_5m_15m_end": loadavg(), "total_wall_s": round(time.time() - t0, 1),
        "summary": summary, "rounds": rows}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
