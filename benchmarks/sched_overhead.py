"""ENGINE-1 benchmark: scheduler + bookkeeping time per decode step at batch 32, excluding the forward.

Runs the engine core in-process on the tiny model (no HTTP), prefills 32 requests,
then times decode steps split into: schedule, batch preparation (block tables,
slot mapping), model forward, sampling, and post-processing (token append, stop
checks, block hashing/caching, events). Bookkeeping = everything but forward+sampling.

    .venv/bin/python benchmarks/sched_overhead.py --out bench-out/sched_overhead.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from agentserve.engine.model import runner as runner_mod
from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.core.sequence import Sequence


class Timers:
    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t.setdefault(name, []).append(time.perf_counter() - t0)
        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="bench-out/sched_overhead.json")
    args = ap.parse_args()
    eng = AsyncEngine.from_args(kv_cache_tokens=65536, max_num_batched_tokens=8192,
                                kv_events_endpoint="tcp://127.0.0.1:0")
    core = eng.core
    rng = random.Random(0)
    for i in range(args.batch):
        p = [rng.randrange(16, 4000) for _ in range(args.prompt)]
        core.seqs[f"r{i}"] = s = Sequence(f"r{i}", p, SamplingParams(max_tokens=10_000, temperature=0.0,
                                                                     ignore_eos=True))
        core.scheduler.add(s)
    while any(s.num_output_tokens == 0 for s in core.seqs.values()):
        core.step([])  # prefill
    tm = Timers()
    core.scheduler.schedule = tm.wrap("schedule", core.scheduler.schedule)
    runner_mod.prepare_batch = tm.wrap("prepare_batch", runner_mod.prepare_batch)
    core.runner.model.forward = tm.wrap("forward", core.runner.model.forward)
    runner_mod.sample = tm.wrap("sample", runner_mod.sample)
    step = tm.wrap("step", core.step)
    with torch.inference_mode():
        for _ in range(args.steps):
            step([])
    med = {k: statistics.median(v) * 1e3 for k, v in tm.t.items()}
    book = [s - f - sm for s, f, sm in zip(tm.t["step"], tm.t["forward"], tm.t["sample"])]
    result = {"batch": args.batch, "context": args.prompt, "steps": args.steps,
              "median_ms": med, "bookkeeping_ms_p50": statistics.median(book) * 1e3,
              "bookkeeping_ms_p90": sorted(book)[int(0.9 * len(book))] * 1e3,
              "decode_tok_s": args.batch / statistics.median(tm.t["step"])}
    core.publisher.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
