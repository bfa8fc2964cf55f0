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

`--through-server` (what `sim_vs_bench.py` uses) fits the same model from what a client
sees through the real stack instead: `agentserve up --topology 2` (two engines, the
router), streamed requests from an asyncio client, both engines loaded alike. Then each
step also carries what serving costs per token on these 2 shared cores (SSE framing, the
router's relay, the client's parsing, the other engine's compute): the in-process fit
misses that and under-predicted the real ITL by ~2.5x. The calibration requests are
synthetic fixed shapes (cold prompts of 16 to 4096 tokens, decode batches of 1 to 16 per
engine), not the trace the simulator is then checked against:

- decode: `2b` streams of a `--prompt`-token prompt start together; the median gap
  between tokens while all of them decode (after the last first token, before the first
  stream ends) is the step at batch b;
  batches 1, 4, 16 at context `--prompt`, and batch 8 at contexts 256 and 2048;
- prefill: two cold prompts at once (one per engine) of `chunk` and `2 x chunk` tokens;
  TTFT(chunk) - TTFT(16) is one chunk at prefix 0; TTFT(2 chunk) - TTFT(chunk) one at
  prefix `chunk`;
- `request_overhead_s`: TTFT of a 16-token prompt minus one modelled step;
  `request_overhead_per_token_s`: (TTFT of a fully cached `4 x chunk`-token prompt - TTFT
  of 16 tokens) per prompt token - what a cached prefix still costs outside the model.

    .venv/bin/python benchmarks/sim_calibrate_cpu.py --out benchmarks/results/sim_cpu_profile.json
    .venv/bin/python benchmarks/sim_calibrate_cpu.py --through-server --out ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import urllib.request
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


# ---- through the server -----------------------------------------------------------------
async def _stream(session, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the streamed tokens (first = TTFT), relative to the send."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    t0 = time.perf_counter()
    out: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                out.append(time.perf_counter() - t0)
    return out


async def _wave(url: str, model: str, n: int, prompt: int, max_tokens: int, rng: random.Random,
                ) -> list[list[float]]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        prompts = [[rng.randrange(16, 4000) for _ in range(prompt)] for _ in range(n)]
        return list(await asyncio.gather(*(_stream(session, url, model, p, max_tokens)
                                           for p in prompts)))


async def _repeat(url: str, model: str, prompt: list[int]) -> float:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return (await _stream(session, url, model, prompt, 1))[0]


def _itl(waves: list[list[float]]) -> float:
    """Median gap between tokens while every stream decodes: after the last first token
    (all prefills done) and before the first stream ends (the batch still full)."""
    lo, hi = max(w[0] for w in waves), min(w[-1] for w in waves)
    gaps = [b - a for w in waves for a, b in zip(w, w[1:]) if a > lo and b < hi]
    if len(gaps) < 8:
        raise RuntimeError(f"only {len(gaps)} decode gaps with every stream running; "
                           "raise out_tokens")
    return statistics.median(gaps)


def calibrate_server(url: str, prompt: int = 1024, chunk: int = 2048, out_tokens: int = 64,
                     reps: int = 3) -> dict:
    """Fit the linear step model from client-observed timings (two engines behind `url`)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    rng = random.Random(1)

    def wave(n: int, p: int, m: int) -> list[list[float]]:
        return asyncio.run(_wave(url, model, n, p, m, rng))

    wave(2, 256, 4)  # warm up both engines and the router
    # A fully cached prompt still costs per token outside the model (JSON, hashing, prefix
    # lookup in router and engine): TTFT of a repeated long prompt vs a short one.
    long = [rng.randrange(16, 4000) for _ in range(4 * chunk)]
    cached = []
    for _ in range(reps):
        asyncio.run(_repeat(url, model, long))
        cached.append(asyncio.run(_repeat(url, model, long)))
    ttft = {n: statistics.median(min(w[0] for w in wave(2, n, 1)) for _ in range(reps))
            for n in (16, chunk, 2 * chunk)}
    dec = {b: _itl(wave(2 * b, prompt, out_tokens)) for b in (1, 4, 16)}
    lo, hi = _itl(wave(16, 256, out_tokens)), _itl(wave(16, 2048, out_tokens))
    slope = (dec[16] - dec[1]) / 15
    intercept = max(dec[1] - slope, 0.0)
    attn_d = max((hi - lo) / (8 * (2048 - 256)), 0.0)
    t_p0 = max(ttft[chunk] - ttft[16], 1e-6)
    t_p1 = max(ttft[2 * chunk] - ttft[chunk], t_p0)
    attn_p = max((t_p1 - t_p0) / (chunk * chunk), 0.0)
    tok = max((t_p0 - attn_p * chunk * chunk / 2) / chunk, 0.0)
    per_seq = max(slope - tok - attn_d * prompt, 0.0)
    one_step = intercept + per_seq + tok * 16 + attn_p * 16 * 8
    m = model_spec("tiny")
    return {
        "model": "tiny", "prompt": prompt, "chunk": chunk, "source": "server",
        "measured_at": time.time(), "loadavg": os.getloadavg(),
        "ttft_s": {str(k): v for k, v in ttft.items()},
        "prefill_chunk_s": {"prefix_0": t_p0, f"prefix_{chunk}": t_p1},
        "prefill_tok_s": 2 * chunk / (t_p0 + t_p1),
        "decode_step_s": {str(b): t for b, t in dec.items()},
        "decode_step_b8_s": {"256": lo, "2048": hi},
        "step_overhead_s": intercept, "per_seq_s": per_seq, "tok_s": tok,
        "attn_prefill_s": attn_p, "attn_decode_s": attn_d,
        "request_overhead_s": max(ttft[16] - one_step, 0.0),
        "cached_prompt_ttft_s": {str(len(long)): statistics.median(cached)},
        "request_overhead_per_token_s": max((statistics.median(cached) - ttft[16])
                                            / (len(long) - 16), 0.0),
        "flops": 2 * chunk / (t_p0 + t_p1) * 2 * m.total_params(),
        "mem_bw": (m.total_params() * m.weight_bytes + prompt * m.kv_bytes_per_token()) / dec[1],
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
    ap.add_argument("--through-server", action="store_true",
                    help="fit from client timings through `agentserve up --topology 2`")
    ap.add_argument("--kv-tokens", type=int, default=65_536)
    ap.add_argument("--port", type=int, default=18_490)
    args = ap.parse_args()
    if args.through_server:
        import tempfile

        from agentserve.launch import Cluster, parse_topology

        work = Path(tempfile.mkdtemp(prefix="sim_calibrate_"))
        cluster = Cluster(work, port=args.port,
                          engine_args=["--kv-cache-tokens", str(args.kv_tokens),
                                       "--max-num-batched-tokens", str(args.chunk)])
        cluster.start(parse_topology("2"))
        try:
            profile = calibrate_server(f"http://127.0.0.1:{args.port}", args.prompt, args.chunk)
        finally:
            cluster.stop()
    else:
        profile = calibrate(args.model, args.prompt, args.chunk, args.steps, args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=2))
    print(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
