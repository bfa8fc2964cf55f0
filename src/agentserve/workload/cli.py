"""Workload commands: `agentserve trace stats|synth|convert` and `agentserve bench`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from agentserve.workload.cli_bench import register_bench
    from agentserve.workload.cli_trace import trace_app

    app.add_typer(trace_app, name="trace")
    register_bench(app)
