"""Range checks of numeric flags, shared by the command-line tools (each reports in its own way)."""

from __future__ import annotations

POSITIVE = 1e-9  # as a minimum: the flag must be > 0 ("must be positive")


def flag_range_error(**flags: tuple[float | None, float]) -> str | None:
    """The message for the first flag below its minimum, else None; flags are given as
    name=(value, minimum) and unset (None) values pass."""
    for name, (value, low) in flags.items():
        if value is not None and value < low:
            what = "positive" if low == POSITIVE else f">= {low:g}"
            return f"--{name.replace('_', '-')} must be {what}, got {value:g}"
    return None
