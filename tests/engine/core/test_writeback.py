"""Write-back offload (``--kv-store-on evict``) on the tiny model: blocks reach the CPU tier
when the device evicts them, restores from it give the recomputed tokens, a tier smaller
than the device serves what write-through cannot, and a failed copy loses no request."""

from __future__ import annotations

import pytest

from agentserve.engine.core.request import SamplingParams
from agentserve.kv.offload.policies import BlockInfo
from agentserve.kv.offload.writeback import EvictionStore
from tests.engine.core.test_tiered import A, B, _evict_and_resume, _run, _with


@pytest.fixture(scope="module")
def reference() -> list[int]:
    (toks, _), _ = _with(lambda eng: _run(eng, "ref", A))
    return toks


@pytest.mark.parametrize("unit", [None, 32])
def test_write_back_stores_only_what_the_device_evicts(reference, unit: int | None) -> None:
    async def go(eng):
        await _run(eng, "a1", A, "A")
        stored_alone = eng.stats().tiers["store_blocks"]["cpu"]
        first, again, last = await _evict_and_resume(eng, A, B)
        return stored_alone, again, last
    (stored_alone, again, last), eng = _with(go, kv_cpu_gib=0.01, kv_store_on="evict",
                                             kv_offload_block_tokens=unit)
    assert stored_alone == 0, "nothing was evicted yet, so nothing may have been copied"
    assert again == reference and last.cached_by_tier["cpu"] > 0
    t = eng.stats().tiers
    assert t["store_blocks"]["cpu"] > 0 and t["restore_outcome"]["used"] == t["restore_blocks"]["cpu"]
    assert t["stores_skipped"] == 0


def test_write_through_stores_as_blocks_fill() -> None:
    """The contrast for the test above: fill mode copies a block nobody evicted."""
    async def go(eng):
        await _run(eng, "a1", A, "A")
        return eng.stats().tiers["store_blocks"]["cpu"]
    stored, _ = _with(go, kv_cpu_gib=0.01)
    assert stored == len(A) // 16


def _small_tier(mode: str):
    # 20 offload blocks of 16 tokens: under the device's 32, and under A + B (19 + 25)
    async def go(eng):
        slots = eng.core.tiers.mgr.cpu.num_slots
        return slots, await _evict_and_resume(eng, A, B)
    _, probe = _with(_noop, kv_cpu_gib=0.01)
    block_bytes = probe.core.tiers.mgr.cpu.block_bytes
    (slots, (_, again, last)), eng = _with(go, kv_cpu_gib=20.5 * block_bytes / 2**30,
                                           kv_store_on=mode)
    assert slots == 20
    return again, last, eng


async def _noop(eng):
    return None


def test_a_tier_smaller_than_the_device_serves_only_under_write_back(reference) -> None:
    """Write-through: B's blocks, copied as they filled, push A's out of the small tier
    while the device still holds them; then the device evicts A too. Write-back: the
    tier receives A's blocks as B evicts them, and A resumes from the device + the tier."""
    again, last, _ = _small_tier("fill")
    assert again == reference and last.cached_by_tier.get("cpu", 0) == 0
    again, last, eng = _small_tier("evict")
    assert again == reference and last.cached_by_tier["cpu"] > 0
    assert last.cached_by_tier["gpu"] + last.cached_by_tier["cpu"] == last.num_cached_tokens


def test_write_back_copy_failure_loses_no_request(reference) -> None:
    """The eviction-time copy raises: the allocation and every request go on, the blocks
    are counted as not offloaded, and the resumed request recomputes."""
    async def go(eng):
        def broken(*a, **kw):
            raise RuntimeError("simulated copy failure")
        eng.core.tiers.worker.device_to_host = broken
        return await _evict_and_resume(eng, A, B)
    (first, again, last), eng = _with(go, kv_cpu_gib=0.01, kv_store_on="evict")
    assert first == again == reference
    assert last.cached_by_tier.get("cpu", 0) == 0
    t = eng.stats().tiers
    assert t["stores_skipped"] > 0 and t["store_blocks"]["cpu"] == 0
    assert eng.core.tiers.mgr.cpu.free_slots and not eng.core.tiers.mgr.cpu.slots  # released


def test_eviction_store_forgets_the_oldest_groups_beyond_its_bound() -> None:
    ws = EvictionStore(conn=None, max_groups=2)  # type: ignore[arg-type]
    for i in range(3):
        ws.remember(bytes([i]) * 2, BlockInfo("s", i), [i], [bytes([i]), bytes([i]) * 2])
    assert len(ws) == 2 and bytes([0]) not in ws._member and bytes([2]) in ws._member
    ws.remember(bytes([1]) * 2, BlockInfo("s", 1), [1], [bytes([1]), bytes([1]) * 2])  # refresh
    ws.remember(bytes([3]) * 2, BlockInfo("s", 3), [3], [bytes([3]), bytes([3]) * 2])
    assert bytes([1]) in ws._member and bytes([2]) not in ws._member


