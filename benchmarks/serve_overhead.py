"""What serving over HTTP costs the engine, and whether an engine-core process would win it back.

Three measurements on the tiny model (CPU), decode at batches --batches over --ctx-token prompts:

1. ``in_process``: decode tok/s of the engine core stepped directly (engine_speed.py's loop).
2. ``served``: a real `agentserve serve` and that many streamed completions at once (aiohttp);
   tok/s counted from the client's chunk times while every stream is running (the middle 60% of
   the chunks). Also the CPU each server thread and the client used meanwhile (/proc; the
   last round's).
3. ``competing``: (1) again while a pure-Python load with a --duty duty cycle (short bursts, as
   the event loop's SSE work) runs beside it, once as a thread of the same process (it takes
   the GIL) and once as another process (it does not). vLLM runs its engine core in its own
   process to get the GIL back; if (3) shows the thread and the process costing the same, the
   loss in (2) is CPU contention with torch's threads, which a process split does not remove.

    .venv/bin/python benchmarks/serve_overhead.py --out benchmarks/results/serve_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import random_prompts
from engine_speed import decode_tok_s, prefill_tok_s

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.model.tiny import make_tiny
from agentserve.cluster.procs import agentserve_cmd, free_port, start_process

MAX_TOKENS = 160


def busy(stop, duty: float, burst_s: float = 2e-4) -> None:
    """Pure-Python bursts of `burst_s`, sleeping between them for a `duty` duty cycle."""
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < burst_s:
            sum(range(50))
        time.sleep(burst_s * (1 - duty) / duty)


def in_process(batches: list[int], ctx: int, duty: float, reps: int) -> tuple[dict, dict]:
    model = make_tiny(Path(tempfile.mkdtemp(prefix="serve-overhead-")) / "tiny")
    eng = AsyncEngine.from_args(model=str(model), device="cpu", dtype="float32",
                                kv_cache_tokens=262_144, max_num_batched_tokens=8192, max_num_seqs=256)
    core, rng = eng.core, random.Random(0)
    prefill_tok_s(core, "cpu", 256, rng)  # warm-up
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):  # alternate the modes, so drift on a noisy box hits all of them
        for mode in ("alone", "thread", "process"):
            stop = mp.Event() if mode == "process" else threading.Event()
            w = None
            if mode == "thread":
                w = threading.Thread(target=busy, args=(stop, duty), daemon=True)
            elif mode == "process":
                w = mp.Process(target=busy, args=(stop, duty), daemon=True)
            if w is not None:
                w.start()
                time.sleep(0.2)
            for b in batches:
                runs.setdefault((mode, b), []).append(decode_tok_s(core, "cpu", b, ctx, 64, rng))
            stop.set()
            if w is not None:
                w.join(10)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return ({b: med[("alone", b)] for b in batches},
            {m: {b: med[(m, b)] for b in batches} for m in ("thread", "process")})


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid` (name + tid, from /proc)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            s = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name, f = s.split("(", 1)[1].rsplit(")", 1)
        v = f.split()
        out[f"{name}:{tid}"] = (int(v[11]) + int(v[12])) / tick
    return out


async def _stream(s: aiohttp.ClientSession, url: str, prompt: list[int], stamps: list[float]) -> None:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                stamps.append(time.perf_counter())


async def _served(url: str, pid: int, batches: list[int], ctx: int, reps: int) -> tuple[dict, dict]:
    tok_s: dict[int, list[float]] = {}
    cpu: dict[int, dict] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(reps):
            for b in batches:
                prompts = random_prompts(b, ctx, seed=b)
                stamps: list[float] = []
                t0, c0, own0 = time.perf_counter(), _thread_cpu(pid), time.process_time()
                await asyncio.gather(*[_stream(s, url, p, stamps) for p in prompts])
                wall, c1 = time.perf_counter() - t0, _thread_cpu(pid)
                stamps.sort()
                lo, hi = stamps[len(stamps) // 5], stamps[4 * len(stamps) // 5]
                tok_s.setdefault(b, []).append(sum(lo <= x <= hi for x in stamps) / (hi - lo))
                per = sorted(((c1[k] - c0.get(k, 0.0)) / wall for k in c1), reverse=True)
                cpu[b] = {"server_threads_cores": [round(x, 2) for x in per if x >= 0.01],
                          "client_cores": round((time.process_time() - own0) / wall, 2)}
    return {b: statistics.median(v) for b, v in tok_s.items()}, cpu


def served(batches: list[int], ctx: int, reps: int, run_dir: Path) -> tuple[dict, dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process("engine", agentserve_cmd("serve", "--host", "127.0.0.1", "--port", str(port)),
                         run_dir / "engine.log", url)
    try:
        proc.wait_healthy(120)
        return asyncio.run(_served(url, proc.pid, batches, ctx, reps))
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--duty", type=float, default=0.10, help="the competing load's duty cycle")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench-out/serve_overhead.json")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    alone, competing = in_process(batches, a.ctx, a.duty, a.reps)
    run_dir = Path(tempfile.mkdtemp(prefix="serve-overhead-run-"))
    srv, cpu = served(batches, a.ctx, a.reps, run_dir)
    res = {"machine": f"{os.cpu_count()} cores", "ctx": a.ctx, "duty": a.duty, "reps": a.reps,
           "in_process_tok_s": alone, "served_tok_s": srv, "served_cpu": cpu,
           "competing_tok_s": competing}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    t = Table(title=f"decode tok/s, tiny model, ctx {a.ctx}, medians of {a.reps} ({os.cpu_count()} cores)")
    for col in ("batch", "in-process", "served (ratio)", f"+{a.duty:.0%} Python thread",
                f"+{a.duty:.0%} Python process", "server threads / client, cores"):
        t.add_column(col, justify="right")
    for b in batches:
        t.add_row(str(b), f"{alone[b]:.0f}", f"{srv[b]:.0f} ({srv[b] / alone[b]:.2f})",
                  f"{competing['thread'][b]:.0f} ({competing['thread'][b] / alone[b]:.2f})",
                  f"{competing['process'][b]:.0f} ({competing['process'][b] / alone[b]:.2f})",
                  f"{cpu[b]['server_threads_cores']} / {cpu[b]['client_cores']}")
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
