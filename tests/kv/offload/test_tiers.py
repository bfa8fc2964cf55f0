"""Offload tiers without an engine: policies, CPU tier, offload protocol, disk segments."""

from __future__ import annotations

import os
import resource

import torch

from agentserve.kv.offload.disk import FILE_HDR_SIZE, REC_HDR_SIZE, DiskTier
from agentserve.kv.offload.manager import OffloadManager
from agentserve.kv.offload.policies import ARCPolicy, BlockInfo, LRUPolicy, SessionPolicy
from agentserve.kv.offload.tiers import CPUTier, RestoreEstimator


def K(i: int) -> bytes:
    return i.to_bytes(32, "big")


def never(_: bytes) -> bool:
    return False


def test_lru_evicts_oldest_and_skips_pinned() -> None:
    p = LRUPolicy()
    for i in range(3):
        p.insert(K(i), BlockInfo())
    p.touch(K(0))
    assert p.victim(never) == K(1)
    assert p.victim(lambda k: k == K(1)) == K(2)


def test_arc_protects_reused_blocks_from_a_scan() -> None:
    p = ARCPolicy(capacity=4)
    p.insert(K(0), BlockInfo())
    p.touch(K(0))  # reused: moves to T2
    for i in range(1, 4):
        p.insert(K(i), BlockInfo())
    # T1 (one-shot blocks) is larger than p=0: evict from it first.
    assert p.victim(never) == K(1)
    p.remove(K(1))
    p.insert(K(1), BlockInfo())  # ghost hit in B1 grows T1's target
    assert p.p > 0 and K(1) in p.t2


def test_session_policy_evicts_tail_first_and_idle_sessions_first() -> None:
    now = [0.0]
    p = SessionPolicy(ttl=100.0, clock=lambda: now[0])
    for pos in range(4):
        p.insert(K(pos), BlockInfo("A", pos))
    for pos in range(2):
        p.insert(K(10 + pos), BlockInfo("B", pos))
    p.on_request("A", [], now=1.0)
    p.on_finish("A", now=5.0)
    p.on_request("B", [], now=2.0)
    p.on_finish("B", now=3.0)
    now[0] = 10.0
    # B paused longest -> its chain tail goes first; then B's head; then A's tail.
    order = []
    for _ in range(4):
        k = p.victim(never)
        order.append(k)
        p.remove(k)
    assert order == [K(11), K(10), K(3), K(2)]


def test_session_policy_stale_blocks_before_live_and_active_last() -> None:
    now = [0.0]
    p = SessionPolicy(ttl=1000.0, clock=lambda: now[0])
    for pos in range(3):
        p.insert(K(pos), BlockInfo("A", pos))
    p.insert(K(9), BlockInfo("A", 3))  # a block the next turn will not re-read
    p.insert(K(20), BlockInfo("B", 0))
    p.on_request("A", [K(0), K(1), K(2)], now=1.0)  # new turn re-reads 0..2: 9 is stale
    p.on_finish("A", now=2.0)
    p.on_request("B", [K(20)], now=3.0)  # B active: evicted last
    assert p.victim(never) == K(9)
    p.remove(K(9))
    assert p.victim(never) == K(2)
    now[0] = 5000.0  # A idle past the TTL: finished, still before active B
    assert p.victim(lambda k: k in (K(0), K(1), K(2))) == K(20)


def _cpu(n: int, policy=None) -> CPUTier:
    return CPUTier(n, (2, 1, 4, 1, 2), torch.float32, policy or LRUPolicy())


def test_offload_protocol_lookup_load_store_and_events() -> None:
    mgr = OffloadManager(_cpu(2), None, block_size=4)
    keys = [K(1), K(2), K(3)]
    infos = [BlockInfo(None, i) for i in range(3)]
    to_store, evicted = mgr.prepare_store(keys[:2], infos[:2], [[1], [2]])
    assert [k for k, _ in to_store] == keys[:2] and evicted == []
    assert mgr.lookup(keys) == 0  # not readable before complete_store
    mgr.complete_store(keys[:2], True, infos[:2])
    assert mgr.lookup(keys) == 2
    srcs = mgr.prepare_load(keys[:1])
    # K(1) pinned by the load: storing K(3) must evict K(2), not K(1).
    to_store, evicted = mgr.prepare_store([K(3)], infos[2:], [[3]])
    assert evicted == [K(2)]
    mgr.complete_load(keys[:1], srcs)
    mgr.complete_store([K(3)], True, infos[2:])
    ev = mgr.take_events()
    kinds = [(type(e).__name__, e.medium, e.block_hashes) for e in ev]
    assert kinds == [("BlockStored", "CPU", [1, 2]), ("BlockRemoved", "CPU", [2]),
                     ("BlockStored", "CPU", [3])]


def test_prepare_store_skips_when_everything_is_pinned() -> None:
    mgr = OffloadManager(_cpu(1), None, block_size=4)
    mgr.prepare_store([K(1)], [BlockInfo()], [[1]])  # reserved, store in flight = pinned
    to_store, evicted = mgr.prepare_store([K(2)], [BlockInfo()], [[2]])
    assert to_store == [] and evicted == [] and mgr.stats.stores_skipped == 1


