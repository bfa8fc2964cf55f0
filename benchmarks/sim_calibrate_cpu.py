"""SIM-1: calibrate the simulator's `cpu-local` hardware profile from our engine on this machine.

Runs the engine core in-process (tiny model, no HTTP) and measures
- prefill throughput: one prompt of `--prompt` tokens, chunked at `--chunk` tokens per step;
- decode step time at batches 1, 8 and 32 (context `--prompt`).
From them it derives the profile `agentserve.sim.specs.cpu_local` loads:
`flops` (effective FLOP/s = prefill tok/s x 2 x params per token), `mem_bw` (weights + KV
bytes of a batch-1 step over its time), `step_overhead_s` (intercept of step time vs batch)
and `per_request_s` (its slope).

    .venv/bin/python benchmarks/sim_calibrate_cpu.py --out benchmarks/results/sim_cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
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


def measure_prefill(core, prompt: int, rng: random.Random) -> float:
    """Prompt tokens per second for one cold prompt (chunked by the scheduler)."""
    s = _add(core, "prefill", prompt, rng, 1)
    t0 = time.perf_counter()
    while s.num_output_tokens == 0:
        core.step()
    return prompt / (time.perf_counter() - t0)


def measure_decode(core, batch: int, prompt: int, steps: int, rng: random.Random) -> float:
    """Median decode step time at `batch` running requests."""
    seqs = [_add(core, f"d{batch}_{i}", prompt, rng, 10_000) for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    for s in seqs:
        core.abort(s.request_id)
    core.step()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/sim_cpu_profile.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    eng = AsyncEngine.from_args(kv_cache_tokens=131_072, max_num_batched_tokens=args.chunk)
    core, rng = eng.core, random.Random(0)
    m = model_spec(args.model)
    with torch.inference_mode():
        measure_prefill(core, 256, rng)  # warm-up
        prefill_tok_s = measure_prefill(core, args.prompt, rng)
        steps = {b: measure_decode(core, b, args.prompt, args.steps, rng) for b in (1, 8, 32)}
    slope = (steps[32] - steps[1]) / 31
    w_bytes = m.total_params() * m.weight_bytes
    profile = {
        "model": args.model, "prompt": args.prompt, "chunk": args.chunk,
        "prefill_tok_s": prefill_tok_s,
        "decode_step_s": {str(b): t for b, t in steps.items()},
        "flops": prefill_tok_s * 2 * m.total_params(),
        "mem_bw": (w_bytes + args.prompt * m.kv_bytes_per_token()) / steps[1],
        "step_overhead_s": max(steps[1] - slope, 0.0),
        "per_request_s": max(slope, 0.0),
        "threads": torch.get_num_threads(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=2))
    print(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