def test_kv_store_on_is_validated() -> None:
    from agentserve.engine.builder import EngineConfigError
    with pytest.raises(EngineConfigError, match="--kv-store-on"):
        _with(_noop, kv_cpu_gib=0.01, kv_store_on="sometimes")


def test_write_back_under_concurrent_sessions_and_preemption(reference) -> None:
    """Six sessions of growing turns at once through a pool that holds two of them and a
    tier that holds about three: evictions store while restores load and preemptions free.
    Every turn completes, the tiers served some of them, every restored block was used,
    and no block leaks (``_with`` checks the pool after shutdown)."""
    import asyncio

    from tests.engine.core.test_tiered import _prompt

    async def session(eng, s: int):
        ctx = _prompt(96, 100 + s)
        for t in range(3):
            toks, last = await _run(eng, f"s{s}t{t}", ctx, f"S{s}")
            assert last.error is None and len(toks) == 4
            ctx = ctx + toks + _prompt(48, 1000 * s + t)
        return True

    async def go(eng):
        return await asyncio.gather(*[session(eng, s) for s in range(6)])

    _, probe = _with(_noop, kv_cpu_gib=0.01)
    block_bytes = probe.core.tiers.mgr.cpu.block_bytes
    ok, eng = _with(go, kv_cpu_gib=48.5 * block_bytes / 2**30, kv_store_on="evict",
                    kv_cpu_policy="session", kv_offload_block_tokens=32)
    assert all(ok) and eng.core.scheduler.stats.num_preemptions > 0
    t = eng.stats().tiers
    assert t["store_blocks"]["cpu"] > 0 and t["hit_tokens"]["cpu"] > 0
    out = t["restore_outcome"]
    assert out["failed"] == 0 and out["used"] + out["repeat"] + out["aborted"] == t["restore_blocks"]["cpu"]


def test_write_back_flushes_to_disk_at_shutdown(tmp_path, reference) -> None:
    """Nothing was evicted, so nothing reached the tiers while serving; a clean shutdown
    writes what the device held, and a restarted engine serves it from disk."""
    kw = dict(kv_cpu_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05, kv_store_on="evict")

    async def first(eng):
        out = await _run(eng, "a1", A)
        assert eng.stats().tiers["store_blocks"]["disk"] == 0
        return out
    (toks, _), eng = _with(first, **kw)
    assert toks == reference and eng.stats().tiers["store_blocks"]["disk"] == len(A) // 16
    (toks, last), eng = _with(lambda e: _run(e, "a2", A), **kw)  # a fresh engine
    assert toks == reference
    assert last.cached_by_tier["disk"] == 288 and last.num_cached_tokens == 288


def test_a_request_whose_admission_after_a_restore_raises_ends_alone(reference) -> None:
    """A bug after the KV arrived (here: the restore audit raises for one request) ends that
    request alone. Before, it failed the whole step, and with it every running request (a
    raise before the request joined ``running`` would have left it waiting for ever)."""
    import asyncio

    async def go(eng):
        # restore always wins: this test is about what follows the KV's arrival, and the timed
        # restore-vs-recompute choice picked recompute once on a loaded box (no restore, no audit)
        eng.core.tiers.est.recompute_s = lambda tokens: float("inf")
        audit = eng.core.tiers.audit
        real = audit.account

        def account(seq, *a, **kw):
            if seq.request_id == "a2":
                raise RuntimeError("simulated bookkeeping bug")
            return real(seq, *a, **kw)
        audit.account = account
        await _run(eng, "a1", A, "A")
        await _run(eng, "b1", B, "B")

        async def decoding():  # running while a2's restore lands
            toks, last = [], None
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            async for out in eng.generate("c1", B[:64], params, session_id="C"):
                toks += out.new_token_ids
                last = out
                if len(toks) == 2:
                    started.set()
            return toks, last
        started = asyncio.Event()
        c1 = asyncio.ensure_future(decoding())
        await asyncio.wait_for(started.wait(), 30)
        bad_toks, bad = await asyncio.wait_for(_run(eng, "a2", A, "A"), 60)
        ok_toks, ok = await asyncio.wait_for(c1, 60)
        return bad_toks, bad, ok_toks, ok
    (bad_toks, bad, ok_toks, ok), eng = _with(go, kv_cpu_gib=0.01, kv_store_on="evict")
    assert bad.finished and bad.error and "after its KV arrived" in bad.error
    assert bad_toks == [] and len(ok_toks) == 40 and ok.error is None
    assert not eng.core.scheduler.loading and not eng.core.seqs
