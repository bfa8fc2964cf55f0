"""A debug aid, off by default: the router's Python heap against its RSS, over time.

With ``AGENTSERVE_ROUTER_TRACEMALLOC=FILE`` set, the router starts ``tracemalloc`` and a
daemon thread that, every ``AGENTSERVE_ROUTER_TRACEMALLOC_S`` seconds (300), appends to FILE
the traced total, VmRSS, and the 30 source lines whose allocations grew most since the
first snapshot. That separates Python objects that pile up (they show as lines) from
allocator retention (RSS grows, the traced total does not). tracemalloc costs CPU and
memory of its own, so a run with it on says what grows, not how much RSS a normal run has.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from pathlib import Path

ENV_FILE, ENV_PERIOD = "AGENTSERVE_ROUTER_TRACEMALLOC", "AGENTSERVE_ROUTER_TRACEMALLOC_S"
TOP = 30


def vm_rss_kib() -> int:
    """This process's resident set, KiB (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def start_from_env() -> threading.Thread | None:
    """Start the tracer if the environment asks for it; None when it does not."""
    out = os.environ.get(ENV_FILE)
    if not out:
        return None
    period = float(os.environ.get(ENV_PERIOD, "300"))
    tracemalloc.start(1)
    t = threading.Thread(target=_loop, args=(Path(out), period), name="memtrace", daemon=True)
    t.start()
    return t


def _loop(out: Path, period: float) -> None:
    t0, base = time.monotonic(), tracemalloc.take_snapshot()
    while True:
        time.sleep(period)
        snap = tracemalloc.take_snapshot()
        traced, peak = tracemalloc.get_traced_memory()
        lines = [f"== t={time.monotonic() - t0:.0f}s traced={traced / 2**20:.2f}MiB "
                 f"peak={peak / 2**20:.2f}MiB rss={vm_rss_kib() / 1024:.1f}MiB"]
        for st in snap.compare_to(base, "lineno")[:TOP]:
            lines.append(f"  {st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d}  {st.traceback}")
        with out.open("a") as f:
            f.write("\n".join(lines) + "\n")
