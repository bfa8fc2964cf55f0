"""Opt-in per-step timing trace of the engine core (a diagnostic, off by default).

With ``AGENTSERVE_STEP_TRACE=PREFIX`` in its environment, each engine process appends one JSON
line per step to ``PREFIX.<pid>.jsonl``: when the step began (`t`, monotonic seconds), how
long scheduling (`sched_s`), the forward pass and sampling (`exec_s`) and the rest
(`post_s`: appending tokens, caching blocks, events) took, and what it ran: each decode's
context (`dec`) and each prefill chunk's ``[new tokens, tokens before it]`` (`pre`).
`benchmarks/sim_step_audit.py` holds these against the simulator's step model for the same
batches. Lines are buffered and flushed every `FLUSH_EVERY` steps and when the core stops.

The same variable turns on a request trace, ``PREFIX-requests.<pid>.jsonl``: a request's path to
its first token, two lines a request joined by its id. The core thread writes
``{"core": id, "n": prompt tokens, "hit": its prefix hit, "sub": handed to the core (its
`Sequence` made: a prompt of 4,096+ tokens is hashed off the core after that, in "inbox"),
"adm": taken off the core's inbox, "sched": its first step began, "tok": the step that
sampled its first token ended}``; the API thread ``{"api": id, "recv": the HTTP handler
began, "first": the first output reached the event loop}``. Every time is on one clock,
CLOCK_MONOTONIC (`time.perf_counter` and `time.monotonic` on Linux), which a client process
on the same machine shares: `benchmarks/sim_request_path.py` splits each request's TTFT into
the pieces between these stamps.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import IO

__all__ = ["ENV", "RequestTrace", "StepTrace", "request_trace"]

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


class RequestTrace:
    """Writes request-path records to ``{prefix}-requests.{pid}.jsonl`` (opened at the first
    record), from any thread."""

    def __init__(self, prefix: str) -> None:
        self.path = f"{prefix}-requests.{os.getpid()}.jsonl"
        self._f: IO[str] | None = None
        self._closed = False
        self._lock = threading.Lock()  # the core thread and the event loop's thread both write

    def record(self, rec: dict) -> None:
        """One record (times rounded to the microsecond). Like `StepTrace.record`, a write
        that fails turns the trace off with one logged error and never fails a request."""
        line = json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in rec.items()},
                          separators=(",", ":")) + "\n"
        with self._lock:
            if self._closed:
                return
            try:
                if self._f is None:
                    self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open
                self._f.write(line)
                self._f.flush()  # a few hundred lines a second at most; none lost at a kill
            except (OSError, ValueError) as exc:
                log.error("request trace %s stopped: %r", self.path, exc)
                self._f, self._closed = None, True

    def close(self) -> None:
        with self._lock:
            f, self._f, self._closed = self._f, None, True
        if f is not None:
            try:
                f.close()
            except OSError as exc:
                log.error("request trace %s: %r", self.path, exc)


_REQUEST_TRACE: RequestTrace | None = None
_REQUEST_TRACE_LOCK = threading.Lock()


def request_trace() -> RequestTrace | None:
    """This process's request trace when ``AGENTSERVE_STEP_TRACE`` is set, else None (one
    file a process: every engine core and API handler in it shares it)."""
    global _REQUEST_TRACE
    prefix = os.environ.get(ENV)
    if not prefix:
        return None
    with _REQUEST_TRACE_LOCK:
        if _REQUEST_TRACE is None or not _REQUEST_TRACE.path.startswith(f"{prefix}-requests."):
            if _REQUEST_TRACE is not None:  # the variable changed (tests): a new file
                _REQUEST_TRACE.close()
            _REQUEST_TRACE = RequestTrace(prefix)
        return _REQUEST_TRACE
