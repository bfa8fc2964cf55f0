"""Stage summaries and the files of a run: summary.json, requests.jsonl/.csv, PNGs, report.html
(the page itself: report_html.py).

The same functions serve the replay client and the simulator: both hand over
`RequestRecord`s (and, for agent sessions, `SessionRecord`s).

Definitions (per stage, over successful requests unless noted):
- `itl_ms` is AIPerf's per-request ITL, `(e2e - ttft) / (output - 1)`; `itl_token_ms` the
  token-weighted chunk gaps (see record.py).
- `requested_input_tokens` / `served_input_tokens`: what the workload asked and what the
  server counted (`usage.prompt_tokens`); `served_input_ratio` = served / requested.
- `output_tok_s_per_user`: output tokens over E2E, per request (mean and p50).
- `cached_token_ratio` = cached / input; `reusable_ceiling_ratio` = reusable / input, where
  reusable is what an infinite cache could have served given the order requests were sent;
  `captured_reuse` = the share of the reusable tokens served cached, each request's cached
  tokens counted up to its reusable ones, so it never exceeds 1 (the reference reports
  96-97%). The cap matters for P/D: a decode engine counts KV pulled from the prefill engine
  as cached (as vLLM does), so a turn's cached tokens there cover its new tokens too.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np

from agentserve.workload.record import RequestRecord, SessionRecord, itl_token_samples
from agentserve.workload.report_meta import run_info

CSV_FIELDS = ("request_id", "session_id", "stage", "turn", "agent", "sub_index", "start", "ttft", "e2e",
              "input_tokens", "output_tokens", "cached_tokens", "reusable_tokens", "max_tokens",
              "status", "error")


def stats(values: list[float] | np.ndarray, scale: float = 1.0,
          pcts: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """p50/p90/p99/mean of `values * scale`; None entries when there is no sample."""
    a = np.asarray(values, dtype=float) * scale
    out: dict[str, float | None] = {f"p{p}": (float(np.percentile(a, p)) if a.size else None) for p in pcts}
    out["mean"] = float(a.mean()) if a.size else None
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Counter deltas over the stage; the KV usage gauge before and after."""
    out: dict[str, float | None] = {}
    for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions"):
        if name in after:
            out[name.split(":", 1)[1]] = after[name] - before.get(name, 0.0)
    if "vllm:kv_cache_usage_perc" in after:
        out["kv_cache_usage_perc_before"] = before.get("vllm:kv_cache_usage_perc")
        out["kv_cache_usage_perc_after"] = after["vllm:kv_cache_usage_perc"]
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = (out.get("prefix_cache_hits") or 0.0) / out["prefix_cache_queries"]
    return out


def _session_stats(sessions: list[SessionRecord]) -> dict:
    done = [s for s in sessions if s.complete]
    slow = [s.slowdown for s in done if s.slowdown is not None]
    return {"sessions_started": len(sessions), "sessions_complete": len(done),
            "session_makespan_s": stats([s.makespan for s in done], pcts=(50, 90)),
            "session_slowdown": stats(slow, pcts=(50, 90))}


def summarize(records: list[RequestRecord], duration: float, label: dict | None = None,
              sessions: list[SessionRecord] | None = None, gpus: int = 1, skipped: int = 0,
              metrics: dict | None = None) -> dict:
    """One summary object for a stage (the keys of summary.json)."""
    ok = [r for r in records if r.ok]
    # Streams cut by Ctrl-C are recorded but are not the server's failures.
    cancelled = [r for r in records if r.error is not None and r.error.startswith("cancelled")]
    failed = [r for r in records if not r.ok and not r.error.startswith("cancelled")]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.input_tokens for r in ok)
    # what the workload asked for vs what the server counted (usage.prompt_tokens)
    asked = sum(r.requested_input_tokens or r.input_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    reusable = sum(r.reusable_tokens for r in ok)
    captured = sum(min(r.cached_tokens, r.reusable_tokens) for r in ok)
    itl = [x for r in ok if (x := r.itl_mean()) is not None]
    per_user = [r.output_tokens / r.e2e for r in ok if r.e2e]
    output_tok_s = out_tok / duration if duration > 0 else 0.0
    s: dict = dict(label or {})
    s.update({
        "duration_s": duration, "requests_ok": len(ok), "requests_failed": len(failed),
        "requests_cancelled": len(cancelled), "requests_skipped": skipped,
        "errors": dict(Counter(r.error for r in failed).most_common(5)),
        # the low quantiles too: a burst's first arrivals (stepped alone or not) sit there
        "ttft_s": stats([r.ttft for r in ok if r.ttft is not None], pcts=(10, 25, 50, 90, 99)),
        "itl_ms": stats(itl, 1e3),
        "itl_token_ms": stats(itl_token_samples(ok), 1e3),
        "e2e_s": stats([r.e2e for r in ok if r.e2e is not None]),
        "input_tokens": in_tok, "requested_input_tokens": asked, "served_input_tokens": in_tok,
        "served_input_ratio": _ratio(in_tok, asked), "output_tokens": out_tok, "cached_tokens": cached,
        "reusable_tokens": reusable,
        "output_tok_s": output_tok_s, "input_tok_s": in_tok / duration if duration > 0 else 0.0,
        "output_tok_s_per_user": {"mean": float(np.mean(per_user)) if per_user else None,
                                  "p50": float(np.median(per_user)) if per_user else None},
        "gpus": gpus, "output_tok_s_per_gpu": output_tok_s / gpus,
        "cached_token_ratio": _ratio(cached, in_tok),
        "reusable_ceiling_ratio": _ratio(reusable, in_tok),
        "captured_reuse": _ratio(captured, reusable),
        "server_metrics": metrics or {},
    })
    if sessions is not None:
        s.update(_session_stats(sessions))
    return s


def write_records(out: Path, records: list[RequestRecord], sessions: list[SessionRecord]) -> None:
    """requests.jsonl (everything, chunk times included), requests.csv (scalars), sessions.jsonl."""
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS + ("itl_mean",))
        for r in records:
            w.writerow([getattr(r, k) for k in CSV_FIELDS] + [r.itl_mean()])
    with open(out / "sessions.jsonl", "w") as f:
        for s in sessions:
            f.write(json.dumps(s.to_dict()) + "\n")


def write_outputs(out_dir: str | Path, stages: list[dict], records: list[RequestRecord],
                  sessions: list[SessionRecord] | None = None, plots: bool = True,
                  title: str = "agentserve bench") -> Path:
    """Every file of a run into `out_dir`; safe to call again as stages complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a producer that did not say what ran (the simulator) gets the generic block and its title,
    # in its own stage dicts too, so what it prints (sim --json) is what summary.json holds
    for s in stages:
        if not s.get("run"):
            s["run"] = run_info({"producer": s.get("producer"), "title": title})
    (out / "summary.json").write_text(json.dumps(stages, indent=2))
    write_records(out, records, sessions or [])
    # matplotlib is slow to import: only when plots are asked for (bench's per-stage writes skip them)
    from agentserve.workload.report_data import run_from_memory
    from agentserve.workload.report_html import write_report

    run = run_from_memory(out.resolve().name, stages, records, sessions)
    write_report(out / "report.html", [run], title, png_dir=out, plots=plots)
    return out
