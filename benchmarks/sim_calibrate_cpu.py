"""SIM-1: calibrate the simulator's `cpu-local` profile from our engine on this machine.

In-process (the default): runs the engine core (tiny model, no HTTP) with the threads one
engine of `agentserve up --topology 2` gets (`cpu_count // 2`, as `launch.Cluster`) and fits
the linear step-time model of `agentserve.sim.calibrate` (its docstring says each term):

- decode steps at batches 1, 8, 32 (context `--prompt`) -> intercept and slope per request;
- decode steps at batch 8, contexts 256 and 2048 -> `attn_decode_s` (per context token read);
- cold chunks of 16, `--chunk` / 4 and `--chunk` tokens -> `tok_s` and `attn_cold_s`
  (`fit_cold`), a chunk at prefix `--chunk` -> `attn_prefill_s` (`fit_cached`). The two
  attention terms are apart because the engine runs two kernels: every chunk takes SDPA's
  plain causal path over its own tokens, and a chunk over a cached prefix adds an unmasked
  pass over the prefix, read in place (engine/model/paged_prefix.py);
- `per_seq_s` = decode slope - tok_s - attn_decode_s x context.
The older roofline keys (`flops`, `mem_bw`, `step_overhead_s`, `per_request_s`) are kept.

`--through-server` is `agentserve sim calibrate` (`agentserve.sim.calibrate`: the fit from
what a client sees through `agentserve up --topology 2`; what the committed profile and
`sim_vs_bench.py` use). The simulator imports no engine code, so the in-process measurement
lives here; the fits and the server calibration are the package's, re-exported for
`sim_vs_bench.py`, `sim_request_path.py` and docs/studies/box_speed/.

    .venv/bin/python benchmarks/sim_calibrate_cpu.py --out /tmp/sim_cpu_profile_inproc.json  # default: package data
    agentserve sim calibrate --out ...     # = --through-server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.core.sequence import Sequence
from agentserve.sim.calibrate import (  # noqa: F401  (the server calibration, re-exported)
    DECODE_BATCHES, SHORT_BATCHES, SHORT_CTX, _itl, calibrate_cluster, calibrate_server,
    fit_cached, fit_cold, model_id, probe_stretches, read_traces, with_arrival_stretch,
    write_profile)
from agentserve.sim.constants import CACHED_PREFILL_KERNEL
from agentserve.sim.specs import CPU_PROFILE_DEFAULT, model_spec


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
        core.step([])
        times.append(time.perf_counter() - t0)
    assert s not in core.scheduler.running
    return times


def measure_decode(core, batch: int, prompt: int, steps: int, rng: random.Random) -> float:
    """Mean decode step time at `batch` running requests (the mean, as a stream's tokens
    take the sum of its steps: a median drops the occasional long step they also pay)."""
    seqs = [_add(core, f"d{batch}_{prompt}_{i}", prompt, rng, 10_000) for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step([])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step([])
        times.append(time.perf_counter() - t0)
    for s in seqs:
        core.abort(s.request_id)
    core._drain_inbox(block=False)  # the core thread is not running: apply the aborts here
    assert not core.scheduler.running, "decode measurement left requests running"
    return statistics.fmean(times)


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
        small = chunk // 4
        p0, p1, cold = [], [], {16: [], small: []}
        for i in range(reps):  # one chunk at prefix 0, then one at prefix `chunk`
            t = measure_prefill_steps(core, 2 * chunk, rng, f"p{i}")
            p0.append(t[0])
            p1.append(t[1])
            for n in cold:  # smaller cold chunks: how the cost grows with the chunk
                cold[n].append(measure_prefill_steps(core, n, rng, f"c{n}_{i}")[0])
        t_p0, t_p1 = statistics.median(p0), statistics.median(p1)
        t_16, t_small = statistics.median(cold[16]), statistics.median(cold[small])
        dec = {b: measure_decode(core, b, prompt, steps, rng) for b in (1, 8, 32)}
        lo, hi = measure_decode(core, 8, 256, steps, rng), measure_decode(core, 8, 2048, steps, rng)
    slope = (dec[32] - dec[1]) / 31
    intercept = max(dec[1] - slope, 0.0)
    attn_d = max((hi - lo) / (8 * (2048 - 256)), 0.0)
    tok, attn_c = fit_cold(16, (small, t_small - t_16), (chunk, t_p0 - t_16))
    per_seq = max(slope - tok - attn_d * prompt, 0.0)
    attn_p = fit_cached(t_p1, chunk, intercept + per_seq, tok, attn_c, attn_d)
    prefill_tok_s = 2 * chunk / (t_p0 + t_p1)
    w_bytes = m.total_params() * m.weight_bytes
    return {
        "model": model, "prompt": prompt, "chunk": chunk, "threads": threads,
        "measured_at": time.time(), "loadavg": os.getloadavg(),
        "prefill_chunk_s": {"prefix_0": t_p0, f"prefix_{chunk}": t_p1, "prefix_0_16": t_16,
                            f"prefix_0_{small}": t_small},
        "prefill_tok_s": prefill_tok_s,
        "decode_step_s": {str(b): t for b, t in dec.items()},
        "decode_ref_ctx": prompt + steps // 2,  # mean context while the steps were timed
        "decode_step_b8_s": {"256": lo, "2048": hi},
        # linear step model (perf.PerfModel uses these when present)
        "step_overhead_s": intercept, "per_seq_s": per_seq, "tok_s": tok,
        "attn_prefill_s": attn_p, "attn_cold_s": attn_c, "attn_decode_s": attn_d,
        "cached_prefill": CACHED_PREFILL_KERNEL,
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
    ap.add_argument("--out", default=str(CPU_PROFILE_DEFAULT),
                    help="default: the profile the simulator reads (package data, "
                         "src/agentserve/sim/data/cpu_profile.json)")
    ap.add_argument("--through-server", action="store_true",
                    help="fit from client timings through `agentserve up --topology 2` "
                         "(= agentserve sim calibrate)")
    ap.add_argument("--kv-tokens", type=int, default=65_536)
    ap.add_argument("--port", type=int, default=18_490)
    args = ap.parse_args()
    if args.through_server:
        profile = calibrate_cluster(args.prompt, args.chunk, args.kv_tokens, args.port)
    else:
        profile = calibrate(args.model, args.prompt, args.chunk, args.steps, args.threads)
    write_profile(profile, args.out)
    print(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
