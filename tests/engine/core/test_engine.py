"""The whole engine core on the tiny model: correctness against a dense reference, prefix
hits, chunked prefill, preemption, aborts, seeds; pool invariants checked every step."""

from __future__ import annotations

import asyncio
import random

import pytest

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.model.tiny import default_model_dir
from tests.conftest import TEST_DEVICE
from tests.engine.model.reference import DenseLlama


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4000) for _ in range(n)]


async def _run(eng: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    toks, last = [], None
    async for out in eng.generate(rid, prompt, params):
        toks += out.new_token_ids
        last = out
    return toks, last


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _with_engine(coro_fn, **kw):
    eng = AsyncEngine.from_args(check_invariants=True, **{"device": TEST_DEVICE, **kw})
    await eng.start()
    try:
        return await coro_fn(eng)
    finally:
        await eng.shutdown(5)
        assert eng.core.kv.pool.num_used_blocks == 0, "blocks leaked"
        eng.core.kv.pool.check_invariants()


@pytest.fixture(scope="module")
def dense() -> DenseLlama:
    return DenseLlama(default_model_dir())


def test_greedy_matches_dense_reference(dense) -> None:
    prompts = [_prompt(n, i) for i, n in enumerate((5, 37, 100))]

    async def go(eng):
        return await asyncio.gather(*[_run(eng, f"r{i}", p, _greedy(8)) for i, p in enumerate(prompts)])

    results = asyncio.run(_with_engine(go, block_size=16))
    for p, (toks, _) in zip(prompts, results):
        assert toks == dense.greedy(p, 8)


def test_prefix_hit_same_tokens_as_cold() -> None:
    p = _prompt(300, 1)

    async def go(eng):
        cold, o1 = await _run(eng, "a", p, _greedy(12))
        warm, o2 = await _run(eng, "b", p, _greedy(12))
        return cold, warm, o1.num_cached_tokens, o2.num_cached_tokens

    cold, warm, c1, c2 = asyncio.run(_with_engine(go))
    assert cold == warm
    assert c1 == 0 and c2 == (300 - 1) // 16 * 16


def test_chunked_and_unchunked_prefill_agree() -> None:
    prompts = [_prompt(n, 10 + n) for n in (70, 129, 250)]

    async def go(eng):
        return await asyncio.gather(*[_run(eng, f"r{i}", p, _greedy(6)) for i, p in enumerate(prompts)])

    big = asyncio.run(_with_engine(go, max_num_batched_tokens=4096))
    small = asyncio.run(_with_engine(go, max_num_batched_tokens=13))
    assert [t for t, _ in big] == [t for t, _ in small]


def test_requests_sharing_an_uncached_head_compute_it_once() -> None:
    """A group of requests over one uncached head (a sub-agent group's shared prompt), sent
    together: the first computes the head, the others wait for it and then hit it in the
    prefix cache, instead of each computing it at a third of the step budget."""
    shared = _prompt(320, 40)  # 20 blocks
    prompts = [shared + _prompt(40, 41 + i) for i in range(3)]

    async def alone(eng):
        return [(await _run(eng, f"a{i}", p, _greedy(6)))[0] for i, p in enumerate(prompts)]

    async def together(eng):
        res = await asyncio.gather(*[_run(eng, f"r{i}", p, _greedy(6)) for i, p in enumerate(prompts)])
        return res, eng.stats(), eng.core.scheduler

    ref = asyncio.run(_with_engine(alone))
    res, stats, sched = asyncio.run(_with_engine(together, max_num_batched_tokens=512,
                                                 long_prefill_token_threshold=64))
    assert [t for t, _ in res] == ref
    assert sorted(last.num_cached_tokens for _, last in res) == [0, 320, 320]
    assert stats.prefix_joined_tokens == 2 * 320
    assert sched.joined == {} and not sched.inflight and not sched.inflight.owner


def test_preemption_under_memory_pressure_keeps_outputs() -> None:
    prompts = [_prompt(60, 30 + i) for i in range(6)]

    async def go(eng):
        return await asyncio.gather(*[_run(eng, f"r{i}", p, _greedy(40)) for i, p in enumerate(prompts)])

    roomy = asyncio.run(_with_engine(go, kv_cache_tokens=8192))

    async def tight_go(eng):
        res = await go(eng)
        return res, eng.stats().num_preemptions

    tight, preemptions = asyncio.run(_with_engine(tight_go, kv_cache_tokens=256, block_size=16))
    assert preemptions > 0
    assert [t for t, _ in roomy] == [t for t, _ in tight]


def test_abort_frees_blocks_and_seeded_sampling_repeats() -> None:
    p = _prompt(90, 5)

    async def go(eng):
        gen = eng.generate("x", p, _greedy(500))
        await gen.__anext__()
        await gen.aclose()  # the client went away
        for _ in range(100):
            if eng.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert eng.stats().num_running == 0 and eng.core.kv.pool.num_used_blocks == 0
        sp = dict(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
        a, _ = await _run(eng, "s1", p, SamplingParams(**sp))
        b, _ = await _run(eng, "s2", p, SamplingParams(**sp))
        stop_tok = a[3]
        c, last = await _run(eng, "s3", p, SamplingParams(**sp, stop_token_ids=[stop_tok]))
        return a, b, c, last

    a, b, c, last = asyncio.run(_with_engine(go))
    assert a == b
    assert c[-1] == a[3] and len(c) <= 4 and last.finish_reason == "stop"


def test_long_prompts_reach_the_core_hashed(monkeypatch) -> None:
    """A prompt of at least HASH_OFF_CORE_TOKENS arrives at the core with every full block
    hashed (done on a worker thread); a shorter one is hashed by the core. Both give the
    tokens and prefix hits of the plain path."""
    from agentserve.engine.core import engine as engine_mod

    monkeypatch.setattr(engine_mod, "HASH_OFF_CORE_TOKENS", 100)
    seen: dict[str, int] = {}

    async def go(eng: AsyncEngine):
        real = eng.core.submit

        def submit(seq):
            seen[seq.request_id] = len(seq.block_hashes)
            real(seq)
        eng.core.submit = submit
        long, short = _prompt(200, 5), _prompt(99, 6)
        a = await _run(eng, "long1", long, _greedy(4))
        b = await _run(eng, "long2", long, _greedy(4))
        c = await _run(eng, "short", short, _greedy(4))
        return a, b, c

    (a, _), (b, last), (c, _) = asyncio.run(_with_engine(go, kv_cache_tokens=1024))
    assert seen == {"long1": 200 // 16, "long2": 200 // 16, "short": 0}
    assert a == b and len(c) == 4 and last.num_cached_tokens == 192
