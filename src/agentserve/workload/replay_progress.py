"""Live progress of a bench: requests done/failed, recent TTFT p50, output tok/s.

Rendering happens on the event loop (a 2 Hz task), never on rich's refresh thread,
so the counters need no locks. Disabled (a no-op) when stdout is not a terminal.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from rich.console import Console
from rich.live import Live
from rich.table import Table

from agentserve.workload.record import RequestRecord


class LiveProgress:
    """Counts records as they complete and redraws a one-row table twice a second."""

    def __init__(self, enabled: bool = True, window: int = 500) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
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
        self.out_tokens, self._t = 0, time.perf_counter()

    def table(self) -> Table:
        t = Table(title="agentserve bench", expand=False)
        for col in ("stage", "done", "failed", "TTFT p50 (s)", "output tok/s"):
            t.add_column(col, justify="right")
        ttft = sorted(self.ttfts)
        p50 = f"{ttft[len(ttft) // 2]:.3f}" if ttft else "-"
        rate = self.out_tokens / max(1e-9, time.perf_counter() - self._t)
        name = " ".join(f"{k}={v}" for k, v in self.label.items() if k != "mode" and v is not None)
        t.add_row(name, str(self.done), str(self.failed), p50, f"{rate:,.0f}")
        return t

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            assert self._live is not None
            self._live.update(self.table(), refresh=True)

    async def __aenter__(self) -> "LiveProgress":
        if self.enabled:
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
