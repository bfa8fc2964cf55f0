"""Tier-aware routing from real engine events: after the device evicts a paused session,
its prefix is still announced in the CPU tier, and the router sends the resumed turn to
that engine rather than to an empty one (CPU hits weigh 0.8 of a GPU hit)."""

from __future__ import annotations

import asyncio
import socket
import time

from agentserve.engine.core.engine import AsyncEngine
from agentserve.kv.events import KVEventBatch
from agentserve.router.config import build_config
from agentserve.router.core import RouteInput, Router
from agentserve.router.events import EventApplier
from tests.engine.core.test_tiered import A, B, BASE, _run

URLS = ["http://holder", "http://empty"]


class _Recorder:
    """Stands in for the ZMQ publisher: keeps every batch the engine publishes."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events, ts=None) -> None:
        self.batches.append(list(events))

    def close(self, timeout: float = 1.0) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_events() -> list[list]:
    async def go() -> list[list]:
        eng = AsyncEngine.from_args(**BASE, kv_cpu_gib=0.01, kv_cpu_policy="session",
                                    kv_events_endpoint=f"tcp://127.0.0.1:{_free_port()}")
        real, rec = eng.core.publisher, _Recorder()
        real.close()
        eng.core.publisher = rec
        await eng.start()
        try:
            await _run(eng, "a1", A, "A")
            await _run(eng, "b1", B, "B")  # A leaves the device; its copy stays in CPU
        finally:
            await eng.shutdown(5)
        return rec.batches
    return asyncio.run(go())


def _route(batches: list[list]):
    router = Router(build_config({"policy": "precise-prefix", "endpoints": [
        {"url": u, "kv_events": f"tcp://127.0.0.1:{6000 + i}", "block_size": BASE["block_size"]}
        for i, u in enumerate(URLS)]}))
    applier = EventApplier(router.index, URLS[0])
    for seq, events in enumerate(batches):
        applier.on_batch(0, seq, KVEventBatch(ts=time.time(), events=events))
    return router.decide(RouteInput(list(A) + [7] * 20, session="A"))


def test_resumed_session_routes_to_engine_with_prefix_in_cpu() -> None:
    batches = _engine_events()
    media = {e.medium for b in batches for e in b if hasattr(e, "medium")}
    assert {"GPU", "CPU"} <= media
    d = _route(batches)
    assert d.url == URLS[0]
    assert d.predicted_cached >= 256  # the CPU-held prefix counts as reusable
    gpu_only = [[e for e in b if getattr(e, "medium", "GPU") == "GPU"] for b in batches]
    assert _route(gpu_only).predicted_cached < d.predicted_cached  # the device lost it
