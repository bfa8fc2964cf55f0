"""The engine with offload tiers on the tiny model: restores give the same tokens as
recomputing, the disk tier survives a restart, corrupt or unwritable disks degrade to
recompute, and the server reports tiers in usage and /metrics."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from pathlib import Path

import pytest

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.kv.offload.disk import FILE_HDR, FILE_HDR_SIZE, REC_HDR_SIZE, _parse_header
from agentserve.kv.events import BlockRemoved, BlockStored
from agentserve.kv.hashing import to_external
from tests.conftest import TEST_DEVICE, ServerThread

# 512 device tokens: a 400-token prompt of another request evicts the first one.
BASE = dict(check_invariants=True, block_size=16, kv_cache_tokens=512, device=TEST_DEVICE)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4000) for _ in range(n)]


async def _run(eng: AsyncEngine, rid: str, prompt: list[int], sid: str | None = None):
    toks, last = [], None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for out in eng.generate(rid, prompt, params, session_id=sid):
        toks += out.new_token_ids
        last = out
    return toks, last


async def _evict_and_resume(eng: AsyncEngine, a: list[int], b: list[int]):
    first, _ = await _run(eng, "a1", a, "A")
    await _run(eng, "b1", b, "B")  # pushes A out of the device pool
    again, last = await _run(eng, "a2", a, "A")
    return first, again, last


def _with(coro_fn, **kw):
    async def go():
        eng = AsyncEngine.from_args(**BASE, **kw)
        await eng.start()
        try:
            return await coro_fn(eng), eng
        finally:
            await eng.shutdown(5)
            assert eng.core.kv.pool.num_used_blocks == 0, "blocks leaked"
            eng.core.kv.pool.check_invariants()
    return asyncio.run(go())


A, B = _prompt(300, 1), _prompt(400, 2)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    (toks, _), _ = _with(lambda eng: _run(eng, "ref", A))
    return toks


@pytest.mark.parametrize("policy,unit", [("lru", None), ("arc", None), ("session", 32)])
def test_restore_from_cpu_matches_recompute(reference, policy: str, unit: int | None) -> None:
    (first, again, last), eng = _with(lambda e: _evict_and_resume(e, A, B), kv_cpu_gib=0.01,
                                      kv_cpu_policy=policy, kv_offload_block_tokens=unit)
    assert first == again == reference
    by = last.cached_by_tier
    assert by["cpu"] > 0 and last.num_cached_tokens == sum(by.values())
    t = eng.stats().tiers
    assert t["restore_bytes"]["cpu"] > 0 and t["decisions"]["restore"] == 1
    assert t["hit_tokens"]["cpu"] == by["cpu"] and t["restore_latency_count"] == 1


def test_restore_accounting_every_restored_block_is_used_once() -> None:
    _, eng = _with(lambda e: _evict_and_resume(e, A, B), kv_cpu_gib=0.01)
    t = eng.stats().tiers
    out = t["restore_outcome"]
    assert out["used"] == t["restore_blocks"]["cpu"] > 0
    assert out["repeat"] == out["device_held"] == out["aborted"] == out["failed"] == 0
    assert sum(t["restore_sizes"].values()) == t["decisions"]["restore"] == 1
    # B evicted A's blocks moments before A resumed
    assert t["restore_device_age"]["<2s"] == out["used"] and t["restore_preempted_blocks"] == 0


def test_requests_sharing_a_prefix_restore_it_once(reference) -> None:
    """A burst of requests over one evicted prefix (a sub-agent group's shared prompt): the
    first restores it, the others wait for that restore and hit it on the device, rather
    than restore the same bytes again (each got its own copy before)."""
    async def go(eng: AsyncEngine):
        await _run(eng, "a1", A, "A")
        await _run(eng, "b1", B, "B")  # pushes A out of the device pool
        return await asyncio.gather(*[_run(eng, f"a{i}", A, "A") for i in range(2, 5)])
    outs, eng = _with(go, kv_cpu_gib=0.01)
    assert [toks for toks, _ in outs] == [reference] * 3
    t = eng.stats().tiers
    restored = t["restore_blocks"]["cpu"]
    assert t["decisions"]["restore"] == 1 and restored == t["restore_outcome"]["used"] > 0
    # (the third may reach the core after the restore ended: then it just hits the device)
    assert t["restore_joined_blocks"] in (restored, 2 * restored)
    # all three hit the whole prefix; the two that waited found the restored part on the
    # device: the bytes crossed once
    full = (len(A) - 1) // 16 * 16
    cached = sorted((last.cached_by_tier.get("cpu", 0), last.num_cached_tokens) for _, last in outs)
    assert cached == [(0, full)] * 2 + [(restored * 16, full)]


def test_a_request_aborted_while_waiting_on_another_restore_leaks_nothing(reference) -> None:
    """The waiting request is aborted before the restore it waits on ends: it ends at
    once, the restore's own request is unaffected, and no block is left held."""
    async def go(eng: AsyncEngine):
        await _run(eng, "a1", A, "A")
        await _run(eng, "b1", B, "B")
        worker = eng.core.tiers.worker
        copy = worker.host_to_device

        def slow_copy(*args):  # a slow link: the restore is still in flight at the abort
            time.sleep(0.5)
            return copy(*args)
        worker.host_to_device = slow_copy
        leader = asyncio.create_task(_run(eng, "a2", A, "A"))
        follower = asyncio.create_task(_run(eng, "a3", A, "A"))
        await asyncio.sleep(0.2)
        joined = {k: [s.request_id for s in v] for k, v in eng.core.scheduler.joined.items()}
        waiting = eng.stats().num_waiting  # as vLLM: waiting for KV is waiting
        await eng.abort("a3")
        aborted_at = time.monotonic()
        f_toks, f_last = await follower
        waited = time.monotonic() - aborted_at
        toks, _ = await leader
        return joined, toks, (f_toks, f_last.finish_reason, waited), dict(eng.core.scheduler.joined), waiting
    (joined, toks, follower, after, waiting), eng = _with(go, kv_cpu_gib=0.01)
    assert joined == {"a2": ["a3"]}  # it did wait on a2's restore
    assert waiting == 2  # a2 restoring, a3 parked behind it
    f_toks, reason, waited = follower
    assert f_toks == [] and reason == "abort" and waited < 0.25  # not after the restore
    assert toks == reference and after == {}

    """A failed load, an aborted one, a block the device still held, a block restored twice
    for one request (after a preemption) and a preemption before the first token."""
    from agentserve.engine.core.sequence import Sequence
    from agentserve.kv.offload.connector import RestorePlan

    async def noop(eng: AsyncEngine):
        return None
    _, eng = _with(noop, kv_cpu_gib=0.01)
    tc = eng.core.tiers
    seq = Sequence("r", list(range(64)), SamplingParams(max_tokens=1))
    k1, k2, k3 = b"1" * 32, b"2" * 32, b"3" * 32
    plan = RestorePlan(0, 2, [k1, k2], ["cpu", "cpu"], 0, held=[False, False])
    audit = tc.audit
    audit.account(seq, plan, ok=False, admitted=False)
    audit.account(seq, plan, ok=True, admitted=False)
    audit.account(seq, plan, ok=True, admitted=True)
    audit.on_preempt(seq)
    audit.account(seq, RestorePlan(0, 2, [k2, k3], ["cpu"] * 2, 0, held=[False, True]), True, True)
    out = tc.stats.restore_outcome
    assert (out["failed"], out["aborted"], out["used"], out["repeat"], out["device_held"]) == (2, 2, 2, 1, 1)
    assert tc.stats.restore_preempted_blocks == 2 and tc.stats.restore_device_age["older"] == 4
    tc.on_finish(seq)
    assert "r" not in audit._restored and "r" not in audit._unproven


def test_no_tier_is_the_plain_engine() -> None:
    (_, _, last), eng = _with(lambda e: _evict_and_resume(e, A, B))
    assert eng.core.tiers is None and eng.stats().tiers is None
    assert last.cached_by_tier is None


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="pinned memory is for CUDA caches")
def test_cpu_tier_is_pinned_memory_on_cuda(reference) -> None:
    """On CUDA the host tier is page-locked, so its copies can run asynchronously."""
    (_, again, last), eng = _with(lambda e: _evict_and_resume(e, A, B), kv_cpu_gib=0.01)
    assert eng.core.tiers.mgr.cpu.buf.is_pinned() and eng.core.runner.kv_cache.k.is_cuda
    assert again == reference and last.cached_by_tier["cpu"] > 0


