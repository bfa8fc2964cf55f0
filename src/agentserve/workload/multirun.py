"""Repeated profile runs of one bench and their aggregate, as AIPerf's `--num-profile-runs`.

One run of a bench on a shared or throttled machine can be off by a third (this project's
2-core VMs: `docs/studies/box_speed/`, docs/sim/notebook.md, stop 37); the answer is to run the same workload several times
and report each figure's mean with its spread and a confidence interval, so that two
configurations are compared by whether their intervals overlap. Every run replays the same
workload (same trace, same seed). Layout, as AIPerf's:

    OUT/profile_runs/run_0001/   summary.json, requests.jsonl/.csv, plots, report.html
    OUT/profile_runs/run_0002/   ...
    OUT/aggregate/aggregate.json {"metadata": {...}, "stages": [{"stage", "metrics"}]}

Each metric's block has AIPerf's fields (`runstats.describe`): mean, std (sample, n - 1), min,
max, cv, se, ci_low, ci_high, t_critical, and the per-run values. A run that raises is recorded under
`failed_runs` and the others go on; when every run fails the first error is raised.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from agentserve.runstats import spread
from agentserve.workload.replay import BenchConfig, run_bench

# name -> (path into a stage summary, unit)
METRICS: dict[str, tuple[tuple[str, ...], str]] = {
    "output_tok_s": (("output_tok_s",), "tokens/s"),
    "input_tok_s": (("input_tok_s",), "tokens/s"),
    "ttft_p50_s": (("ttft_s", "p50"), "s"),
    "ttft_p90_s": (("ttft_s", "p90"), "s"),
    "itl_p50_ms": (("itl_ms", "p50"), "ms"),
    "itl_p90_ms": (("itl_ms", "p90"), "ms"),
    "e2e_p50_s": (("e2e_s", "p50"), "s"),
    "cached_token_ratio": (("cached_token_ratio",), "ratio"),
    "requests_ok": (("requests_ok",), "requests"),
    "requests_failed": (("requests_failed",), "requests"),
}


def _stage_label(stage: dict, i: int) -> str:
    for key in ("concurrency", "sessions", "stage"):
        if stage.get(key) is not None:
            return f"{key} {stage[key]}"
    return f"stage {i + 1}"


def aggregate(runs: list[list[dict]], confidence: float = 0.95, labels: list[str] | None = None,
              failed: list[dict] | None = None) -> dict:
    """The aggregate record of several runs' stage summaries (`runs[r][s]`: run r, stage s).
    Stages are matched by position, and only those every run reached are aggregated (an
    interrupted run may stop short); a metric a run did not measure (None) is left out of it."""
    labels = labels or [f"run_{i + 1:04d}" for i in range(len(runs))]
    stages = []
    for s in range(min((len(r) for r in runs), default=0)):
        blocks = spread([r[s] for r in runs], {n: path for n, (path, _) in METRICS.items()}, confidence)
        metrics = {n: {**blocks[n], "unit": unit} for n, (_, unit) in METRICS.items()}
        stages.append({"stage": _stage_label(runs[0][s], s), "metrics": metrics})
    return {"metadata": {"aggregation_type": "confidence", "num_profile_runs": len(runs) + len(failed or []),
                         "num_successful_runs": len(runs), "confidence_level": confidence,
                         "run_labels": labels, "failed_runs": failed or []},
            "stages": stages}


def run_profile_runs(cfg: BenchConfig, runs: int, confidence: float = 0.95,
                     cooldown_s: float = 0.0,
                     bench: Callable[[BenchConfig], list[dict]] = run_bench) -> dict:
    """Run `cfg` `runs` times into OUT/profile_runs/run_NNNN and write OUT/aggregate/aggregate.json;
    returns the aggregate. An interrupted run (Ctrl-C) ends the series: what ran is aggregated
    and the record says `interrupted`."""
    out = Path(cfg.out)
    done: list[list[dict]] = []
    labels: list[str] = []
    failed: list[dict] = []
    errors: list[Exception] = []
    interrupted = False
    for i in range(runs):
        if i and cooldown_s:
            try:
                time.sleep(cooldown_s)
            except KeyboardInterrupt:  # Ctrl-C between runs ends the series as within one
                interrupted = True
                break
        label = f"run_{i + 1:04d}"
        try:
            stages = bench(dataclasses.replace(cfg, out=str(out / "profile_runs" / label)))
        except (RuntimeError, ValueError, OSError) as e:
            failed.append({"label": label, "error": f"{type(e).__name__}: {e}"})
            errors.append(e)
            continue
        done.append(stages)
        labels.append(label)
        if any(s.get("interrupted") for s in stages):
            interrupted = True
            break
    if not done:
        raise errors[0] if errors else RuntimeError("no profile run completed")
    record = aggregate(done, confidence, labels, failed)
    record["metadata"]["interrupted"] = interrupted
    (out / "aggregate").mkdir(parents=True, exist_ok=True)
    (out / "aggregate" / "aggregate.json").write_text(json.dumps(record, indent=2))
    return record
