"""Live progress of a bench: requests done/failed, recent TTFT p50, output tok/s.

On a terminal, a rich table redrawn twice a second; otherwise (a log, CI, a pipe) one
plain line every `interval` seconds on stderr, so a long run is never silent. Rendering
happens on the event loop, never on rich's refresh thread, so the counters need no locks.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque

from rich.console import Console
from rich.live import Live
from rich.table import Table

from agentserve.workload.record import RequestRecord


class LiveProgress:
    """Counts records as they complete and redraws a one-row table twice a second."""

    def __init__(self, enabled: bool = True, window: int = 500, interval: float = 10.0) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal  # else plain lines every `interval` s
        self.interval = interval
        self.done = self.failed = self.out_tokens = 0
        self.ttfts: deque[float] = deque(maxlen=window)  # recent TTFTs: the p50 tracks the present
        self.label: dict = {}
        self._t = time.perf_counter()
        self._live: Live | None = None
        self._task: asyncio.Task | None = None

    def add(self, rec: RequestRecord) -> None:
        if rec.ok:
            self.done += 1
            self.out_tokens += rec.output_tokens
            if rec.ttft is not None:
                self.ttfts.append(rec.ttft)
        else:
            self.failed += 1

    def stage(self, label: dict) -> None:
        self.label = label
        self.done = self.failed = self.out_tokens = 0
        self.ttfts.clear()
        self._t = time.perf_counter()

    def _figures(self) -> tuple[str, str, str]:
        ttft = sorted(self.ttfts)
        p50 = f"{ttft[len(ttft) // 2]:.3f}" if ttft else "-"
        rate = self.out_tokens / max(1e-9, time.perf_counter() - self._t)
        name = " ".join(f"{k}={v}" for k, v in self.label.items() if k != "mode" and v is not None)
        return name or str(self.label.get("mode", "")), p50, f"{rate:,.0f}"

    def line(self) -> str:
        """The plain progress line (non-terminal output)."""
        name, p50, rate = self._figures()
        return (f"bench: {self.label.get('mode', '')} {name}: {self.done} done, {self.failed} failed, "
                f"TTFT p50 {p50} s, {rate} out tok/s, {time.perf_counter() - self._t:.0f} s")

    def table(self) -> Table:
        t = Table(title="agentserve bench", expand=False)
        for col in ("stage", "done", "failed", "TTFT p50 (s)", "output tok/s"):
            t.add_column(col, justify="right")
        name, p50, rate = self._figures()
        t.add_row(name, str(self.done), str(self.failed), p50, rate)
        return t

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            assert self._live is not None
            self._live.update(self.table(), refresh=True)

    async def _lines(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            print(self.line(), file=sys.stderr, flush=True)

    async def __aenter__(self) -> "LiveProgress":
        if self.enabled and not self.live:
            self._task = asyncio.create_task(self._lines())
        elif self.enabled:
            self._live = Live(self.table(), console=self.console, auto_refresh=False, transient=False)
            self._live.start()
            self._task = asyncio.create_task(self._refresh())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._live is not None:
            self._live.update(self.table(), refresh=True)
            self._live.stop()


class TaskProgress:
    """`done / total` of a batch of jobs (the planner's simulations, `sim --seeds` runs): a
    rich bar on a terminal, else a line on stderr at most every `interval` s and at the end.
    Call `advance()` as each job completes (from the thread that collects the results)."""

    def __init__(self, total: int, what: str, interval: float = 10.0) -> None:
        self.total, self.what, self.interval = total, what, interval
        self.done = 0
        self.console = Console(stderr=True)
        self._t0 = self._last = time.perf_counter()
        self._bar = None

    def __enter__(self) -> "TaskProgress":
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._bar = Progress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def line(self) -> str:
        spent = time.perf_counter() - self._t0
        left = f", ~{spent / self.done * (self.total - self.done):.0f} s left" if self.done else ""
        return f"{self.what}: {self.done}/{self.total} done, {spent:.0f} s{left}"

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        now = time.perf_counter()
        if now - self._last >= self.interval or self.done >= self.total:
            self._last = now
            print(self.line(), file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
