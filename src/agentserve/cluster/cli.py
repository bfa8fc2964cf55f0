"""`agentserve up`: start a local cluster (engines + router) and stop it on Ctrl-C/SIGTERM."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def up_cmd(
    topology: str = typer.Option("1P1D", help="1P1D, 2P1D, NPMD (prefill/decode pools) or N "
                                 "(N aggregated engines)."),
    model: Optional[str] = typer.Option(None, help="HF-format model folder, a .gguf or a preset "
                                        "such as smollm2-135m (default: built-in tiny)."),
    host: str = typer.Option("127.0.0.1", help="Bind address of the router and engines."),
    port: int = typer.Option(8080, help="Router port."),
    state: Optional[Path] = typer.Option(None, help="Write {router, router_pid, engines[url, role, "
                                         "pid, restarts]} JSON here once every process is "
                                         "healthy, and again after each restart."),
    run_dir: Optional[Path] = typer.Option(None, help="Logs and router.yaml (default: "
                                           ".agentserve/run-PID)."),
    engine_args: str = typer.Option("", help="Extra `agentserve serve` flags for every engine, "
                                    "e.g. '--kv-cache-tokens 65536'."),
    health_timeout: float = typer.Option(180.0, help="Seconds to wait for each /health."),
    max_restarts: int = typer.Option(5, min=0, help="Restarts of a dead engine or router "
                                     "within 5 minutes before giving up on it (backoff 0.5 s "
                                     "doubling to 10 s); 0: never restart (route around it)."),
) -> None:
    """Start N prefill + M decode (or N aggregated) engines and the router; Ctrl-C stops all."""
    from agentserve.cluster.launch import up

    try:
        code = up(topology, model, host, port, state, run_dir, engine_args, health_timeout,
                  max_restarts)
    except ValueError as e:
        typer.echo(f"agentserve up: {e}", err=True)
        raise typer.Exit(2) from e
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add `up` to the `agentserve` command."""
    app.command("up")(up_cmd)
