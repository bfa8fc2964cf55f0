"""Keep Python's cyclic garbage collector out of a server's tail latency.

A serving process holds a few hundred thousand long-lived objects from its imports
(torch alone brings ~300K functions, tuples and dicts). A full (generation 2) collection
walks all of them: ~150-200 ms on the 2-core sandbox, on whichever thread allocated the
object that tipped the threshold, often the engine core in the middle of a step, so every
stream of that step waits (seen as a 190 ms first-token stall in a P/D decode leg, in
``offer`` right after the forward pass). vLLM freezes its startup heap for the same reason
(``gc.freeze()`` after the engine is built): frozen objects move to a permanent generation
that collections no longer walk, so a full collection only visits what serving allocated.

Freezing belongs to a serving *process* (``agentserve serve``, the router), not to a
library caller: objects alive at the freeze are never collected later, even if they become
cyclic garbage. The pause tracker is process-wide and cheap (two ``perf_counter`` calls
per collection), so the engine's ``/metrics`` shows how long collections stop the world.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("agentserve.gc")

# Pause histogram bucket bounds (seconds): a young collection takes microseconds, a full
# one over a large unfrozen heap 0.1-0.5 s.
PAUSE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class PauseTracker:
    """Counts collections and their stop-the-world time per generation (``gc.callbacks``).

    No lock: a collection can start inside any allocation, including one made while a lock
    is held on this very thread (reading a snapshot allocates), so a callback that took a
    lock could deadlock the thread, and with it the server. Collections never overlap
    (the collector runs one at a time, under the GIL), so the callback is the only writer;
    a snapshot may read counters mid-update, which costs at most one collection's worth.
    """

    def __init__(self) -> None:
        self._t0: float | None = None  # start of the collection in progress
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self.buckets = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collector: small, no locks, never raises.
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        t0, self._t0 = self._t0, None
        if t0 is None:
            return
        dt, g = time.perf_counter() - t0, min(int(info.get("generation", 2)), 2)
        i = next((i for i, b in enumerate(PAUSE_BUCKETS) if dt <= b), len(PAUSE_BUCKETS))
        self.count[g] += 1
        self.seconds[g] += dt
        if dt > self.max_s[g]:
            self.max_s[g] = dt
        self.buckets[g][i] += 1

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counts, seconds, max pause and histogram buckets per generation."""
        return {"count": list(self.count), "seconds": list(self.seconds),
                "max_s": list(self.max_s), "buckets": [list(b) for b in self.buckets],
                "frozen_objects": _frozen}


_tracker: PauseTracker | None = None
_install_lock = threading.Lock()
# Objects frozen by ``freeze_startup_heap``, counted once there: ``gc.get_freeze_count()``
# walks the whole permanent generation (~30 ms for 330K objects), which on every /metrics
# scrape (20 a second under the router) took ~40% of a core from the engine.
_frozen = 0


def pause_tracker() -> PauseTracker:
    """The process's tracker, installed in ``gc.callbacks`` on first use."""
    global _tracker
    with _install_lock:
        if _tracker is None:
            _tracker = PauseTracker()
            gc.callbacks.append(_tracker)
        return _tracker


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now (a serving process, after startup).
    ``AGENTSERVE_GC_FREEZE=0`` keeps the heap collectable (to measure what freezing buys).

    Returns the number of frozen objects."""
    global _frozen
    if os.environ.get("AGENTSERVE_GC_FREEZE", "1") == "0":
        log.info("AGENTSERVE_GC_FREEZE=0: the startup heap stays collectable")
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = _frozen = gc.get_freeze_count()
    log.info("froze %d startup objects out of the garbage collector's reach (%.0f ms)",
             n, (time.perf_counter() - t0) * 1e3)
    return n
