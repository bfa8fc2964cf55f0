"""`agentserve sim calibrate`: fit the simulator's `cpu-local` profile on this machine.

Starts `agentserve up --topology 2` (two engines of the built-in tiny model, the router) as a
child process and fits the linear step-time model `perf.PerfModel` uses for a measured
profile from what a client sees through the real stack:

    step = step_overhead_s + per_seq_s x seqs + tok_s x tokens
           + attn_cold_s x sum(new^2 / 2)     (each chunk over its own tokens: causal kernel)
           + attn_prefill_s x sum(new x prefix)  (over a cached prefix: read in place, unmasked)
           + attn_decode_s x (decode context + cached prefill context)  (K/V streamed once)

Each step also carries what serving costs per token on the machine's shared cores (SSE
framing, the router's relay, the client's parsing, the other engine's compute): an
in-process fit misses that and under-predicted the real ITL by ~2.5x. The calibration
requests are synthetic fixed shapes (cold prompts of 16 to 4096 tokens, decode batches of 1
to 16 per engine), not the trace the simulator is then checked against:

- decode: `2b` streams of a `prompt`-token prompt start together; the mean gap between
  tokens while all of them decode (after the last first token, before the first stream
  ends; each engine's mean, then theirs) is the step at batch b, the median of three such
  waves (a wave the router split b + d : b - d counts when d <= b / 8). The mean, not the
  median: a stream's tokens take the sum of its gaps (its ITL is their mean), and the gaps
  are skewed right (GC, the router, the other engine): the median of a wave's gaps sat
  1.5-9% below their mean at batches 1-4 per engine, 0.6-2.6% at 8;
  batches 1, 2, 4, 8, 16 at context `prompt` (the simulator interpolates between them), batch
  8 at contexts 256 and 2048 (`attn_decode_s`), and batches 1, 2, 4 at context 256
  (`decode_step_short_s`: below the reference context a small batch's step shrinks less
  than batch 8's slope says, so there the simulator prices context at each batch's own
  slope below batch 8);
- prefill: two cold prompts at once of `chunk` and `2 x chunk` tokens, kept when the router
  put one on each engine (TTFT: their mean, the median of such pairs); TTFT(chunk) - TTFT(16)
  is one chunk at prefix 0; TTFT(2 chunk) - TTFT(chunk) one at prefix `chunk`;
- `request_overhead_s`: TTFT of a 16-token prompt minus one modelled step;
  `request_overhead_per_token_s`: (TTFT of a fully cached `4 x chunk`-token prompt - TTFT of
  16 tokens) per prompt token - what a cached prefix still costs outside the model;
  `request_overhead_busy_s`: what a 16-token request takes beyond that overhead, half a step
  and its own step while its engine decodes (the API server shares the engine process with
  the core thread).

The in-process fit (the engine core stepped without HTTP) stays in
`benchmarks/sim_calibrate_cpu.py`, which imports the engine (the simulator does not: the
layer contracts in pyproject.toml) and this module's fits. `benchmarks/sim_vs_bench.py`
calibrates with `calibrate_server` before and after each bench run; the committed profile
(`specs.CPU_PROFILE_DEFAULT`, package data) is the mean it writes.

    agentserve sim calibrate --out my_profile.json
    AGENTSERVE_SIM_CPU_PROFILE=my_profile.json agentserve sim --gpu cpu-local ...
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from agentserve.sim.constants import CACHED_PREFILL_KERNEL
from agentserve.sim.specs import model_spec


def fit_cold(base: int, a: tuple[int, float], b: tuple[int, float]) -> tuple[float, float]:
    """(tok_s, attn_cold_s) from two cold chunks (prefix 0) of n tokens, each given as its
    cost above a `base`-token one: d = tok x (n - base) + attn_cold x (n^2 - base^2) / 2
    (the plain causal kernel computes the lower triangle only). Solved exactly; a negative
    attention term (noise) is dropped and `b` refitted as linear."""
    (n1, d1), (n2, d2) = a, b
    x1, y1 = n1 - base, (n1 * n1 - base * base) / 2
    x2, y2 = n2 - base, (n2 * n2 - base * base) / 2
    attn = (d2 * x1 - d1 * x2) / (y2 * x1 - y1 * x2)
    if attn <= 0:
        return max(d2 / x2, 0.0), 0.0
    return max((d1 - attn * y1) / x1, 0.0), attn


def fit_cached(step: float, chunk: int, fixed: float, tok: float, attn_c: float,
               attn_d: float) -> float:
    """`attn_prefill_s` from one step that computes a `chunk`-token chunk over a cached
    `chunk`-token prefix: step = fixed + tok x chunk + attn_cold x chunk^2 / 2 (the chunk over
    itself, causal) + attn_prefill x chunk x chunk (its queries by the prefix, which the
    engine reads in place, unmasked: engine/model/paged_prefix.py) + attn_decode x chunk (the
    prefix's K and V streamed once, as a decode reads its context)."""
    return max((step - fixed - tok * chunk - attn_c * chunk * chunk / 2 - attn_d * chunk)
               / (chunk * chunk), 0.0)



# ---- through the server -----------------------------------------------------------------
async def _stream(session, url: str, model: str, prompt: list[int], max_tokens: int,
                  ) -> tuple[str, list[float]]:
    """(engine that served it, arrival times of the streamed tokens (first = TTFT), relative
    to the send)."""
    # Sampled as `agentserve bench` samples (no temperature: the engine's default 1.0), so
    # the step measured includes the draw the bench's steps pay, not the cheaper argmax.
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    out: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        engine = r.headers.get("x-agentserve-endpoint", "")
        async for line in r.content:
            if line.startswith(b"data: {"):
                out.append(time.perf_counter() - t0)
    return engine, out


async def _wave(url: str, model: str, n: int, prompt: int, max_tokens: int, rng: random.Random
                ) -> list[tuple[str, list[float]]]:
    """``n`` streams of ``prompt`` tokens at once, each prompt its own (random tokens)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        prompts = [[rng.randrange(16, 4000) for _ in range(prompt)] for _ in range(n)]
        return list(await asyncio.gather(*(_stream(session, url, model, p, max_tokens)
                                           for p in prompts)))


async def _repeat(url: str, model: str, prompt: list[int]) -> float:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return (await _stream(session, url, model, prompt, 1))[1][0]


async def _probe_busy(url: str, model: str, batch: int, probes: int, rng: random.Random,
                      prompt: list[int] | None = None) -> tuple[list[float], bool]:
    """TTFTs of `probes` 16-token requests (or each `prompt`, when given) sent one at a time (a
    random 0-20 ms apart, so they land anywhere in a step) while `2 x batch` 256-token streams
    decode; and whether every stream was still decoding when the last probe's first token
    came."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        bg = [asyncio.create_task(_stream(session, url, model,
                                          [rng.randrange(16, 4000) for _ in range(256)], 30 * probes))
              for _ in range(2 * batch)]
        await asyncio.sleep(1.0)  # their prefills done, every engine decoding its batch
        ttfts = []
        for _ in range(probes):
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            probe = prompt or [rng.randrange(16, 4000) for _ in range(16)]
            ttfts.append((await _stream(session, url, model, probe, 1))[1][0])
        last = time.perf_counter() - t0
        streams = await asyncio.gather(*bg)
        return ttfts, all(times[-1] > last for _, times in streams)


