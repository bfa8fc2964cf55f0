"""Failure isolation in the engine core: whatever one request brings (its bookkeeping, its
allocation, its restore, its cleanup) ends that request alone with an error output; a
failed forward ends only its batch; a request the core drops is still answered, and
shutdown never waits on one. After each, nothing is left behind (``assert_clean``).

(A broken grammar or sampling row: ``test_core_faults.test_a_request_whose_sampling_fails_ends_alone``.)
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from agentserve.engine.core import engine as engine_mod
from agentserve.engine.core.engine import AsyncEngine, EngineDraining
from tests.conftest import TEST_DEVICE
from tests.engine.core.isolation import assert_clean, collect, run_engine

KW = dict(model=None, kv_cache_tokens=4096, block_size=16, max_model_len=1024, max_num_seqs=8,
          max_num_batched_tokens=512, seed=0, check_invariants=True, device=TEST_DEVICE)
PROMPTS = {f"ok{i}": list(range(40 + 7 * i, 90 + 7 * i)) for i in range(3)}
BAD = list(range(300, 340))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Each good prompt's tokens, run alone."""
    async def body(eng: AsyncEngine) -> dict[str, list[int]]:
        return {rid: (await collect(eng, rid, p))[0] for rid, p in PROMPTS.items()}
    return run_engine(body, **KW)[0]


async def _beside(eng: AsyncEngine, bad_rid: str = "bad", bad_prompt: list[int] = BAD):
    """The good prompts and one bad request, together; returns (good tokens, bad's last)."""
    results = await asyncio.gather(*(collect(eng, rid, p) for rid, p in PROMPTS.items()),
                                   collect(eng, bad_rid, bad_prompt))
    good = {rid: r for rid, r in zip(PROMPTS, results)}
    for rid, (_, last) in good.items():
        assert last.error is None, (rid, last.error)
    return {rid: toks for rid, (toks, _) in good.items()}, results[-1]


def test_a_request_whose_step_bookkeeping_fails_ends_alone(reference) -> None:
    async def body(eng: AsyncEngine):
        real, calls = eng.core.kv.cache_blocks, {"n": 0}

        def cache_blocks(req) -> None:
            if req.request_id == "bad":
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("boom in cache_blocks")
            real(req)

        eng.core.kv.cache_blocks = cache_blocks
        return await _beside(eng)

    (good, (toks, last)), _ = run_engine(body, **KW)
    assert good == reference
    assert last.finish_reason == "error" and "could not finish the step" in last.error
    assert len(toks) < 24


def test_a_running_request_whose_allocation_fails_ends_alone(reference) -> None:
    async def body(eng: AsyncEngine):
        real = eng.core.kv.allocate_slots

        def allocate_slots(req, n, computed=()):
            if req.request_id == "bad" and req.num_output_tokens >= 2:
                raise RuntimeError("boom in allocate_slots")
            return real(req, n, computed)

        eng.core.kv.allocate_slots = allocate_slots
        return await _beside(eng)

    (good, (toks, last)), _ = run_engine(body, **KW)
    assert good == reference
    assert last.finish_reason == "error" and "could not allocate KV" in last.error
    assert len(toks) == 2


def test_a_failed_forward_ends_its_batch_not_the_queue(reference) -> None:
    """One sequence at a time: the forward fails while "bad" runs; the queued requests were
    in no batch of it, and are served unchanged."""
    async def body(eng: AsyncEngine):
        real = eng.core.runner.execute

        def execute(sched, kv):
            if any(s.seq.request_id == "bad" and s.seq.num_output_tokens == 5 for s in sched.scheduled):
                raise RuntimeError("forward failed")
            return real(sched, kv)

        eng.core.runner.execute = execute
        bad = asyncio.create_task(collect(eng, "bad", BAD))
        await asyncio.sleep(0)  # (submitted first: it runs while the others queue)
        good, _ = await _beside(eng, "bad2", BAD[:20])
        return good, await bad

    (good, (toks, last)), _ = run_engine(body, **{**KW, "max_num_seqs": 1})
    assert good == reference
    assert last.finish_reason == "error" and "engine step failed" in last.error and len(toks) == 5


def test_a_finish_that_raises_still_answers_and_frees(reference) -> None:
    async def body(eng: AsyncEngine):
        inflight = eng.core.scheduler.inflight
        real, raised = inflight.drop, []

        def drop(request_id: str) -> None:
            if request_id == "bad" and not raised:  # (its finish calls this first)
                raised.append(1)
                raise RuntimeError("boom in finish")
            real(request_id)

        inflight.drop = drop
        return await _beside(eng, "bad", list(range(500, 600)))

    (good, (toks, last)), _ = run_engine(body, **KW)
    assert good == reference
    assert last.finished and last.error is None and len(toks) == 24  # it had finished


