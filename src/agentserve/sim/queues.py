"""Queue lengths over a stage: requests waiting at the ranks, sampled on the simulated clock.

The summary's `queue_lengths`: what a scrape of vLLM's `num_requests_waiting` gauge would have
read every `QUEUE_SAMPLE_S` of the stage window, as mean, p90 and max. A sample is one clock
event; the clock breaks ties by insertion order, so every other event keeps its order and the
simulated figures are unchanged by sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from agentserve.sim.run import Simulation

QUEUE_SAMPLE_S = 1.0  # simulated s between two samples


def queues_now(sim: Simulation) -> tuple[int, ...]:
    """Requests waiting now: (prefill, decode) ranks' queues for xPyD (a prefill queue with the
    prompts whose CPU-tier blocks load or have loaded), the engines' for aggregated ones (the
    in-flight prefix joins' included), as vLLM's num_requests_waiting counts."""
    if sim.aggs:
        return (sum(a.waiting_count for a in sim.aggs),)
    return (sum(len(r.waiting) + len(r.holding) for r in sim.p_ranks),
            sum(len(r.waiting) for r in sim.d_ranks))


def sample_queues(sim: Simulation, t0: float) -> None:
    """Append `queues_now` to `sim.queue_samples` every QUEUE_SAMPLE_S of the window that
    opens at `t0` (one pending event at a time)."""
    n = int(sim.cfg.duration // QUEUE_SAMPLE_S)

    def sample(k: int) -> None:
        sim.queue_samples.append(queues_now(sim))
        if k < n:
            sim.clock.at(t0 + (k + 1) * QUEUE_SAMPLE_S, lambda: sample(k + 1))
    if n:
        sim.clock.at(t0 + QUEUE_SAMPLE_S, lambda: sample(1))


def queue_lengths(sim: Simulation, names: tuple[str, ...]) -> dict:
    """Per queue (`names`, in `queues_now`'s order) its mean, p90 and max over the samples
    (None without a sample)."""
    a = np.array(sim.queue_samples, dtype=float).reshape(-1, len(names))
    out: dict = {"sample_s": QUEUE_SAMPLE_S, "samples": len(a)}
    for i, k in enumerate(names):
        col = a[:, i]
        out[k] = ({"mean": float(col.mean()), "p90": float(np.percentile(col, 90)),
                   "max": float(col.max())} if len(col) else None)
    return out
