"""`python -m agentserve.router ...`: the `route` command on its own (same options)."""

import typer

from agentserve.router.cli import route

if __name__ == "__main__":
    typer.run(route)
