import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentserve.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventQueue,
    encode_event_batch,
)
from agentserve.kv.hashing import BlockHasher, to_external
from agentserve.kv.pool import Block, BlockPool, FreeBlockQueue, LazyBlockPool, NoFreeBlocks
from tests.kv.conftest import VECTORS

BS = 4


def make(n=8, **kw):
    q = KVEventQueue()
    return BlockPool(n, BS, events=q, **kw), q


def run_request(pool, hasher, toks):
    """Allocate + cache all full blocks of toks the way the engine does; returns blocks."""
    hashes = hasher.hash_blocks(toks)
    hit = pool.match_prefix(hashes)
    pool.touch(hit)
    new = pool.allocate(-(-len(toks) // BS) - len(hit))
    blocks = hit + new
    pool.cache_blocks(new[: len(hashes) - len(hit)], hashes[len(hit):], toks, len(hit),
                      hashes[len(hit) - 1] if hit else None)
    return blocks, hashes


def test_free_queue_ops():
    blocks = [Block(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3] and len(q) == 3
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 1, 3, 0]
    with pytest.raises(ValueError):
        q.append(blocks[1])
    for _ in range(4):
        q.popleft()
    with pytest.raises(NoFreeBlocks):
        q.popleft()


def test_lru_reuse_and_eviction_order():
    pool, q = make(6)
    h = BlockHasher(block_size=BS, seed="0")
    a, ha = run_request(pool, h, list(range(8)))          # 2 full blocks
    b, hb = run_request(pool, h, list(range(100, 108)))   # 2 full blocks
    pool.free(list(reversed(a)))
    pool.free(list(reversed(b)))
    pool.check_invariants()
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 4 and pool.usage == 0
    # cached-free blocks are still matchable, and a hit takes them back
    assert pool.match_prefix(ha) == a
    again, _ = run_request(pool, h, list(range(8)))
    assert again == a and pool.num_used_blocks == 2
    pool.free(list(reversed(again)))
    q.take()
    # 2 never-used blocks go first, then the oldest freed cached block: b's tail
    got = pool.allocate(3)
    assert got[2] is b[1]
    assert q.take() == [BlockRemoved([to_external(hb[1])], "GPU", group_idx=0)]
    assert pool.match_prefix(hb) == [b[0]]
    pool.check_invariants()


def test_uncached_freed_blocks_are_reused_first():
    pool, _ = make(4)
    x = pool.allocate(2)
    pool.free(x)
    assert pool.allocate(2) == x  # vLLM: uncached blocks go to the queue head


def test_events_order_and_shape():
    pool, q = make(4)
    h = BlockHasher(block_size=BS, seed="0")
    toks = list(range(10))
    blocks, hashes = run_request(pool, h, toks)
    [ev] = q.take()
    assert ev == BlockStored(
        [to_external(x) for x in hashes], None, toks[:8], BS, None, "GPU", None,
        extra_keys=[None, None], group_idx=0,
    )
    # decode grows the request: the third block fills and is cached with its parent
    toks += [10, 11]
    h3 = h.hash_blocks(toks)[2]
    pool.cache_blocks([blocks[2]], [h3], toks, 2, hashes[1])
    [ev] = q.take()
    assert ev.parent_block_hash == to_external(hashes[1]) and ev.token_ids == [8, 9, 10, 11]
    # same call with only the block's own tokens (what KVCacheManager passes)
    pool2, q2 = make(4)
    b2 = pool2.allocate(3)
    pool2.cache_blocks(b2[:2], hashes, toks[:8], 0, None)
    pool2.cache_blocks([b2[2]], [h3], toks[8:12], 2, hashes[1])
    assert q2.take()[1] == ev
    with pytest.raises(ValueError, match="need 4 tokens of their own or 12"):
        pool2.cache_blocks([b2[2]], [h3], toks[:7], 2, hashes[1])
    pool.free(list(reversed(blocks)))
    assert pool.reset_prefix_cache()
    assert q.take() == [AllBlocksCleared()] and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_reset_refused_while_in_use_and_errors():
    pool, q = make(2)
    blocks = pool.allocate(1)
    assert not pool.reset_prefix_cache() and len(q) == 0
    with pytest.raises(NoFreeBlocks, match="only 1 of 2"):
        pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks)
    with pytest.raises(ValueError, match="is free"):
        pool.cache_blocks(blocks, [b"h" * 32], list(range(4)), 0, None)


def test_duplicate_content_keeps_first_mapping():
    pool, q = make(6)
    h = BlockHasher(block_size=BS, seed="0")
    toks = list(range(12))
    hashes = h.hash_blocks(toks)
    first, second = pool.allocate(3), pool.allocate(3)
    pool.cache_blocks(first[:1], hashes[:1], toks, 0, None)
    pool.cache_blocks([first[2]], hashes[2:3], toks, 2, hashes[1])
    q.take()
    pool.cache_blocks(second, hashes, toks, 0, None)  # block 0 and 2 already cached elsewhere
    [ev] = q.take()
    assert ev.block_hashes == [to_external(hashes[1])] and ev.token_ids == toks[4:8]
    assert ev.parent_block_hash == to_external(hashes[0])
    assert second[0].block_hash is None
    assert pool.match_prefix(hashes) == [first[0], second[1], first[2]]
    pool.check_invariants()


def test_same_bytes_as_real_vllm_block_pool():
    """Mirror gen_vllm_vectors.pool_run (vLLM's pool has an extra null block 0)."""
    pool, q = make(3)
    h = BlockHasher(block_size=4, seed="0")
    toks = list(range(100, 109))
    blocks = pool.allocate(3)
    hashes = h.hash_blocks(toks)
    pool.cache_blocks(blocks[:2], hashes, toks, 0, None)
    pool.free(list(reversed(blocks)))
    pool.allocate(2)
    payload = encode_event_batch(KVEventBatch(2.5, q.take(), 0))
    assert payload.hex() == VECTORS["events"]["pool_run"]


def test_caching_disabled():
    pool, q = make(2, enable_caching=False)
    b = pool.allocate(1)
    pool.cache_blocks(b, [b"x" * 32], list(range(4)), 0, None)
    assert pool.match_prefix([b"x" * 32]) == [] and len(q) == 0


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / hit / cache / free / reset sequences against the invariants."""

    def __init__(self):
        super().__init__()
        self.pool, self.q = make(10)
        self.hasher = BlockHasher("fast", BS, "0")
        self.reqs: list[tuple[list[Block], list[bytes]]] = []
        self.stored: set = set()  # hashes the event stream says are cached

    @rule(prefix=st.integers(0, 3), n_blocks=st.integers(1, 4), salt=st.integers(0, 2))
    def request(self, prefix, n_blocks, salt):
        toks = [7] * (prefix * BS) + [salt * 1000 + i for i in range(n_blocks * BS)]
        toks = toks[: (prefix + n_blocks) * BS - 1]  # last block partial
        hashes = self.hasher.hash_blocks(toks)
        hit = self.pool.match_prefix(hashes)
        need = -(-len(toks) // BS) - len(hit)
        if not self.pool.can_allocate(need + sum(b.ref_cnt == 0 for b in hit)):
            return
        self.pool.touch(hit)
        new = self.pool.allocate(need)
        k = len(hit)
        self.pool.cache_blocks(new[: len(hashes) - k], hashes[k:], toks, k,
                               hashes[k - 1] if k else None)
        self.reqs.append((hit + new, hashes))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        blocks, _ = self.reqs.pop(i % len(self.reqs))
        self.pool.free(list(reversed(blocks)))

    @rule()
    def reset(self):
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.reqs)

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for ev in self.q.take():  # the event stream mirrors the prefix map
            if isinstance(ev, BlockStored):
                assert not self.stored & set(ev.block_hashes)
                self.stored |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.stored -= set(ev.block_hashes)
            else:
                self.stored.clear()
        assert self.stored == {to_external(h) for h in self.pool.cached}
        used = {b.block_id for blocks, _ in self.reqs for b in blocks}
        assert used == {b.block_id for b in self.pool.blocks if b.ref_cnt > 0}


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_check_invariants_catches_corruption():
    pool, _ = make(3)
    b = pool.allocate(1)[0]
    b.ref_cnt = 0
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_invariants()
    b.ref_cnt = 1
    pool.cached[b"h"] = b
    with pytest.raises(AssertionError, match="another hash"):
        pool.check_invariants()


def test_on_evict_blocks_sees_each_allocations_evictions_before_reuse():
    """The write-back hook: once per allocate, only blocks whose hash the prefix map held,
    with their ids, while those blocks are still free of a new owner's hash."""
    pool, _ = make(4)
    hasher = BlockHasher(block_size=BS)
    calls = []
    pool.on_evict_blocks = lambda ev: calls.append(
        [(h, bid, pool.blocks[bid].block_hash) for h, bid in ev])
    blocks, hashes = run_request(pool, hasher, list(range(8)))  # 2 cached blocks
    pool.free(list(reversed(blocks)))
    assert calls == []  # nothing cached was evicted: the 2 never-used blocks went first
    pool.allocate(2)
    assert calls == []
    pool.allocate(1)  # the chain's tail goes first
    assert calls == [[(hashes[1], blocks[1].block_id, None)]]
    pool.allocate(1)
    assert len(calls) == 2 and calls[1][0][:2] == (hashes[0], blocks[0].block_id)


# -- LazyBlockPool: the same pool, lazily populated, hot paths inlined (the simulator's) ----
# The differential test: random operation sequences on both, every returned block id, the
# prefix map and the free-queue order compared.

def _state(p: BlockPool) -> tuple:
    return ([b.block_id for b in p.free_queue], sorted((h, b.block_id) for h, b in p.cached.items()),
            p.num_free_blocks)


def _replay(seed: int, n_blocks: int = 40, ops: int = 600) -> None:
    rng = random.Random(seed)
    ref, sim = BlockPool(n_blocks, 4), LazyBlockPool(n_blocks, 4)
    held: list[list[int]] = []  # block ids held per live request (same in both pools)
    next_hash = 0
    for _ in range(ops):
        op = rng.random()
        if op < 0.45 and ref.num_free_blocks:
            hashes = [rng.randrange(next_hash + 5) for _ in range(rng.randrange(1, 4))]
            hit_r, hit_s = ref.match_prefix(hashes), sim.match_prefix(hashes)
            assert [b.block_id for b in hit_r] == [b.block_id for b in hit_s]
            need = min(rng.randrange(1, 6), ref.num_free_blocks - sum(b.ref_cnt == 0 for b in hit_r))
            if need <= 0:
                continue
            ref.touch(hit_r)
            sim.touch(hit_s)
            a, b = ref.allocate(need), sim.allocate(need)
            assert [x.block_id for x in a] == [x.block_id for x in b]
            if rng.random() < 0.7:  # cache some of the new blocks, the hits passed back in
                k = rng.randrange(1, need + 1)  # first; some hashes already cached elsewhere
                hs = [h if rng.random() < 0.8 or not ref.cached else rng.choice(list(ref.cached))
                      for h in range(next_hash, next_hash + k)]
                next_hash += k
                hr, hsim = [x.block_hash for x in hit_r], [x.block_hash for x in hit_s]
                ref.cache_blocks(hit_r + a[:k], hr + hs, range((len(hr) + k) * 4), 0, None)
                sim.cache_blocks(hit_s + b[:k], hsim + hs, range((len(hr) + k) * 4), 0, None)
            held.append([x.block_id for x in hit_r + a])
        elif op < 0.55 and ref.cached:  # the CPU tier's refresh: cached blocks to the newest end
            ids = [b.block_id for b in rng.sample(list(ref.cached.values()),
                                                  rng.randrange(1, min(6, len(ref.cached)) + 1))]
            ref.touch([ref.blocks[i] for i in ids])
            ref.free([ref.blocks[i] for i in ids])
            sim.to_newest([sim.blocks[i] for i in ids])
        elif op < 0.62 and ref.cached:  # a session's refresh: queue neighbours, in queue order,
            queue = [b.block_id for b in ref.free_queue]  # mixed with held and repeated blocks
            start, k = rng.randrange(len(queue) or 1), rng.randrange(1, 12)
            ids = [i for i in queue[start:start + k] if ref.blocks[i].block_hash is not None]
            if held and rng.random() < 0.5:
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(rng.choice(held)))
            if ids and rng.random() < 0.2:
                ids.append(ids[0])
            for pool in (ref, sim):
                bs = [pool.blocks[i] for i in ids]
                if pool is sim:
                    sim.to_newest(bs)
                    continue
                for b in bs:  # the engine pool's touch-then-free, a block at a time
                    if b.ref_cnt == 0:
                        ref.touch([b])
                        ref.free([b])
        elif held:
            ids = held.pop(rng.randrange(len(held)))
            ref.free([ref.blocks[i] for i in reversed(ids)])
            sim.free([sim.blocks[i] for i in reversed(ids)])
        assert ref.num_free_blocks == sim.num_free_blocks
    assert _state(ref) == _state(sim)
    sim.check_invariants()


