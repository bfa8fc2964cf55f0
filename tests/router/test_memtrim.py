"""The router's periodic malloc_trim (router/memtrim.py): it releases freed heap on glibc,
runs on the loop at its period, is off with 0 or a bad value, and is a no-op without glibc;
a real router process runs it."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from pathlib import Path

import pytest

from agentserve.router import memtrim
from tests.router.procs import PY, free_port, start, stop

GLIBC = memtrim.malloc_trim() is not None


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_trim_gives_freed_heap_back() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(1024) for _ in range(64 * 1024)]  # 64 MiB of small chunks
    for p in blocks:
        ctypes.memset(p, 1, 1024)  # touched: resident
    for p in blocks[:-1]:
        libc.free(p)  # the last one pins the top chunk, so free() alone cannot shrink the heap
    before = rss_kib()
    assert memtrim.malloc_trim()() == 1  # 1: memory was released
    after = rss_kib()
    libc.free(blocks[-1])
    assert before - after > 32 * 1024, (before, after)


def test_no_glibc_means_no_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    class Musl:  # a C library without gnu_get_libc_version / malloc_trim
        pass

    monkeypatch.setattr(memtrim.ctypes, "CDLL", lambda name: Musl())
    assert memtrim.malloc_trim() is None

    async def go() -> object:
        return memtrim.start_from_env()

    assert asyncio.run(go()) is None


def test_period_from_env(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(memtrim.ENV_PERIOD, raising=False)
    assert memtrim.period_from_env() == memtrim.DEFAULT_PERIOD_S
    monkeypatch.setenv(memtrim.ENV_PERIOD, "2.5")
    assert memtrim.period_from_env() == 2.5
    for bad in ("abc", "-1", "nan", "inf"):
        monkeypatch.setenv(memtrim.ENV_PERIOD, bad)
        with caplog.at_level(logging.WARNING, "agentserve.router.memtrim"):
            assert memtrim.period_from_env() == 0.0
        assert memtrim.ENV_PERIOD in caplog.text
    monkeypatch.setenv(memtrim.ENV_PERIOD, "0")

    async def go() -> object:
        return memtrim.start_from_env()

    assert asyncio.run(go()) is None  # off


def test_loop_trims_at_its_period() -> None:
    calls: list[float] = []

    async def go() -> None:
        task = asyncio.create_task(memtrim.trim_loop(0.02, lambda: calls.append(time.monotonic()) or 0))
        await asyncio.sleep(0.25)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert 4 <= len(calls) <= 13, len(calls)
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n  # cancelled: no more trims


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_router_process_runs_the_trim(tmp_path: Path) -> None:
    """`agentserve route` with a 0.2 s period logs its trims (at debug level)."""
    log = tmp_path / "router.log"
    proc = start([PY, "-m", "agentserve.router", "--endpoint", f"http://127.0.0.1:{free_port()}",
                  "--port", str(free_port()), "--log-level", "debug"], log,
                 env={memtrim.ENV_PERIOD: "0.2"})
    try:
        deadline = time.monotonic() + 60
        while log.read_text(errors="replace").count("malloc_trim: released") < 2:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
    finally:
        stop([proc])


def test_bpe_cache_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router tokenizer's BPE cache is resized to DEFAULT_BPE_CACHE (1,000, not tokenizers'
    10,000), or to AGENTSERVE_ROUTER_BPE_CACHE=N; a bad value or a tokenizer without one leaves it."""
    class Model:
        sizes: list[int] = []

        def _resize_cache(self, n: int) -> None:
            if n < 0:
                raise OverflowError(n)
            self.sizes.append(n)

    class Tok:  # IncrementalTokenizer.tok.hf.model
        def __init__(self, model: object) -> None:
            self.tok = type("T", (), {"hf": type("H", (), {"model": model})()})()

    m = Model()
    monkeypatch.delenv(memtrim.ENV_BPE_CACHE, raising=False)
    assert memtrim.bpe_cache_from_env(Tok(m)) == memtrim.DEFAULT_BPE_CACHE  # unset: the default
    assert m.sizes == [memtrim.DEFAULT_BPE_CACHE] and memtrim.DEFAULT_BPE_CACHE < 10_000
    monkeypatch.setenv(memtrim.ENV_BPE_CACHE, "1000")
    assert memtrim.bpe_cache_from_env(Tok(m)) == 1000 and m.sizes[-1] == 1000
    assert memtrim.bpe_cache_from_env(None) is None  # no tokenizer (token-id prompts only)
    assert memtrim.bpe_cache_from_env(Tok(object())) is None  # a model without a cache
    for bad in ("x", "-1"):
        monkeypatch.setenv(memtrim.ENV_BPE_CACHE, bad)
        assert memtrim.bpe_cache_from_env(Tok(m)) is None
    assert m.sizes == [1000, 1000]  # the bad values changed nothing
