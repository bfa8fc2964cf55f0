"""CPU time of processes, apart for each one's main thread and its other threads, sampled on
the bench's clock: what `sim_burst_probe.py` reads of the client, the router and the engines
(an engine's main thread runs its event loop, its core thread steps; our processes do not
name their OS threads, so the split is main thread / the rest)."""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


class CpuWatch:
    """CPU time of each watched process, apart for its main thread (the event loop in the
    router, the engines and this client) and its other threads (an engine's core thread),
    sampled every `every` s on the bench's clock (`perf_counter`, CLOCK_MONOTONIC) from each
    thread's `/proc/PID/task/TID/schedstat` (run time in ns: finer than `stat`'s ticks)."""

    def __init__(self, pids: dict[str, int], every: float = 0.25) -> None:
        self.pids, self.every = pids, every
        self.samples: list[tuple[float, dict[str, tuple[float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    @staticmethod
    def read(pid: int) -> tuple[float, float]:
        """(main thread, other threads) CPU seconds so far; threads that ended are not counted."""
        main = other = 0.0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended between the listing and the read
            if int(tid) == pid:
                main += ns / 1e9
            else:
                other += ns / 1e9
        return main, other

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), {k: self.read(p) for k, p in self.pids.items()}))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def start(self) -> Callable[[], list]:
        self._sample()
        self._thread.start()

        def stop() -> list:
            self._stop.set()
            self._thread.join(timeout=5 * self.every + 1.0)
            self._sample()
            return self.samples
        return stop


def cpu_at(samples: list, t: float, label: str) -> tuple[float, float]:
    """A process's cumulative (main, other) CPU seconds at `t`, linear between samples."""
    times = [x[0] for x in samples]
    i = min(max(bisect.bisect_right(times, t), 1), len(samples) - 1)
    (t0, a), (t1, b) = samples[i - 1], samples[i]
    w = 0.0 if t1 == t0 else min(max((t - t0) / (t1 - t0), 0.0), 1.0)
    return tuple(x + w * (y - x) for x, y in zip(a[label], b[label]))  # type: ignore[return-value]
