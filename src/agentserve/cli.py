"""The `agentserve` command line: one entry point, one sub-command group per part."""

from __future__ import annotations

import sys

import typer
import typer.rich_utils

# Help piped or captured (no terminal) renders at 80 columns in rich, which cuts long option
# names ("--long-prefill-token-thresh…"); give it room unless the user set TERMINAL_WIDTH.
if typer.rich_utils.MAX_WIDTH is None and not sys.stdout.isatty():
    typer.rich_utils.MAX_WIDTH = 120

app = typer.Typer(help="agentserve: serving stack for agentic LLM workloads.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def _register() -> None:
    # Each part contributes its commands; heavy imports (torch) stay inside the
    # commands themselves so `agentserve --help` is fast.
    from agentserve.cluster import cli as launch_cli
    from agentserve.cluster.demo import demo
    from agentserve.engine import cli as engine_cli
    from agentserve.router import cli as router_cli
    from agentserve.sim import cli as sim_cli
    from agentserve.workload import cli as workload_cli

    engine_cli.register(app)
    app.command("demo")(demo)  # the main job: a cluster on the embedded model (cluster/demo.py)
    workload_cli.register(app)
    router_cli.register(app)
    sim_cli.register(app)
    launch_cli.register(app)


_register()


@app.callback()
def _main() -> None:
    # a child of `agentserve up` dies with it, even when the launcher is killed with SIGKILL
    from agentserve.cluster.procs import bind_to_parent

    bind_to_parent()

if __name__ == "__main__":
    app()
