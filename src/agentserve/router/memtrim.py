"""The router's memory over a long run: glibc ``malloc_trim(0)`` every 30 s, and a smaller
BPE word cache for its tokenizer (``bpe_cache_from_env``: 1,000 words, not 10,000).

glibc keeps freed memory in its arenas; ``malloc_trim(0)`` releases the free pages of every
arena (``MADV_DONTNEED``) without moving live data, so it undoes retention (a burst's peak
kept after it ended), not fragmentation. Measured side by side on one soak cluster
(benchmarks/harden_soak.py --variants, 5 routers under the same load for 26 min): with it
the router's anonymous memory sits 0.4-0.9 MiB lower, but grows as much (+2.3 vs +1.8 MiB);
``MALLOC_ARENA_MAX=2`` changed nothing (the router allocates on its main thread; its thread
arenas hold ~150 KiB) and ``PYTHONMALLOC=malloc`` grew more (+3.2 vs +2.1 MiB). The soak's
growth is live data, not retention (the soak JSON keeps its smaps): about 40% of it was
tokenizers' BPE word cache filling toward its cap, hence the smaller cap.
A trim of a ~100 MiB router heap takes 20-250 us, so it runs inline on the event loop.

``AGENTSERVE_ROUTER_MALLOC_TRIM_S`` sets the period (``DEFAULT_PERIOD_S``; ``0`` turns it
off). Where the C library is not glibc (musl, macOS) ``malloc_trim`` is absent and nothing
runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("agentserve.router.memtrim")

ENV_PERIOD = "AGENTSERVE_ROUTER_MALLOC_TRIM_S"
DEFAULT_PERIOD_S = 30.0
ENV_BPE_CACHE = "AGENTSERVE_ROUTER_BPE_CACHE"  # tokenizers' BPE word cache size (entries)
DEFAULT_BPE_CACHE = 1000


def malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` as a callable (1: memory was released, 0: none), or None
    where the process's C library has no such function."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl and macOS lack it  # noqa: B018
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


def period_from_env() -> float:
    """Seconds between trims from the environment; 0 (off) for a value that is not a
    non-negative number, with a warning."""
    raw = os.environ.get(ENV_PERIOD)
    if raw is None:
        return DEFAULT_PERIOD_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        logger.warning("%s=%r is not a number of seconds >= 0; malloc_trim off", ENV_PERIOD, raw)
        return 0.0
    return v


async def trim_loop(period: float, trim: Callable[[], int]) -> None:
    """Call ``trim`` every ``period`` seconds until cancelled."""
    while True:
        await asyncio.sleep(period)
        t = time.perf_counter()
        released = trim()
        logger.debug("malloc_trim: released=%d in %.1f ms", released,
                     1e3 * (time.perf_counter() - t))


def start_from_env() -> asyncio.Task | None:
    """On the running loop, start the periodic trim if glibc is there and the period is not 0;
    None when nothing was started."""
    period, trim = period_from_env(), malloc_trim()
    if period <= 0 or trim is None:
        return None
    return asyncio.get_running_loop().create_task(trim_loop(period, trim), name="malloc_trim")


def bpe_cache_from_env(tokenizer: object) -> int | None:
    """Resize the BPE word cache of the router's tokenizer (an ``IncrementalTokenizer``) to
    ``AGENTSERVE_ROUTER_BPE_CACHE`` entries, DEFAULT_BPE_CACHE when unset (tokenizers' private
    ``_resize_cache``; tokenizers' own default is 10,000); the size set, or None when not possible.

    Why 1,000: in a soak the 10,000-word cache fills with the distinct words of replies that
    come back in the history, ~2.25 MiB at its cap, about 40% of the router's RSS growth over
    25 minutes; at 1,000 words the growth over 10 minutes was +2.1% instead of +3.4% (side by
    side), and an uncached word costs ~1-2 us more to tokenize (a turn tokenizes only its new
    messages: prompt/incremental.py)."""
    raw = os.environ.get(ENV_BPE_CACHE, str(DEFAULT_BPE_CACHE))
    model = getattr(getattr(getattr(tokenizer, "tok", None), "hf", None), "model", None)
    if not hasattr(model, "_resize_cache"):
        return None
    try:
        n = int(raw)
        model._resize_cache(n)
    except (ValueError, OverflowError, TypeError):
        logger.warning("%s=%r: not a cache size; left as it is", ENV_BPE_CACHE, raw)
        return None
    return n
