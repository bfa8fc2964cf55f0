"""SIM-1: calibrate the simulator's `cpu-local` hardware profile from our engine on this machine.

Runs the engine core in-process (tiny model, no HTTP) with the threads one engine of
`agentserve up --topology 2` gets (`cpu_count // 2`, as `launch.Cluster`) and fits the
linear step-time model `perf.PerfModel` uses for a measured profile:

    step = step_overhead_s + per_seq_s x seqs + tok_s x tokens
           + attn_prefill_s x sum(new x mean context) + attn_decode_s x sum(decode context)

- decode steps at batches 1, 8, 32 (context `--prompt`) -> intercept and slope per request;
- decode steps at batch 8, contexts 256 and 2048 -> `attn_decode_s` (per context token read);
- prefill chunks of `--chunk` tokens at prefix 0 and at prefix `--chunk` -> `attn_prefill_s`
  (difference) and `tok_s` (what remains per token after the intercept);
- `per_seq_s` = decode slope - tok_s - attn_decode_s x context.
The older roofline keys (`flops`, `mem_bw`, `step_overhead_s`, `per_request_s`) are kept.

    .venv/bin/python benchmarks/sim_calibrate_cpu.py --out benchmarks/results/sim_cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from agentserve.engine.engine import AsyncEngine
from agentserve.engine.request import SamplingParams
from agentserve.engine.sequence import Sequence
from agentserve.sim.specs import model_spec


def _add(core, rid: str, n: int, rng: random.Random, max_tokens: int) -> Sequence:
    p = [rng.randrange(16, 4000) for _ in range(n)]
    s = Sequence(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    core.seqs[rid] = s
    core.scheduler.add(s)
    return s


def measure_prefill_steps(core, prompt: int, rng: random.Random, tag: str) -> list[float]:
    """Step times of one cold prompt's chunks (the scheduler chunks it)."""
    s = _add(core, tag, prompt, rng, 1)
    times = []
    while s.num_output_tokens == 0:
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    assert s not in core.scheduler.running
    return times


def measure_decode(core, batch: int, prompt: int, steps: int, rng: random.Random) -> float:
    """Median decode step time at `batch` running requests."""
    seqs = [_add(core, f"d{batch}_{prompt}_{i}", prompt, rng, 10_000) for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    for s in seqs:
        core.abort(s.request_id)
    core._drain_inbox(block=False)  # the core thread is not running: apply the aborts here
    assert not core.scheduler.running, "decode measurement left requests running"
    return statistics.median(times)


def calibrate(model: str = "tiny", prompt: int = 1024, chunk: int = 2048, steps: int = 30,
              threads: int | None = None, reps: int = 3) -> dict:
    """Measure the engine and return the profile (see the module docstring)."""
    threads = threads or max(1, (os.cpu_count() or 1) // 2)
    torch.set_num_threads(threads)
    eng = AsyncEngine.from_args(kv_cache_tokens=131_072, max_num_batched_tokens=chunk)
    core, rng = eng.core, random.Random(0)
    m = model_spec(model)
    with torch.inference_mode():
        measure_prefill_steps(core, 256, rng, "warm")
        p0, p1 = [], []
        for i in range(reps):  # one chunk at prefix 0, then one at prefix `chunk`
            t = measure_prefill_steps(core, 2 * chunk, rng, f"p{i}")
            p0.append(t[0])
            p1.append(t[1])
        t_p0, t_p1 = statistics.median(p0), statistics.median(p1)
        dec = {b: measure_decode(core, b, prompt, steps, rng) for b in (1, 8, 32)}
        lo, hi = measure_decode(core, 8, 256, steps, rng), measure_decode(core, 8, 2048, steps, rng)
    slope = (dec[32] - dec[1]) / 31
    intercept = max(dec[1] - slope, 0.0)
    attn_d = max((hi - lo) / (8 * (2048 - 256)), 0.0)
    attn_p = max((t_p1 - t_p0) / (chunk * chunk), 0.0)  # mean context differs by `chunk`
    tok = max((t_p0 - intercept - attn_p * chunk * chunk / 2) / chunk, 0.0)
    per_seq = max(slope - tok - attn_d * prompt, 0.0)
    prefill_tok_s = 2 * chunk / (t_p0 + t_p1)
    w_bytes = m.total_params() * m.weight_bytes
    return {
        "model": model, "prompt": prompt, "chunk": chunk, "threads": threads,
        "measured_at": time.time(), "loadavg": os.getloadavg(),
        "prefill_chunk_s": {"prefix_0": t_p0, f"prefix_{chunk}": t_p1},
        "prefill_tok_s": prefill_tok_s,
        "decode_step_s": {str(b): t for b, t in dec.items()},
        "decode_step_b8_s": {"256": lo, "2048": hi},
        # linear step model (perf.PerfModel uses these when present)
        "step_overhead_s": intercept, "per_seq_s": per_seq, "tok_s": tok,
        "attn_prefill_s": attn_p, "attn_decode_s": attn_d,
        # roofline view, kept for the other paths
        "flops": prefill_tok_s * 2 * m.total_params(),
        "mem_bw": (w_bytes + prompt * m.kv_bytes_per_token()) / dec[1],
        "per_request_s": max(slope, 0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/sim_cpu_profile.json")
    args = ap.parse_args()
    profile = calibrate(args.model, args.prompt, args.chunk, args.steps, args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=2))
    print(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
