"""`agentserve sim --seeds N`: one stage simulated under N seeds, reported as their mean with
each headline figure's spread; `--concurrency 16,64,128`: a stage a level (`simulate_ladder`).

The simulator is stochastic (the workload draw, the router's tie-breaks, MTP acceptances), and
one seed of a 600 s stage can differ from the next by several percent at the points where a
pool saturates; a comparison of two configurations should say whether it exceeds that. Seeds
`seed .. seed + N - 1` run in `workers` processes; the record is the field-by-field mean of
their summaries (`runstats.mean_records`: every key a single run has, same meaning) plus
`seeds`: the seeds, and for each figure in `SPREAD` AIPerf's block (mean, std, cv, Student-t
interval, the per-seed values).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from multiprocessing import Pool

from agentserve.runstats import mean_records, spread
from agentserve.sim.run import SimConfig, simulate, simulate_records
from agentserve.workload.record import RequestRecord

# figure -> path into a stage summary
SPREAD: dict[str, tuple[str, ...]] = {
    "output_tok_s": ("output_tok_s",), "input_tok_s": ("input_tok_s",),
    "ttft_p50_s": ("ttft_s", "p50"), "ttft_p90_s": ("ttft_s", "p90"),
    "itl_p50_ms": ("itl_ms", "p50"), "e2e_p50_s": ("e2e_s", "p50"),
    "output_tok_s_per_user": ("output_tok_s_per_user", "mean"),
    "cost_per_m_output": ("cost_per_m_output",), "cpu_restore_gib": ("cpu_restore_gib",),
    "prefill_gpu_hit_rate": ("prefill_gpu_hit_rate",),
}


def simulate_seeds(cfg: SimConfig, n: int, workers: int = 2, confidence: float = 0.95,
                   on_done: Callable[[], None] | None = None) -> dict:
    """The mean summary of `cfg` under seeds cfg.seed .. cfg.seed + n - 1, with their spread;
    `on_done` is called as each run completes (progress)."""
    if n < 1:
        raise ValueError(f"need at least one seed, got {n}")
    cfgs = [dataclasses.replace(cfg, seed=cfg.seed + i) for i in range(n)]
    runs = []
    with Pool(min(workers, n)) if n > 1 and workers > 1 else contextlib.nullcontext() as pool:
        for run in (pool.imap(simulate, cfgs) if pool is not None else map(simulate, cfgs)):
            runs.append(run)
            if on_done is not None:
                on_done()
    out = mean_records(runs)
    out["config"] = {**runs[0]["config"], "seed": cfg.seed}
    out["seeds"] = {
        "seeds": [c.seed for c in cfgs], "confidence_level": confidence,
        "metrics": spread(runs, SPREAD, confidence)}
    return out


def _stage(job: tuple[SimConfig, bool]) -> tuple[dict, list[RequestRecord]]:
    cfg, keep = job
    summary, records = simulate_records(cfg)
    return summary, records if keep else []


def simulate_ladder(cfg: SimConfig, levels: list[int], seeds: int = 1, workers: int = 2,
                    keep_records: bool = False, on_done: Callable[[], None] | None = None
                    ) -> list[tuple[dict, list[RequestRecord]]]:
    """A stage of `cfg` at each concurrency in `levels`, as `agentserve bench --mode
    concurrency` runs a ladder (each stage a fresh deployment here): per level its summary
    (the seed mean with `seeds` > 1) and, with `keep_records` and one seed, the requests it
    counted. Levels run on `workers` processes; with seeds, each level's seeds do. `on_done` is
    called as each run completes (progress)."""
    cfgs = [dataclasses.replace(cfg, concurrency=c) for c in levels]
    if seeds > 1:
        return [(simulate_seeds(c, seeds, workers, on_done=on_done), []) for c in cfgs]
    jobs = [(c, keep_records) for c in cfgs]
    out = []
    with Pool(min(workers, len(jobs))) if len(jobs) > 1 and workers > 1 else \
            contextlib.nullcontext() as pool:
        for stage in (pool.imap(_stage, jobs) if pool is not None else map(_stage, jobs)):
            out.append(stage)
            if on_done is not None:
                on_done()
    return out