def test_random_sequences_match_the_engine_pool() -> None:
    for seed in range(30):
        _replay(seed)


def test_caching_misuse_raises_as_the_engine_pool_does() -> None:
    """Caching a free block, or re-caching a block under another hash, is refused alike."""
    for pool in (BlockPool(8, 4), LazyBlockPool(8, 4)):
        a = pool.allocate(2)
        pool.cache_blocks(a, [1, 2], range(8), 0, None)
        with pytest.raises(ValueError, match="already holds hash"):
            pool.cache_blocks(a[:1], [3], range(4), 0, None)
        pool.free(a)
        with pytest.raises(ValueError, match="is free"):
            pool.cache_blocks(a[:1], [1], range(4), 0, None)
        with pytest.raises(ValueError, match="2 blocks but 1 hashes"):
            pool.cache_blocks(pool.allocate(2), [5], range(8), 0, None)


def test_lazy_blocks_are_created_on_demand() -> None:
    p = LazyBlockPool(1_000_000, 64)
    assert p.num_free_blocks == 1_000_000 and len(p.blocks) == 0
    got = p.allocate(3)
    assert [b.block_id for b in got] == [0, 1, 2] and len(p.blocks) == 3
    p.free(got)
    assert [b.block_id for b in p.allocate(2)] == [0, 1]  # uncached frees go to the head, in order


def test_one_call_caching_the_same_hash_twice_keeps_the_first_block_as_the_engine_pool() -> None:
    """The C-level path for fresh blocks must not take a call whose hashes repeat."""
    ref, sim = BlockPool(8, 4), LazyBlockPool(8, 4)
    for pool in (ref, sim):
        a = pool.allocate(3)
        pool.cache_blocks(a, [7, 8, 7], range(12), 0, None)
    assert _state(ref) == _state(sim)
    assert sim.cached[7].block_id == 0 and sim.blocks[2].block_hash is None
