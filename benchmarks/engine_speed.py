"""Engine prefill and decode speed on one device (the GPU check of ENGINE-1 uses --device cuda).

Runs the engine core in-process (no HTTP): prefill tok/s of one long prompt (chunked by
--max-num-batched-tokens), then decode tok/s at several batch sizes.

    .venv/bin/python benchmarks/engine_speed.py --preset small --device cuda --dtype bfloat16
    .venv/bin/python benchmarks/engine_speed.py --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.model.sampler import make_generator
from agentserve.engine.core.sequence import Sequence


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


TEMPERATURE = 0.0  # --temperature: 0 greedy; > 0 draws every token (the sampler's other path)


def _add(core, rid: str, n: int, rng: random.Random, head: list[int] | None = None) -> Sequence:
    seq = Sequence(rid, (head or []) + [rng.randrange(16, 4000) for _ in range(n)],
                   SamplingParams(max_tokens=100_000, temperature=TEMPERATURE, ignore_eos=True))
    if TEMPERATURE > 0:
        seq.generator = make_generator(None, core.runner.device)
    core.seqs[rid] = seq
    core.scheduler.add(seq)
    return seq


def prefill_tok_s(core, device: str, n: int, rng: random.Random) -> float:
    seq = _add(core, f"p{n}", n, rng)
    _sync(device)
    t0 = time.perf_counter()
    while seq.num_output_tokens == 0:
        core.step([])
    _sync(device)
    dt = time.perf_counter() - t0
    core.scheduler.finish(seq, seq.status)
    return n / dt


def contexts(batch: int, ctx: int, mix: bool) -> list[int]:
    """Each request's context: all `ctx`, or with `mix` spread evenly from ctx / 10 to 2 x ctx
    (an agentic batch: long main-agent contexts beside short sub-agent ones)."""
    if not mix or batch == 1:
        return [ctx] * batch
    return [round(ctx * (0.1 + 1.9 * i / (batch - 1))) for i in range(batch)]


def decode_tok_s(core, device: str, batch: int, ctx: int, steps: int, rng: random.Random,
                 mix: bool = False, shared: int = 0) -> float:
    """With `shared`, every prompt starts with the same `shared` tokens (a burst of sub-agents
    under their common prompt; the prefix cache hands them its blocks) before its `ctx` own."""
    head = [rng.randrange(16, 4000) for _ in range(shared)]
    seqs = [_add(core, f"d{batch}-{i}", n, rng, head)
            for i, n in enumerate(contexts(batch, ctx, mix))]
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step([])
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step([])
    _sync(device)
    dt = time.perf_counter() - t0
    for s in seqs:
        core.scheduler.finish(s, s.status)
    return batch * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ctx-mix", action="store_true",
                    help="decode contexts spread from ctx/10 to 2 x ctx instead of all ctx")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="decode prompts start with one N-token head (sub-agents of a burst)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: every token drawn (agents' default is 1.0)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="decode windows per batch size; the median is reported, every one recorded "
                         "(on a GPU a host-bound 64-step window at batch 128 swings 12K-21K tok/s "
                         "run to run on one machine)")
    ap.add_argument("--out", default="bench-out/engine_speed.json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    global TEMPERATURE
    TEMPERATURE = args.temperature
    from agentserve.engine.model.tiny import make_tiny

    model = make_tiny(Path(tempfile.mkdtemp(prefix="engine-speed-")) / args.preset, preset=args.preset)
    eng = AsyncEngine.from_args(model=str(model), device=args.device, dtype=args.dtype,
                                kv_cache_tokens=262_144, max_num_batched_tokens=8192, max_num_seqs=256)
    core, rng = eng.core, random.Random(0)
    prefill_tok_s(core, args.device, 256, rng)  # warm-up
    prefill = prefill_tok_s(core, args.device, args.prompt, rng)  # before the decodes, as always
    runs = {b: [decode_tok_s(core, args.device, int(b), args.ctx, args.steps, rng,
                             args.ctx_mix, args.shared_prefix) for _ in range(args.repeats)]
            for b in args.batches.split(",")}
    result = {"preset": args.preset, "device": args.device, "dtype": args.dtype,
              "temperature": args.temperature,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "prefill_tokens": args.prompt,
              "prefill_tok_s": prefill,
              "ctx_mix": args.ctx_mix, "shared_prefix": args.shared_prefix,
              "decode_steps": args.steps, "repeats": args.repeats,
              "decode_tok_s": {b: statistics.median(v) for b, v in runs.items()},
              "decode_tok_s_runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    t = Table(title=f"engine speed: {args.preset} {args.dtype} on {result['gpu'] or args.device}")
    t.add_column("what")
    t.add_column("tok/s" + (f" (median of {args.repeats})" if args.repeats > 1 else ""),
                 justify="right")
    t.add_row(f"prefill {args.prompt} tokens", f"{result['prefill_tok_s']:.0f}")
    for b, v in result["decode_tok_s"].items():
        shared = f" after {args.shared_prefix} shared" if args.shared_prefix else ""
        t.add_row(f"decode batch {b} (ctx {args.ctx}{' mixed' if args.ctx_mix else ''}{shared})",
                  f"{v:.0f}")
    Console().print(t)


if __name__ == "__main__":
    main()
