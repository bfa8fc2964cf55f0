"""Helpers for the failure-isolation tests: run requests on an in-process ``AsyncEngine``
and check that nothing is left behind once they all ended."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import RequestOutput, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


async def collect(eng: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
                  kv_transfer: dict | None = None) -> tuple[list[int], RequestOutput]:
    """All tokens of one request and its last output (bounded: a hang fails the test)."""
    async def run() -> tuple[list[int], RequestOutput]:
        toks: list[int] = []
        last = None
        async for out in eng.generate(rid, prompt, params, kv_transfer=kv_transfer):
            toks += out.new_token_ids
            last = out
        assert last is not None
        return toks, last
    return await asyncio.wait_for(run(), 60)


def run_engine(body: Callable[[AsyncEngine], Awaitable[Any]], **kw: Any) -> tuple[Any, AsyncEngine]:
    """Start an engine, run ``body`` on it, check it is clean, shut it down."""
    engines: list[AsyncEngine] = []

    async def go() -> Any:
        eng = AsyncEngine.from_args(**kw)
        engines.append(eng)
        await eng.start()
        try:
            result = await body(eng)
            await asyncio.sleep(0.05)  # (the last outputs' generators close their queues)
            assert_clean(eng)
            return result
        finally:
            await eng.shutdown(5)
    result = asyncio.run(go())
    engines[0].core.kv.pool.check_invariants()
    return result, engines[0]


def assert_clean(eng: AsyncEngine) -> None:
    """No request left anywhere in the engine, and no block, pin or pull held for one."""
    core, sch = eng.core, eng.core.scheduler
    assert not eng._queues, f"requests still waiting for outputs: {list(eng._queues)}"
    assert not core.seqs and not core.pending, (list(core.seqs), core.pending)
    assert not (sch.waiting or sch.running or sch.loading or sch.pulling or sch.joined
                or sch._failed), "a request is left in the scheduler's queues"
    assert core.kv.pool.num_used_blocks == 0, "blocks leaked"
    assert not core.kv.req_blocks, "a request still owns blocks"
    if core.remote is not None:
        r = core.remote
        assert r.pending == 0 and not r._pulling and not r._pull_hashes
    if core.tiers is not None:
        assert not core.tiers.loads and not core.tiers._restoring
        assert not core.tiers.mgr.cpu.pins, "CPU tier blocks left pinned"
