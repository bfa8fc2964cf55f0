"""Opt-in per-step timing trace of the engine core (a diagnostic, off by default).

With ``AGENTSERVE_STEP_TRACE=PREFIX`` in its environment, each engine process appends one JSON
line per step to ``PREFIX.<pid>.jsonl``: when the step began (`t`, monotonic seconds), how
long scheduling (`sched_s`), the forward pass and sampling (`exec_s`) and the rest
(`post_s`: appending tokens, caching blocks, events) took, and what it ran: each decode's
context (`dec`) and each prefill chunk's ``[new tokens, tokens before it]`` (`pre`).
`benchmarks/sim_step_audit.py` holds these against the simulator's step model for the same
batches. Lines are buffered and flushed every `FLUSH_EVERY` steps and when the core stops.
"""

from __future__ import annotations

import json
import logging
import os
from typing import IO

__all__ = ["ENV", "StepTrace"]

log = logging.getLogger(__name__)

ENV = "AGENTSERVE_STEP_TRACE"
FLUSH_EVERY = 64


class StepTrace:
    """Writes step records to ``{prefix}.{pid}.jsonl``."""

    def __init__(self, prefix: str) -> None:
        self.path = f"{prefix}.{os.getpid()}.jsonl"
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open
        self._n = 0

    @classmethod
    def from_env(cls) -> StepTrace | None:
        """A trace when ``AGENTSERVE_STEP_TRACE`` is set, else None."""
        prefix = os.environ.get(ENV)
        return cls(prefix) if prefix else None

    def record(self, t: float, sched_s: float, exec_s: float, post_s: float, dec: list[int],
               pre: list[tuple[int, int]]) -> None:
        """One step. A trace that cannot be written (disk full, closed at shutdown) turns
        itself off with one logged error: a diagnostic must never fail a step."""
        if self._f is None:
            return
        try:
            self._f.write(json.dumps({"t": round(t, 6), "sched_s": round(sched_s, 6),
                                      "exec_s": round(exec_s, 6), "post_s": round(post_s, 6),
                                      "dec": dec, "pre": pre}, separators=(",", ":")) + "\n")
            self._n += 1
            if self._n % FLUSH_EVERY == 0:
                self._f.flush()
        except (OSError, ValueError) as exc:
            log.error("step trace %s stopped: %r", self.path, exc)
            self._f = None

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError as exc:  # the last lines could not be flushed
                log.error("step trace %s: %r", self.path, exc)
