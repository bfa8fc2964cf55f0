"""Garbage-collector pauses: tracked per generation in /metrics; a serving process freezes
its startup heap so full collections no longer walk the imports' objects."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import urllib.request

from agentserve.engine.http.metrics import ServerMetrics
from agentserve.gcpause import pause_tracker
from agentserve.cluster.procs import start_engine
from tests.engine.http.test_protocol import FakeEngine


def test_collections_are_counted_and_timed_per_generation() -> None:
    before = pause_tracker().snapshot()
    assert pause_tracker() is pause_tracker()  # installed once per process
    gc.collect(2)
    gc.collect(0)
    after = pause_tracker().snapshot()
    assert after["count"][2] >= before["count"][2] + 1
    assert after["count"][0] >= before["count"][0] + 1
    assert after["seconds"][2] > before["seconds"][2]
    assert sum(after["buckets"][2]) == after["count"][2]
    text = ServerMetrics(FakeEngine()).render()[0].decode()
    n = float(re.search(r'agentserve:gc_pause_seconds_count\{generation="2",model_name="m"\} (\S+)',
                        text).group(1))
    assert n >= after["count"][2]
    assert 'agentserve:gc_pause_max_seconds{generation="2",model_name="m"}' in text


# Collections on every few allocations, on two threads, while snapshots are read: a
# collection that starts inside a snapshot must not wait for anything the snapshot holds.
_STRESS = """
import gc, threading
from agentserve.gcpause import pause_tracker
t = pause_tracker()
gc.set_threshold(1, 1, 1)
def churn():
    for _ in range(20000):
        [[i] for i in range(8)]
th = threading.Thread(target=churn)
th.start()
for _ in range(5000):
    t.snapshot()
th.join()
assert sum(t.snapshot()["count"]) > 1000
print("ok")
"""


def test_snapshots_never_deadlock_with_a_collection() -> None:
    r = subprocess.run([sys.executable, "-c", _STRESS], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_a_serving_process_freezes_its_startup_heap(tmp_path) -> None:
    eng = start_engine(tmp_path)
    try:
        eng.wait_healthy(120)
        with urllib.request.urlopen(eng.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        eng.stop()
    # torch and the model alone are ~300K objects; a library caller (this test process,
    # ServerThread) does not freeze.
    assert _metric(text, "agentserve:gc_frozen_objects") > 100_000
    assert gc.get_freeze_count() == 0


def test_a_scrape_does_not_walk_the_frozen_heap(monkeypatch) -> None:
    """``gc.get_freeze_count()`` walks the permanent generation: ~30 ms over a serving
    process's ~330K frozen objects, and the router scrapes /metrics 20 times a second. The
    count is taken once, at the freeze."""
    calls: list[int] = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or 0)
    pause_tracker().snapshot()
    ServerMetrics(FakeEngine()).render()
    assert calls == []


def test_freezing_can_be_turned_off_for_every_serving_process(monkeypatch) -> None:
    """``AGENTSERVE_GC_FREEZE=0`` is read where the freeze happens, so the router (which
    freezes too) honours it as the engine does."""
    from agentserve.gcpause import freeze_startup_heap

    monkeypatch.setenv("AGENTSERVE_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == before
