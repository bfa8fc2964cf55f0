"""D6: one long prompt no longer blocks everyone. With the default prefill chunk cap (half
the step's token budget, vLLM's long_prefill_token_threshold) short requests that arrive
while a long prompt is being prefilled are admitted into the same steps and finish long
before it does; greedy outputs do not depend on the cap."""

from __future__ import annotations

import asyncio
import time

from agentserve.engine.builder import EngineArgs, chunk_cap
from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from tests.conftest import TEST_DEVICE

LONG = 8_000  # tokens: 8 steps of prefill at the default cap


def test_the_default_cap_is_half_the_step_budget() -> None:
    assert chunk_cap(EngineArgs()) == 1024
    assert chunk_cap(EngineArgs(max_num_batched_tokens=512)) == 256
    assert chunk_cap(EngineArgs(long_prefill_token_threshold=0)) == 0  # off, as vLLM's 0
    assert chunk_cap(EngineArgs(long_prefill_token_threshold=300)) == 300


async def _run(engine: AsyncEngine, rid: str, ids: list[int], max_tokens: int
               ) -> tuple[float, float, list[int]]:
    """(seconds to the first token, to the end, the tokens)."""
    t0, first, toks = time.monotonic(), None, []
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for out in engine.generate(rid, ids, params):
        if first is None and out.new_token_ids:
            first = time.monotonic() - t0
        toks += out.new_token_ids
    return first or 0.0, time.monotonic() - t0, toks


def _prompt(n: int) -> list[int]:
    return [(i * 7919) % 4000 + 5 for i in range(n)]


def _engine(n: int, cap: int | None) -> AsyncEngine:
    return AsyncEngine.from_args(kv_cache_tokens=n + 2048, max_model_len=n + 256,
                                 long_prefill_token_threshold=cap, device=TEST_DEVICE)


async def _long_beside_shorts() -> tuple[tuple, list[tuple], float]:
    engine = _engine(LONG, None)  # the default cap
    await engine.start()
    try:
        t0 = time.monotonic()
        long = asyncio.create_task(_run(engine, "long", _prompt(LONG), 2))
        await asyncio.sleep(0.2)  # its prefill is under way
        shorts = await asyncio.gather(*(_run(engine, f"s{j}", [10 + j, 20, 30, 40, 50], 2)
                                        for j in range(3)))
        shorts_done = time.monotonic() - t0
        return await long, shorts, shorts_done
    finally:
        await engine.shutdown(5)


def test_short_requests_finish_long_before_a_long_prefill() -> None:
    (long_ttft, _, _), shorts, shorts_done = asyncio.run(_long_beside_shorts())
    assert all(len(toks) == 2 for _, _, toks in shorts)
    # admitted into the long prompt's steps: done well before its prefill is (without the
    # cap they waited for all of it: their TTFT was the long prompt's)
    assert shorts_done < long_ttft / 2, (shorts, long_ttft)


async def _greedy(cap: int | None) -> list[int]:
    engine = _engine(4096, cap)
    await engine.start()
    try:
        return (await _run(engine, "g", _prompt(4096), 4))[2]
    finally:
        await engine.shutdown(5)


def test_greedy_output_does_not_depend_on_the_cap() -> None:
    assert asyncio.run(_greedy(None)) == asyncio.run(_greedy(0))