def test_restore_never_recomputes(reference) -> None:
    (_, again, last), eng = _with(lambda e: _evict_and_resume(e, A, B), kv_cpu_gib=0.01,
                                  kv_restore_mode="never")
    assert again == reference and last.cached_by_tier.get("cpu", 0) == 0
    # one decision per request, however often its plan is re-evaluated while it waits
    assert eng.stats().tiers["decisions"] == {"restore": 0, "recompute": 1, "pull": 0}


def test_disk_tier_survives_restart(tmp_path, reference) -> None:
    kw = dict(kv_cpu_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    (toks, _), eng = _with(lambda e: _run(e, "a1", A), **kw)
    assert toks == reference and eng.stats().tiers["store_blocks"]["disk"] > 0
    (toks, last), eng = _with(lambda e: _run(e, "a2", A), **kw)  # a fresh engine
    assert toks == reference
    assert last.cached_by_tier["disk"] == 288 and last.num_cached_tokens == 288
    assert eng.stats().tiers["restore_bytes"]["disk"] > 0


class _Recorder:
    """Stands in for the ZMQ publisher: keeps every event the engine publishes."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, events, ts=None) -> None:
        self.events += list(events)

    def close(self, timeout: float = 1.0) -> None:
        pass


def _corrupt_on_disk(root: Path, key: bytes) -> None:
    """Flip one payload byte of ``key``'s record in the disk tier's segments."""
    for seg in sorted(root.glob("seg-*.kv")):
        data = bytearray(seg.read_bytes())
        stride = REC_HDR_SIZE + FILE_HDR.unpack_from(data)[3]  # + payload bytes
        for off in range(FILE_HDR_SIZE, len(data) - stride + 1, stride):
            rec = _parse_header(bytes(data[off:off + REC_HDR_SIZE]))
            if rec is not None and rec[0] == key:
                data[off + REC_HDR_SIZE + 5] ^= 0xFF
                seg.write_bytes(bytes(data))
                return
    raise AssertionError("block not found on disk")


@pytest.mark.parametrize("bad", [0, 7, 17])
def test_corrupt_disk_block_ends_the_restore_there(tmp_path, reference, bad: int) -> None:
    """A restore is a chain in prefix order: blocks before a corrupt one are kept (hits),
    it and the rest are recomputed, it is dropped from the index, and only the kept
    prefix is announced on the device when the restore ends."""
    kw = dict(kv_cpu_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    _, first = _with(lambda e: _run(e, "a1", A), **kw)
    hashes = first.core.kv.hasher.hash_blocks(A)  # A's 18 full blocks, all restorable
    _corrupt_on_disk(tmp_path, hashes[bad])
    rec = _Recorder()

    async def resume(eng: AsyncEngine):
        eng.core.publisher.close()
        eng.core.publisher = rec
        return await _run(eng, "a2", A)
    (toks, last), eng = _with(resume, **kw, kv_events_endpoint="tcp://127.0.0.1:0")
    t = eng.stats().tiers
    assert toks == reference, "restored KV differs from recomputed KV"
    assert last.cached_by_tier.get("disk", 0) == bad * 16 == last.num_cached_tokens
    assert t["restore_blocks"]["disk"] == bad and t["disk_corrupt_blocks"] == 1
    assert (t["restore_failures"], t["restores_truncated"]) == ((1, 0) if bad == 0 else (0, 1))
    assert t["restore_outcome"]["used"] == bad
    ext = [to_external(h, eng.core.kv.pool.int_hashes) for h in hashes]
    gpu = [e for e in rec.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert gpu[0].block_hashes == ext[:bad or 18]  # restored prefix, else the whole prompt
    assert [e.block_hashes for e in rec.events
            if isinstance(e, BlockRemoved) and e.medium == "DISK"] == [[ext[bad]]]
    # the recomputed block went back to disk: a fresh engine restores the whole prefix
    (toks, last), eng = _with(lambda e: _run(e, "a3", A), **kw)
    assert toks == reference and last.cached_by_tier.get("disk", 0) == 288


def test_engine_starts_over_what_a_crash_or_full_disk_leaves(tmp_path, reference) -> None:
    """D5: a 0-byte segment (and other damage) is skipped and counted; the engine serves
    and still restores the good segments."""
    kw = dict(kv_cpu_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    _with(lambda e: _run(e, "a1", A), **kw)
    (tmp_path / "seg-00000100.kv").write_bytes(b"")  # created, then the disk was full
    (tmp_path / "seg-00000101.kv").write_bytes(b"ASKVSEG1\x01")  # torn header
    (tmp_path / "seg-00000102.kv").mkdir()  # cannot be read
    (tmp_path / "seg-x.kv").write_bytes(b"junk")  # not a name the tier writes
    served = ServerThread(**BASE, **kw).start()
    try:
        body = json.dumps({"prompt": A, "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(served.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            usage = json.loads(r.read())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens_by_tier"]["disk"] == 288
        text = _get(served.url + "/metrics")
        skipped = {ln.split('reason="')[1].split('"')[0]: float(ln.split()[-1])
                   for ln in text.splitlines()
                   if ln.startswith("agentserve:kv_disk_segments_skipped_total{")}
        assert skipped == {"damaged": 2, "foreign": 0, "unreadable": 1, "stray": 1}
    finally:
        served.close()
    assert not (tmp_path / "seg-00000100.kv").exists()  # damaged: removed, its room reused
    assert (tmp_path / "seg-00000102.kv").is_dir() and (tmp_path / "seg-x.kv").exists()


def test_unwritable_disk_disables_itself_and_serving_continues(tmp_path, reference) -> None:
    # Once the engine has scanned the folder, the first segment's path is taken by a folder:
    # every write fails (as on a full or read-only disk, and unlike chmod this also holds
    # when the tests run as root).
    async def go(eng: AsyncEngine):
        (tmp_path / "seg-00000000.kv").mkdir()
        return await _evict_and_resume(eng, A, B)
    (first, again, _), eng = _with(go, kv_cpu_gib=0.01, kv_disk_dir=str(tmp_path),
                                   kv_disk_gib=0.05)
    assert first == again == reference and eng.stats().tiers["disk_disabled"] == 1


def test_backpressure_and_abort_while_loading(reference) -> None:
    async def go(eng: AsyncEngine):
        prompts = [_prompt(160, 10 + i) for i in range(4)]
        base = await asyncio.gather(*[_run(eng, f"w{i}", p) for i, p in enumerate(prompts)])
        await _run(eng, "evict", B)
        again = await asyncio.gather(*[_run(eng, f"r{i}", p) for i, p in enumerate(prompts)])
        return [t for t, _ in base], [t for t, _ in again]
    (base, again), eng = _with(go, kv_cpu_gib=0.01, kv_max_loads=1)
    assert base == again
    assert eng.stats().tiers["restore_bytes"]["cpu"] > 0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_server_usage_breakdown_session_header_and_metrics() -> None:
    served = ServerThread(**BASE, kv_cpu_gib=0.01, kv_cpu_policy="session").start()
    try:
        def complete(prompt: list[int]) -> dict:
            body = json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
            req = urllib.request.Request(served.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "x-session-id": "sess-1"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        usages = [complete(A)["usage"], complete(B)["usage"], complete(A)["usage"]]
        details = usages[-1]["prompt_tokens_details"]
        # vllm:prefix_cache_hits / _queries count every tier, as usage.cached_tokens does
        st = served.engine.stats()
        assert st.prefix_hits_tokens == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert st.prefix_queries_tokens == sum(u["prompt_tokens"] for u in usages)
        assert details["cached_tokens"] == sum(details["cached_tokens_by_tier"].values())
        assert details["cached_tokens_by_tier"]["cpu"] > 0
        assert "sess-1" in served.engine.core.tiers.mgr.cpu.policy.sessions
        text = _get(served.url + "/metrics")
        line = next(ln for ln in text.splitlines()
                    if ln.startswith('agentserve:kv_restore_bytes_total{') and 'tier="cpu"' in ln)
        assert float(line.split()[-1]) > 0
        assert "agentserve:kv_restore_latency_seconds_bucket" in text
        assert 'agentserve:kv_restore_decisions_total{choice="restore"' in text
    finally:
        served.close()


def test_write_through_stores_keep_the_device_eviction_order() -> None:
    """A request that ends while its blocks are still being copied to the CPU tier gets them
    back on the device free queue tails first, as without a tier: a later request evicts
    the same blocks, and the prefix's head stays a device hit."""
    import time as _time

    async def a_then_b(eng: AsyncEngine) -> int:
        tiers = eng.core.tiers
        if tiers is not None:  # copies finish well after the request
            copy = tiers.worker.device_to_host

            def slow(*args):
                _time.sleep(0.3)
                return copy(*args)
            tiers.worker.device_to_host = slow
        await _run(eng, "a1", A)
        for _ in range(200):  # bounded: the store ends within 0.3 s plus a step
            if tiers is None or not tiers.busy:
                break
            await asyncio.sleep(0.02)
        assert tiers is None or not tiers.busy
        await _run(eng, "b1", B)  # evicts part of A
        hashes: list[bytes] = []
        eng.core.kv.hasher.extend(hashes, A)
        cached = eng.core.kv.pool.cached
        return next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))

    plain, _ = _with(a_then_b)
    tiered, _ = _with(a_then_b, kv_cpu_gib=0.01)
    assert 0 < plain < len(A) // 16  # B evicted A's tail, not its head
    assert tiered == plain
