"""The `agentserve` command line: one entry point, one sub-command group per part."""

from __future__ import annotations

import typer

app = typer.Typer(help="agentserve: serving stack for agentic LLM workloads.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def _register() -> None:
    # Each part contributes its commands; imports stay lazy inside the commands
    # themselves so `agentserve --help` does not import torch.
    from agentserve.engine import cli as engine_cli

    engine_cli.register(app)
    try:
        from agentserve.workload import cli as workload_cli
    except ImportError:  # part not built yet
        workload_cli = None
    if workload_cli is not None:
        workload_cli.register(app)
    try:
        from agentserve.router import cli as router_cli
    except ImportError:
        router_cli = None
    if router_cli is not None:
        router_cli.register(app)


_register()

if __name__ == "__main__":
    app()
