"""Fixtures shared by the workload tests."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stub_server import StubConfig, StubServer  # noqa: E402


@pytest.fixture
def stub_thread():
    """The stub on its own event loop thread, for sync callers such as the CLI runner."""
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    srv = StubServer(StubConfig(ttft=0.002, itl=0.001))
    asyncio.run_coroutine_threadsafe(srv.start(), loop).result(10)
    yield srv
    asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)