def _itl(wave: list[tuple[str, list[float]]], batch: int) -> tuple[float, float] | None:
    """(gap between tokens, output tokens so far) while every engine decodes its whole batch:
    after the wave's last first token (all prefills done) and before its first stream ends
    (every batch still full), each engine's mean gap, then their mean. None when too few gaps,
    or when the router's split is off by more than `batch // 8` streams an engine (both
    engines served: a split of b + d and b - d, d <= b / 8, measures the step at b as the
    mean of the steps at b + d and b - d, which the step's linear growth in the batch makes
    it; at batches under 8 only the exact split counts). The router's default policy weighs
    each engine's learned prefill speed, so at batch 16 (32 streams sent at once) it split
    16:16 in as few as 2 waves of 12 (stop 40): 17/15 and 14/18 were the rest."""
    by_engine: dict[str, list[list[float]]] = {}
    for engine, times in wave:
        by_engine.setdefault(engine, []).append(times)
    if len(by_engine) != 2 or any(abs(len(ts) - batch) > batch // 8 for ts in by_engine.values()):
        return None
    lo = max(t[0] for _, t in wave)
    hi = min(t[-1] for _, t in wave)
    gaps, done = [], []
    for ts in by_engine.values():
        g = [(b - a, i + 1) for t in ts for i, (a, b) in enumerate(itertools.pairwise(t))
             if a > lo and b < hi]
        if len(g) < 4:
            return None
        gaps.append(statistics.fmean(x for x, _ in g))
        done.append(statistics.fmean(n for _, n in g))
    return statistics.fmean(gaps), statistics.fmean(done)


DECODE_BATCHES = (1, 2, 4, 8, 16)  # per engine; perf.measured_step interpolates between them
SHORT_CTX, SHORT_BATCHES = 256, (1, 2, 4)  # the curve's small batches again at a short context


def model_id(url: str) -> str:
    """The first model the server at `url` serves (`/v1/models`)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def calibrate_server(url: str, prompt: int = 1024, chunk: int = 2048, out_tokens: int = 64,
                     reps: int = 3) -> dict:
    """Fit the linear step model from client-observed timings (two engines behind `url`)."""
    model = model_id(url)
    rng = random.Random(1)

    def wave(n: int, p: int, m: int) -> list[tuple[str, list[float]]]:
        return asyncio.run(_wave(url, model, n, p, m, rng))

    # A decode wave needs its 2b streams split about b:b between the engines (`_itl` draws a
    # wave the router split further off again). Every stream's prompt is its own: from stop 19 each
    # half of a wave shared a prompt head (all but the last 32 tokens) so that the router's
    # prefix scorer kept it on one engine, but streams reading the same head's blocks find
    # them in cache, and the decode step measured came out 12-16% shorter than the same
    # batch over distinct contexts (step trace, one cluster: 6.4-6.5 vs 7.5 ms at batch 4,
    # 1,088 tokens), the model's lean at c8 ever since. The router's default policy now
    # splits distinct waves about evenly by itself (recent requests per engine).

    wave(2, 256, 4)  # warm up both engines and the router
    # A fully cached prompt still costs per token outside the model (JSON, hashing, prefix
    # lookup in router and engine): TTFT of a repeated long prompt vs a short one.
    long = [rng.randrange(16, 4000) for _ in range(4 * chunk)]
    cached = []
    for _ in range(reps):
        asyncio.run(_repeat(url, model, long))
        cached.append(asyncio.run(_repeat(url, model, long)))

    def pair_ttft(n: int, k: int) -> float:
        """TTFT of a cold `n`-token prompt: the mean of two sent at once that the router
        put on different engines (two on one engine queue one behind the other; the faster
        of two, as this took before, sits below what a request sees), median of `k` pairs."""
        got = []
        for _ in range(4 * k):
            w = wave(2, n, 1)
            if len({engine for engine, _ in w}) == 2:
                got.append(statistics.fmean(times[0] for _, times in w))
                if len(got) == k:
                    return statistics.median(got)
        raise RuntimeError(f"cold prompts of {n} tokens: only {len(got)} of {4 * k} pairs "
                           "went one to each engine")

    small = chunk // 4
    ttft = {n: pair_ttft(n, reps + 2 * (n == 16)) for n in (16, small, chunk, 2 * chunk)}

    def itl(b: int, p: int) -> tuple[float, float]:
        """(step, context it read): medians of `reps` good waves (one wave swings by ~10%
        here); a wave the router split further off than `_itl` takes, or whose first streams
        ended before the last prefills, is drawn again."""
        got: list[tuple[float, float]] = []
        for k in range(4 * reps):
            # long enough that every engine's prefills end before its first stream does
            g = _itl(wave(2 * b, p, out_tokens + 16 * b), b)
            drawn[f"{b}@{p}"] = k + 1
            if g is not None:
                got.append(g)
                if len(got) == reps:
                    return statistics.median(x for x, _ in got), p + statistics.median(y for _, y in got)
        raise RuntimeError(f"decode batch {b} x 2 engines at context {p}: only {len(got)} of "
                           f"{4 * reps} waves were split within {b // 8} of {b}:{b} with all "
                           "streams decoding")

    drawn: dict[str, int] = {}  # waves drawn for each batch@context, `reps` of them good
    (lo, ctx_lo), (hi, ctx_hi) = itl(8, SHORT_CTX), itl(8, 2048)
    attn_d = max((hi - lo) / (8 * (ctx_hi - ctx_lo)), 0.0)

    def step_at(b: int, p: int) -> float:
        """Batch `b`'s step moved to context `p` exactly (its streams had decoded a few dozen
        tokens more, more at larger batches), so a curve varies in batch size only."""
        t, ctx = itl(b, p)
        return t - attn_d * b * (ctx - p)

    # the small batches at the short context too: below `prompt` their steps shrink less
    # than batch 8's slope says (stop 48); the simulator takes each one's own slope there
    short = {b: step_at(b, SHORT_CTX) for b in SHORT_BATCHES}
    dec = {b: step_at(b, prompt) for b in DECODE_BATCHES}
    slope = (dec[16] - dec[1]) / 15
    intercept = max(dec[1] - slope, 0.0)
    t_p0 = max(ttft[chunk] - ttft[16], 1e-6)
    t_p1 = max(ttft[2 * chunk] - ttft[chunk], t_p0)  # one whole step: chunk at prefix `chunk`
    tok, attn_c = fit_cold(16, (small, ttft[small] - ttft[16]), (chunk, t_p0))
    per_seq = max(slope - tok - attn_d * prompt, 0.0)
    attn_p = fit_cached(t_p1, chunk, intercept + per_seq, tok, attn_c, attn_d)
    one_step = intercept + per_seq + tok * 16 + attn_c * 16 * 16 / 2

    # Our engine's API server shares its process (and the GIL) with the engine-core thread, so
    # while that thread steps, a request's own handling waits for it: probe 16-token requests
    # while 8 streams decode (4 an engine when the router splits them evenly; not checked here,
    # unlike `_itl`). What they take beyond the idle overhead, the mean wait for the step in
    # flight (half a step) and their own step is the busy engine's extra.
    busy = []
    windows: list[list[float]] = []  # each kept busy phase's (start, end), `time.perf_counter`
    for _ in range(reps):
        t0 = time.perf_counter()
        ttfts, throughout = asyncio.run(_probe_busy(url, model, 4, 12, rng))
        if throughout:  # each engine decoded its batch while every probe ran
            busy.append(statistics.median(ttfts))
            windows.append([t0, time.perf_counter()])
    step4 = dec[4] - attn_d * 4 * (prompt - 256) + tok * 16
    busy_extra = (max(statistics.median(busy) - (ttft[16] - one_step) - 1.5 * step4, 0.0)
                  if busy else 0.0)
    # ... and per prompt token: the same probes with the cached `long` prompt (only its last
    # token is computed, in a step like the 16-token probe's), beside the 16-token ones; what
    # a token costs a busy engine's request path beyond its idle per-token cost
    busy_long = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ttfts, throughout = asyncio.run(_probe_busy(url, model, 4, 12, rng, prompt=long))
        if throughout:
            busy_long.append(statistics.median(ttfts))
            windows.append([t0, time.perf_counter()])
    idle_per_token = max((statistics.median(cached) - ttft[16]) / (len(long) - 16), 0.0)
    busy_per_token = (max((statistics.median(busy_long) - statistics.median(busy))
                          / (len(long) - 16) - idle_per_token, 0.0)
                      if busy and busy_long else 0.0)

    m = model_spec("tiny")
    return {
        "model": "tiny", "prompt": prompt, "chunk": chunk, "source": "server",
        "measured_at": time.time(), "loadavg": os.getloadavg(),
        "ttft_s": {str(k): v for k, v in ttft.items()},
        "prefill_chunk_s": {"prefix_0": t_p0, f"prefix_{chunk}": t_p1,
                            f"prefix_0_{small}": ttft[small] - ttft[16]},
        "prefill_tok_s": 2 * chunk / (t_p0 + t_p1),
        "decode_step_s": {str(b): t for b, t in dec.items()},
        "decode_ref_ctx": prompt,  # the context `decode_step_s` is stated at
        "decode_step_b8_s": {"256": lo, "2048": hi}, "decode_waves_drawn": drawn,
        "decode_step_short_s": {str(b): t for b, t in short.items()},
        "decode_short_ctx": SHORT_CTX,  # the context `decode_step_short_s` is stated at
        "step_overhead_s": intercept, "per_seq_s": per_seq, "tok_s": tok,
        "attn_prefill_s": attn_p, "attn_cold_s": attn_c, "attn_decode_s": attn_d,
        "cached_prefill": CACHED_PREFILL_KERNEL,
        "request_overhead_s": max(ttft[16] - one_step, 0.0),
        "cached_prompt_ttft_s": {str(len(long)): statistics.median(cached)},
        "request_overhead_per_token_s": idle_per_token,
        "request_overhead_busy_s": busy_extra, "busy_probe_ttft_s": busy,
        "request_overhead_busy_per_token_s": busy_per_token,
        "busy_probe_long_ttft_s": {str(len(long)): busy_long},
        # where `with_arrival_stretch` reads the engines' traces (the busy probes' phases)
        "busy_probe_windows": windows,
        "flops": 2 * chunk / (t_p0 + t_p1) * 2 * m.total_params(),
        "mem_bw": (m.total_params() * m.weight_bytes + prompt * m.kv_bytes_per_token()) / dec[1],
        "per_request_s": max(slope, 0.0),
    }


STRETCH_NEAR_S = 0.3  # a probe's steps are priced by its engine's steady steps this close


def read_traces(trace: Path) -> tuple[dict[str, list[dict]], list[dict]]:
    """The step traces by engine (pid) and the request records under the prefix `trace`
    (engine/core/steptrace.py): each request's core and API lines merged, with its engine request
    id (`id`) and its engine's pid (`engine`); those with both lines only."""
    steps: dict[str, list[dict]] = {}
    for f in trace.parent.glob(f"{trace.name}.*.jsonl"):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for r in recs:
            r["dt"] = r["sched_s"] + r["exec_s"] + r["post_s"]
        steps[f.name.split(".")[-2]] = sorted(recs, key=lambda r: r["t"])
    reqs: dict[str, dict] = {}
    for f in trace.parent.glob(f"{trace.name}-requests.*.jsonl"):
        pid = f.name.split(".")[-2]
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rid = r.pop("core", None) or r.pop("api")
                reqs.setdefault(rid, {"id": rid, "engine": pid}).update(r)
    return steps, [r for r in reqs.values() if {"recv", "sub", "n"} <= r.keys()]


