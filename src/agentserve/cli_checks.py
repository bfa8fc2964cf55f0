"""Flag checks and one-line errors shared by the command-line tools."""

from __future__ import annotations

import math
from typing import NoReturn

import typer

POSITIVE = 1e-9  # as a minimum: the flag must be > 0 ("must be positive")


def _num(v: float) -> str:
    """A flag's value as typed: whole numbers in full (99999999, not 1e+08), others `:g`."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e18 else f"{v:g}"


def flag_range_error(**flags: tuple[float | None, ...]) -> str | None:
    """The message for the first flag out of its range, else None. Flags are given as
    name=(value, minimum) or name=(value, minimum, maximum); unset (None) values pass, NaN
    and infinities do not (a sweep of infinite length is a hang, not a result)."""
    for name, (value, low, *high) in flags.items():
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if not math.isfinite(value):
            return f"{flag} must be a finite number, got {value}"
        if value < low:
            what = "positive" if low == POSITIVE else f">= {_num(low)}"
            return f"{flag} must be {what}, got {_num(value)}"
        if high and value > high[0]:
            return f"{flag} must be <= {_num(high[0])}, got {_num(value)}"
    return None


def fail(message: str) -> NoReturn:
    """A bad flag or input file: one line on stderr, exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def check_flags(**flags: tuple[float | None, ...]) -> None:
    """`fail` on the first flag out of its range (see `flag_range_error`)."""
    message = flag_range_error(**flags)
    if message is not None:
        fail(message)
