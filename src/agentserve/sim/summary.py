"""The summary record of a simulated stage: what `agentserve bench` reports for the requests
the stage counts, plus the simulator's own figures (GPUs, cost, hit rates by tier, CPU
restores, queues, the TTFT breakdown)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentserve.sim.cost import pool_cost
from agentserve.sim.queues import queue_lengths
from agentserve.sim.specs import GiB
from agentserve.workload.record import RequestRecord
from agentserve.workload.report import summarize

if TYPE_CHECKING:
    from agentserve.sim.run import Simulation

# Error of a request no rank's KV can hold (vLLM: "maximum context length is ... tokens").
REJECTED = "context_length_exceeded"

# TTFT = request path (routing at the gateway, then the prefill and the decode rank's API server,
# waiting for each included) + prefill queue + prefill (restore wait within it) + P->D pull +
# decode queue + first decode step; `new_tokens` = prompt tokens computed (not cached).
PHASES = ("request_path", "prefill_queue", "cpu_restore", "prefill", "pd_transfer", "decode_queue",
          "first_step", "new_tokens")


def _rejections(sim: Simulation, done: list[RequestRecord]) -> dict:
    """Requests rejected as longer than a rank's KV, and their share of the stage's requests;
    requests sent and still unanswered when the run ended (queued or running: an overloaded
    or too short stage)."""
    n = sum(1 for r in done if r.error == REJECTED)
    return {"rejected_requests": n, "rejected_share": _share(n, len(done)),
            "requests_unfinished": sim.requests_sent - len(sim.records)}


def _share(num: float, den: float) -> float | None:
    return num / den if den else None


def _span(sim: Simulation, done: list[RequestRecord]) -> float:
    """Seconds the throughputs are over: for a stage that `drains`, its start to its last
    counted response, as AIPerf's benchmark duration and `agentserve bench`'s stage wall time
    (not shorter than the window, unless a fixed schedule ended before it); else the stage."""
    d = sim.cfg.duration
    if not (sim.drains and done):
        return d
    return max(d if sim.window_full else 0.0, max(r.end for r in done) - sim.t0)


def in_flight(sim: Simulation) -> dict:
    """Requests in flight and their prompt tokens, time-averaged over the stage window (every
    answered request, counted or not: the load the cluster held). The reference publishes 14.1M
    "logical tokens in flight" at c128, which its write-up defines as tokens in active requests,
    idle cached prefixes excluded. Requests still unanswered when the run ends are left out."""
    t0, t1 = sim.t0, sim.t0 + sim.cfg.duration
    reqs = held = 0.0
    for r in sim.records:
        if r.end > t0 and r.start < t1:
            dt = min(r.end, t1) - max(r.start, t0)
            reqs += dt
            held += dt * r.input_tokens
    d = sim.cfg.duration
    return {"requests_in_flight": reqs / d, "prompt_tokens_in_flight": held / d}


def pool_counters(sim: Simulation) -> dict[str, float]:
    """The P/D pools' cumulative counters, read at the stage start and end."""
    ps, ds = sim.prefills, sim.decodes
    return {"busy_p": sum(p.busy_so_far() for p in ps), "busy_d": sum(d.busy_so_far() for d in ds),
            "restore": sum(p.cpu_restore_bytes for p in ps),
            "store": sum(p.cpu_store_blocks for p in ps), "prompt": sum(p.prompt_tokens for p in ps),
            "hit": sum(p.hit_tokens for p in ps), "cpu_hit": sum(p.cpu_hit_tokens for p in ps),
            "preempt": sum(d.preemptions for d in ds),
            "p_preempt": sum(p.preemptions for p in ps), "unjam": sum(p.unjams for p in ps),
            "recomp": sum(d.recomputed_tokens for d in ds),
            "d_query": sum(d.queried_tokens for d in ds), "d_hit": sum(d.local_hit_tokens for d in ds),
            # aggregated engines (none in xPyD)
            "busy_a": sum(a.busy_so_far() for a in sim.aggs), "hit_a": sum(a.hit_tokens for a in sim.aggs),
            "prompt_a": sum(a.prompt_tokens for a in sim.aggs),
            "preempt_a": sum(a.preemptions for a in sim.aggs)}


def counted_records(sim: Simulation) -> list[RequestRecord]:
    """The requests the stage counts (`Simulation.counted`): what its summary is over."""
    return [r for r in sim.records if sim.counted(r.start, r.end)]