def probe_stretches(steps: dict[str, list[dict]], reqs: list[dict], lo: float, hi: float,
                    sizes: tuple[int, ...]) -> dict[int, list[float]]:
    """For each probe (a request of one of `sizes` prompt tokens whose HTTP handler began in
    [lo, hi)): how much longer the steps of its engine that overlapped its handling (from the
    handler's start to its hand-over to the core) ran than that engine's steady steps of the
    same decode batch within `STRETCH_NEAR_S`, those that overlapped no request's handling.
    Probes whose handling overlapped a prefill, or a step of another batch, are left out."""
    handling: dict[str, list[tuple[float, float]]] = {}
    for r in reqs:
        handling.setdefault(r["engine"], []).append((r["recv"], r["sub"]))

    def handled(engine: str, a: float, b: float) -> bool:
        return any(x < b and y > a for x, y in handling.get(engine, ()))

    out: dict[int, list[float]] = {n: [] for n in sizes}
    for r in reqs:
        if r["n"] not in out or not lo <= r["recv"] < hi:
            continue
        mine = steps.get(r["engine"], [])
        over = [s for s in mine if s["t"] < r["sub"] and s["t"] + s["dt"] > r["recv"]]
        if not over or any(s["pre"] for s in over) or len({len(s["dec"]) for s in over}) != 1:
            continue
        batch = len(over[0]["dec"])
        steady = [s["dt"] for s in mine if abs(s["t"] - r["recv"]) < STRETCH_NEAR_S
                  and not s["pre"] and len(s["dec"]) == batch
                  and not handled(r["engine"], s["t"], s["t"] + s["dt"])]
        if len(steady) >= 5:
            out[r["n"]].append(sum(s["dt"] for s in over) - len(over) * statistics.median(steady))
    return out


