"""Synthetic sessions runs for the report tests: two sessions, a sub-agent group, one failure,
written through `write_outputs` as bench writes a run (hand-checkable per-turn sums)."""

from __future__ import annotations

from pathlib import Path

import typer

from agentserve.workload.record import RequestRecord, SessionRecord
from agentserve.workload.report import summarize, write_outputs
from agentserve.workload.report_meta import run_info

URL = "http://127.0.0.1:18123"
MODEL = "report-test-model"
TRACE = "/traces/report-test.jsonl"


def _rec(rid: str, sid: str, turn: int, start: float, ttft: float, e2e: float, n_in: int, cached: int,
         agent: str = "main", sub: int = -1, error: str | None = None) -> RequestRecord:
    ok = error is None
    return RequestRecord(rid, sid, turn, agent=agent, sub_index=sub, start=start, ttft=ttft if ok else None,
                         chunk_times=[ttft + i * (e2e - ttft) / 7 for i in range(8)] if ok else [],
                         chunk_tokens=[1] * 8 if ok else [], e2e=e2e, input_tokens=n_in,
                         output_tokens=8 if ok else 0, cached_tokens=cached, reusable_tokens=cached,
                         max_tokens=8, error=error, status=200 if ok else 500)


def records(slow: float = 1.0, cache: bool = True) -> list[RequestRecord]:
    """Session a: turns 0-2, two sub-agents before turn 1; session b: turns 0-1, its turn 1 fails."""
    c = (lambda n: n) if cache else (lambda n: 0)
    return [
        _rec("a0", "a", 0, 0.0, 0.5 * slow, 1.0 * slow, 1000, 0),
        _rec("a1s0", "a", 1, 1.5, 0.2 * slow, 0.6 * slow, 300, c(100), "sub", 0),
        _rec("a1s1", "a", 1, 1.6, 0.3 * slow, 0.7 * slow, 400, c(100), "sub", 1),
        _rec("a1", "a", 1, 2.5, 0.1 * slow, 0.5 * slow, 1200, c(1000)),
        _rec("a2", "a", 2, 3.5, 0.1 * slow, 0.6 * slow, 1500, c(1200)),
        _rec("b0", "b", 0, 0.2, 0.6 * slow, 1.2 * slow, 2000, 0),
        _rec("b1", "b", 1, 2.0, 0.0, 0.05, 2100, 0, error="HTTP 500: engine fell over"),
    ]


def write_run(out: Path, slow: float = 1.0, cache: bool = True) -> Path:
    recs = records(slow, cache)
    sessions = [SessionRecord("a", 0.0, 4.1, 8.0, 5, 0), SessionRecord("b", 0.2, 2.05, 3.0, 2, 1)]
    info = run_info({"producer": "bench", "url": URL, "model": MODEL, "api": "completions", "mode": "sessions",
                     "trace": TRACE}, argv=["agentserve", "bench", "--url", URL, "--api-key", "sekret"])
    stage = summarize(recs, 4.1, {"mode": "sessions", "stage": 0, "sessions": 2, "run": info}, sessions)
    return write_outputs(out, [stage], recs, sessions)


def report_app() -> typer.Typer:
    """`agentserve report` alone (a second command keeps it a sub-command, as in agentserve)."""
    from agentserve.workload.report_cli import register_report

    app = typer.Typer()
    register_report(app)
    app.command("other")(lambda: None)
    return app
