"""SimBlockPool behaves exactly as kv.pool.BlockPool on random operation sequences."""

from __future__ import annotations

import random

import pytest

from agentserve.kv.pool import BlockPool
from agentserve.sim.fastpool import SimBlockPool


def _state(p: BlockPool) -> tuple:
    return ([b.block_id for b in p.free_queue], sorted((h, b.block_id) for h, b in p.cached.items()),
            p.num_free_blocks)


def _replay(seed: int, n_blocks: int = 40, ops: int = 600) -> None:
    rng = random.Random(seed)
    ref, sim = BlockPool(n_blocks, 4), SimBlockPool(n_blocks, 4)
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
    for pool in (BlockPool(8, 4), SimBlockPool(8, 4)):
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
    p = SimBlockPool(1_000_000, 64)
    assert p.num_free_blocks == 1_000_000 and len(p.blocks) == 0
    got = p.allocate(3)
    assert [b.block_id for b in got] == [0, 1, 2] and len(p.blocks) == 3
    p.free(got)
    assert [b.block_id for b in p.allocate(2)] == [0, 1]  # uncached frees go to the head, in order


def test_one_call_caching_the_same_hash_twice_keeps_the_first_block_as_the_engine_pool() -> None:
    """The C-level path for fresh blocks must not take a call whose hashes repeat."""
    ref, sim = BlockPool(8, 4), SimBlockPool(8, 4)
    for pool in (ref, sim):
        a = pool.allocate(3)
        pool.cache_blocks(a, [7, 8, 7], range(12), 0, None)
    assert _state(ref) == _state(sim)
    assert sim.cached[7].block_id == 0 and sim.blocks[2].block_hash is None