def with_arrival_stretch(profile: dict, trace: str | Path, apply: bool = False) -> dict:
    """`profile` with the arrival stretch measured on the engines' own traces (prefix `trace`,
    `AGENTSERVE_STEP_TRACE` of the calibrated cluster; read once its engines have stopped, so
    their step traces are flushed): how much longer a step runs for a request reaching its
    engine during it, fixed + per prompt token, from the busy probes, 16-token ones and cached
    long ones, against their engine's steady steps (`probe_stretches`). A step's time adds up
    in its streams' tokens, so each phase's mean; the median of the phases.

    Recorded as `arrival_stretch_measured_s` / `_per_token_s`, which the simulator does not
    read. `apply` also writes the keys it does read (`arrival_stretch_s` / `_per_token_s`,
    `config.arrival_stretch`) and takes the stretch out of the busy request path measured
    through the client, which held it (a busy probe waits for the step it stretched; the
    reading is kept as `request_overhead_busy_measured_*`): the model tried at stop 51 and
    not adopted (docs/sim/notebook.md). A profile without busy windows, or traces with under 4 probes
    of a size in 2 phases, is returned as it is, with `arrival_stretch_error` saying why."""
    out = dict(profile)
    windows = profile.get("busy_probe_windows") or []
    sizes = (16, 4 * int(profile.get("chunk", 2048)))
    try:
        steps, reqs = read_traces(Path(trace))
    except (OSError, ValueError, KeyError) as e:  # a diagnostic: the calibration stands without it
        out["arrival_stretch_error"] = f"the engines' traces under {trace} could not be read: {e!r}"
        return out
    per_size: dict[int, list[float]] = {n: [] for n in sizes}
    for lo, hi in windows:
        for n, xs in probe_stretches(steps, reqs, lo, hi, sizes).items():
            if len(xs) >= 4:
                per_size[n].append(statistics.fmean(xs))
    if any(len(v) < 2 for v in per_size.values()):
        out["arrival_stretch_error"] = (f"too few busy probes in the engines' traces under {trace} "
                                        f"(phases with 4 or more, by size: "
                                        f"{ {n: len(v) for n, v in per_size.items()} })")
        return out
    short, long_ = (statistics.median(per_size[n]) for n in sizes)
    per_token = max((long_ - short) / (sizes[1] - sizes[0]), 0.0)
    fixed = max(short - per_token * sizes[0], 0.0)
    out.update({"arrival_stretch_measured_s": fixed,
                "arrival_stretch_measured_per_token_s": per_token,
                "arrival_stretch_by_size_s": {str(n): per_size[n] for n in sizes}})
    out.pop("arrival_stretch_error", None)
    if apply:
        busy = profile.get("request_overhead_busy_measured_s",
                           profile.get("request_overhead_busy_s", 0.0))
        busy_tok = profile.get("request_overhead_busy_measured_per_token_s",
                               profile.get("request_overhead_busy_per_token_s", 0.0))
        out.update({
            "arrival_stretch_s": fixed, "arrival_stretch_per_token_s": per_token,
            "request_overhead_busy_measured_s": busy,
            "request_overhead_busy_measured_per_token_s": busy_tok,
            "request_overhead_busy_s": max(busy - fixed - per_token * sizes[0], 0.0),
            "request_overhead_busy_per_token_s": max(busy_tok - per_token, 0.0)})
    return out