def _window_counters(sim: Simulation) -> dict[str, float]:
    """What the pools' counters (`pool_counters`) gained over the stage window."""
    c1 = sim._c1 or pool_counters(sim)
    c0 = sim._c0 or dict.fromkeys(c1, 0.0)  # counters at the stage start
    return {k: c1[k] - c0[k] for k in c1}


def stage_summary(sim: Simulation) -> dict:
    """The stage's record: `agentserve bench`'s summary of the counted requests, plus GPUs,
    cost, tier hit rates, restores, queues and the TTFT breakdown (xPyD)."""
    cfg = sim.cfg
    done = counted_records(sim)
    if cfg.aggregated:
        return _summary_agg(sim, done)
    d = _window_counters(sim)
    gpus_p, gpus_d = cfg.prefill * cfg.prefill_width, cfg.decode * cfg.decode_width
    s = summarize(done, _span(sim, done), label={"producer": "sim"}, gpus=gpus_p + gpus_d)
    s.update(_rejections(sim, done))
    cost = pool_cost(gpus_p, gpus_d, s["input_tok_s"], s["output_tok_s"],
                     cfg.hardware().price_per_hour)
    s.update({
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "cost_per_m_input": cost.per_m_input, "cost_per_m_output": cost.per_m_output,
        "cost_per_hour": cost.per_hour,
        "cpu_restore_gib": d["restore"] / GiB,
        "cpu_write_tb": d["store"] * cfg.block_size * sim.pperf.model.state_bytes_per_token() / 1e12,
        # KV the decode ranks pulled from the prefill ranks (NIXL), what they lacked locally
        "pd_pull_gib": (d["d_query"] - d["d_hit"]) * sim.dperf.model.state_bytes_per_token() / GiB,
        "prefill_gpu_hit_rate": _share(d["hit"], d["prompt"]),
        "prefill_cpu_hit_rate": _share(d["cpu_hit"], d["prompt"]),
        "decode_local_hit_rate": _share(d["d_hit"], d["d_query"]),
        # left queued when the run ended (after the grace); over the window: `queue_lengths`
        "prefill_queue": sum(len(r.waiting) + len(r.holding) for r in sim.p_ranks),
        "decode_queue": sum(len(r.waiting) for r in sim.d_ranks),
        "queue_lengths": queue_lengths(sim, ("prefill", "decode")),
        "decode_preemptions": d["preempt"],
        "prefill_preemptions": d["p_preempt"],
        "prefill_unjams": d["unjam"],  # the simulator's wedge bound (pools.py `_unjam`): ~never
        "decode_recomputed_tokens": d["recomp"],
        "prefill_busy_frac": d["busy_p"] / cfg.duration / cfg.prefill,
        "decode_busy_frac": d["busy_d"] / cfg.duration / cfg.decode,
        "ttft_phases_s": ttft_phases(sim), "warmup_s": sim.t0, **in_flight(sim),
    })
    return s


def ttft_phases(sim: Simulation) -> dict:
    """Mean and p50 of each TTFT phase over the stage's requests (`PHASES`)."""
    rows = np.array([p[2:] for p in sim.phases if sim.counted(p[0], p[1])])
    if not len(rows):
        return {}
    return {k: {"mean": float(rows[:, i].mean()), "p50": float(np.median(rows[:, i]))}
            for i, k in enumerate(PHASES)}


def _summary_agg(sim: Simulation, done: list[RequestRecord]) -> dict:
    cfg = sim.cfg
    s = summarize(done, _span(sim, done), label={"producer": "sim"}, gpus=cfg.aggregated)
    s.update(_rejections(sim, done))
    d = _window_counters(sim)  # the window's steps, hits and preemptions, as xPyD's
    s.update({
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "request_overhead_s": sim.overhead,
        "request_overhead_per_token_s": sim.overhead_per_token, "cpu_restore_gib": 0.0,
        "cost_per_m_input": None, "cost_per_m_output": None,
        "prefill_gpu_hit_rate": _share(d["hit_a"], d["prompt_a"]),
        "decode_local_hit_rate": None,  # no separate decode ranks
        "queue": sum(a.waiting_count for a in sim.aggs),  # left queued when the run ended
        "queue_lengths": queue_lengths(sim, ("engines",)),
        "preemptions": d["preempt_a"],
        "busy_frac": d["busy_a"] / cfg.duration / cfg.aggregated,
    })
    return s
