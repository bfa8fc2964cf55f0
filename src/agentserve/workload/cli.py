"""Workload commands: `agentserve trace stats|synth|convert`, `agentserve bench` and `agentserve report`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from agentserve.workload.cli_bench import register_bench
    from agentserve.workload.cli_trace import trace_app
    from agentserve.workload.report_cli import register_report

    app.add_typer(trace_app, name="trace")
    register_bench(app)
    register_report(app)