class UpCluster:
    """`agentserve up --topology 2` as a child process (the simulator imports no cluster
    code): `start()` waits for its --state file (every process healthy), `stop()` ends the
    tree (SIGTERM to `up`, which stops router then engines; SIGKILL to its group after a
    bound). `env` is added to its environment (its engines inherit it)."""

    def __init__(self, work: Path, port: int, engine_args: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.work, self.port = work, port
        self.state = work / "state.json"
        self.cmd = [sys.executable, "-m", "agentserve.cli", "up", "--topology", "2",
                    "--port", str(port), "--state", str(self.state), "--run-dir",
                    str(work / "run"), "--engine-args", " ".join(engine_args)]
        self.env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        with open(self.work / "up.log", "ab") as log:
            self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.env,
                                          start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.state.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(f"agentserve up exited ({self.popen.returncode}); "
                                   f"log: {self.work / 'up.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agentserve up not serving after {timeout:.0f} s; "
                                   f"log: {self.work / 'up.log'}")
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def calibrate_cluster(prompt: int = 1024, chunk: int = 2048, kv_tokens: int = 65_536,
                      port: int = 18_490, work: Path | None = None) -> dict:
    """Start two engines and the router, calibrate through them (`calibrate_server`), stop
    them, and add the arrival stretch read from their step traces (`with_arrival_stretch`)."""
    work = work or Path(tempfile.mkdtemp(prefix="sim_calibrate_"))
    cluster = UpCluster(work, port, ["--kv-cache-tokens", str(kv_tokens),
                                     "--max-num-batched-tokens", str(chunk)],
                        env={"AGENTSERVE_STEP_TRACE": str(work / "steps")})
    cluster.start()
    try:
        profile = calibrate_server(f"http://127.0.0.1:{port}", prompt, chunk)
    finally:
        cluster.stop()
    return with_arrival_stretch(profile, work / "steps")


def write_profile(profile: dict, out: str | Path) -> Path:
    """Write `profile` as the JSON `specs.cpu_local` reads."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2))
    return path