def _disk(tmp_path, cap_blocks: int = 8) -> DiskTier:
    return DiskTier(tmp_path, capacity_bytes=cap_blocks * (REC_HDR_SIZE + 64), payload_bytes=64,
                    fingerprint=b"model-A")


def test_disk_roundtrip_and_restart_scan(tmp_path) -> None:
    d = _disk(tmp_path)
    for i in range(3):
        loc, _, _ = d.reserve(K(i))
        d.write_block(K(i), loc, bytes([i]) * 64)
        d.commit(K(i), True)
    assert d.read_block(K(1), d.index[K(1)]) == bytes([1]) * 64
    d2 = _disk(tmp_path)
    assert d2.scan() == [K(0), K(1), K(2)]
    assert d2.read_block(K(2), d2.index[K(2)]) == bytes([2]) * 64
    other = DiskTier(tmp_path, 8 * (REC_HDR_SIZE + 64), 64, fingerprint=b"model-B")
    assert other.scan() == []  # another model's blocks are never served


def test_disk_detects_corrupt_and_truncated_blocks(tmp_path) -> None:
    d = _disk(tmp_path)
    for i in range(2):
        loc, _, _ = d.reserve(K(i))
        d.write_block(K(i), loc, bytes([7]) * 64)
        d.commit(K(i), True)
    path = d.path(0)
    with open(path, "r+b") as f:  # flip a payload byte of block 0
        f.seek(FILE_HDR_SIZE + REC_HDR_SIZE + 5)
        f.write(b"\xff")
    assert d.read_block(K(0), d.index[K(0)]) is None
    os.truncate(path, os.path.getsize(path) - 10)  # a killed writer: block 1 torn
    d2 = _disk(tmp_path)
    assert d2.scan() == [K(0)] and d2.corrupt_at_scan == 1


def test_disk_evicts_oldest_segment_and_disables_on_error(tmp_path) -> None:
    d = _disk(tmp_path, cap_blocks=4)  # 4 segments of 1 block
    evicted_all = []
    for i in range(6):
        loc, ev, dead = d.reserve(K(i))
        evicted_all += ev
        d.write_block(K(i), loc, b"\0" * 64)
        d.commit(K(i), True)
        if dead is not None:
            d.delete_segment(dead)
    assert evicted_all == [K(0), K(1)] and len(d.segments) == d.max_segments
    d.disable("disk full")
    assert d.reserve(K(99)) == (None, [], None) and d.contains(K(5))


def test_restore_estimator_prefers_the_faster_path() -> None:
    est = RestoreEstimator(cpu_bw=1e9)
    assert est.recompute_s(1000) == float("inf")  # unmeasured: restore
    est.observe_prefill(1000, 1.0)
    assert est.restore_s({"cpu": 10**6}) < est.recompute_s(1000)
    est.observe_transfer("cpu", 10**6, 10.0)  # a very slow measured transfer
    est.bw["cpu"] = 1e5
    assert est.restore_s({"cpu": 10**6}) > est.recompute_s(1000)


def test_session_policy_sub_agents_keep_main_live_then_go_stale_globally() -> None:
    now = [0.0]
    p = SessionPolicy(ttl=1000.0, clock=lambda: now[0])
    p.on_request("B", [K(20), K(21)], now=0.5)
    for pos in range(2):
        p.insert(K(20 + pos), BlockInfo("B", pos))
    p.on_finish("B", now=0.6)
    main, subs = [K(0), K(1), K(2)], [K(50), K(51)]
    p.on_request("A", main, now=1.0)  # A's first request: its root is the main agent
    for pos, k in enumerate(main):
        p.insert(k, BlockInfo("A", pos))
    p.on_finish("A", now=2.0)
    p.on_request("A", subs, now=3.0)  # a sub-agent under its own prompt
    for pos, k in enumerate(subs):
        p.insert(k, BlockInfo("A", pos))
    p.on_finish("A", now=4.0)
    # The paused main agent is not made stale by its own sub-agent: B (idle longest) goes.
    assert p.victim(never) == K(21)
    # The main agent resumes (the group has returned): the sub-agent's blocks are stale and
    # go before paused B's live chain, although A is now the most recent session.
    p.on_request("A", [*main, K(3)], now=7.0)
    p.on_finish("A", now=8.0)
    order = []
    for _ in range(3):
        k = p.victim(never)
        order.append(k)
        p.remove(k)
    assert order == [K(51), K(50), K(21)]


def test_cpu_tier_memory_is_faulted_in_at_startup() -> None:
    """The tier's pages are resident once it exists (as pinned memory is), so stores do not
    pay a page fault per 4 KiB on the copy path: writing the whole tier afterwards takes
    (almost) no page faults. (Counted as faults, not as RSS growth: RSS stays flat when the
    allocator hands back memory an earlier test already faulted in, as in a full run.)"""
    tier = CPUTier(256, (2, 4, 64, 2, 64), torch.float32, LRUPolicy())  # 256 slots x 256 KiB
    assert tier.buf.nbytes == 64 << 20
    # The fill runs on this thread alone and only this thread's faults are counted: the
    # process-wide count also took other threads' faults (a server or pool thread an earlier
    # test left running) and failed once in a long run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        tier.buf.fill_(1.0)  # what stores do, slot by slot
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    finally:
        torch.set_num_threads(threads)
    assert faults <= 8, faults  # never-touched: 16,384 (4 KiB pages) or 32 (2 MiB pages)
