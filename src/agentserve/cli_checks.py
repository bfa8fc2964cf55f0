"""Flag checks and one-line errors shared by the command-line tools."""

from __future__ import annotations

from typing import NoReturn

import typer

POSITIVE = 1e-9  # as a minimum: the flag must be > 0 ("must be positive")


def flag_range_error(**flags: tuple[float | None, float]) -> str | None:
    """The message for the first flag below its minimum, else None; flags are given as
    name=(value, minimum) and unset (None) values pass."""
    for name, (value, low) in flags.items():
        if value is not None and value < low:
            what = "positive" if low == POSITIVE else f">= {low:g}"
            return f"--{name.replace('_', '-')} must be {what}, got {value:g}"
    return None


def fail(message: str) -> NoReturn:
    """A bad flag or input file: one line on stderr, exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def check_flags(**flags: tuple[float | None, float]) -> None:
    """`fail` on the first flag below its minimum (see `flag_range_error`)."""
    message = flag_range_error(**flags)
    if message is not None:
        fail(message)