def test_a_request_the_core_loses_is_answered(reference, monkeypatch) -> None:
    """A bug drops a request after the core let it go (its final output never made): its
    caller gets an error within two checks instead of waiting for ever."""
    monkeypatch.setattr(engine_mod, "_DEAD_CHECK_S", 0.2)

    async def body(eng: AsyncEngine):
        _lose_final_output(eng, "bad")
        t0 = time.monotonic()
        out = await _beside(eng)
        return out, time.monotonic() - t0

    ((good, (_, last)), took), _ = run_engine(body, **KW)
    assert good == reference
    assert last.finish_reason == "error" and "lost the request" in last.error
    assert took < 10


def test_shutdown_answers_a_request_the_core_never_will() -> None:
    """D2's shape: a request nobody will answer must not hold shutdown past its drain
    timeout, and is answered by it."""
    async def go():
        eng = AsyncEngine.from_args(**KW)
        await eng.start()
        dropped = _lose_final_output(eng, "bad")
        bad = asyncio.create_task(collect(eng, "bad", BAD))
        assert await asyncio.to_thread(dropped.wait, 30)
        t0 = time.monotonic()
        await eng.shutdown(drain_timeout=0.5)
        took = time.monotonic() - t0
        with pytest.raises(EngineDraining, match="shut"):  # (the server's 503)
            await asyncio.wait_for(bad, 10)
        return took, eng

    took, eng = asyncio.run(go())
    assert took < 3
    assert eng.core.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("lasting", [False, True])
def test_a_scheduler_fault_with_no_request_to_blame(reference, lasting: bool) -> None:
    """Once: nobody's request is lost for it. Every step: after a bounded number of
    tries every request ends with the error, and the engine then serves the next ones."""
    async def body(eng: AsyncEngine):
        sched = eng.core.scheduler
        real, calls = sched.schedule, {"n": 0}

        def schedule():
            calls["n"] += 1
            if calls["n"] == 3 or lasting:
                raise RuntimeError("scheduler bookkeeping broke")
            return real()

        sched.schedule = schedule
        results = await asyncio.gather(*(collect(eng, rid, p) for rid, p in PROMPTS.items()))
        sched.schedule = real
        after = await collect(eng, "after", PROMPTS["ok0"])
        return results, after

    (results, after), eng = run_engine(body, **KW)
    if lasting:
        assert all(last.finish_reason == "error" and "engine step failed" in last.error
                   for _, last in results)
    else:
        assert {rid: toks for rid, (toks, _) in zip(PROMPTS, results)} == reference
    assert after[0] == reference["ok0"] and eng.core.dead is None


def _tier_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4000) for _ in range(n)]


@pytest.mark.parametrize("where", ["start", "job"])
def test_a_restore_that_breaks_ends_or_recomputes_alone(where: str) -> None:
    """A restore that cannot start ends its request alone (no CPU block left pinned, no key
    left claimed); one whose copy fails recomputes it. Either way the next one restores."""
    a, b = _tier_prompt(300, 1), _tier_prompt(400, 2)

    async def body(eng: AsyncEngine):
        tiers = eng.core.tiers
        ref, _ = await collect(eng, "a1", a)
        await collect(eng, "b1", b)  # pushes a out of the device pool, into the CPU tier
        name = "start_load" if where == "start" else "_load_job"
        real = getattr(tiers, name)

        def broken(*args):
            raise RuntimeError(f"restore broke in {name}")

        setattr(tiers, name, broken)
        toks, last = await collect(eng, "a2", a)
        setattr(tiers, name, real)
        assert_clean(eng)
        await collect(eng, "b2", b)
        again, again_last = await collect(eng, "a3", a)
        return ref, toks, last, again, again_last

    (ref, toks, last, again, again_last), _ = run_engine(
        body, check_invariants=True, block_size=16, kv_cache_tokens=512, device=TEST_DEVICE,
        kv_cpu_gib=0.01)
    if where == "start":
        assert last.finish_reason == "error" and "could not schedule" in last.error
    else:
        assert toks == ref and last.error is None  # recomputed
    assert again == ref and again_last.cached_by_tier["cpu"] > 0


def _lose_final_output(eng: AsyncEngine, rid: str) -> threading.Event:
    """Make the core drop ``rid``'s final output (as a bug after it left the scheduler);
    the event is set once it did."""
    real, dropped = eng.core._output, threading.Event()

    def output(seq, new, reason, error=None):
        if seq.request_id == rid and reason is not None:
            dropped.set()
            raise RuntimeError("lost the final output")
        return real(seq, new, reason, error)

    eng.core._output = output
    return dropped
