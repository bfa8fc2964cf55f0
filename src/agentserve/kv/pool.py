"""Paged KV block pool with refcounts, an O(1) LRU free queue and a prefix map.

Same model as vLLM v1's BlockPool (vllm/v1/core/block_pool.py), minus its null block
and KV-cache groups: every block in ``range(num_blocks)`` is usable, one block per hash.

A block is *used* (ref_cnt > 0) or *free* (ref_cnt == 0, in the free queue). A free
block may still hold a hash: it stays matchable until ``allocate`` pops it, which is
when it is evicted. Eviction order is the free queue order, head first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentserve.kv.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    KVEventQueue,
    block_stored,
)
from agentserve.kv.hashing import BlockHash, to_external


def _short(h: object) -> str:
    """A hash for an error message: the first 16 hex digits of a digest, or an int as is
    (the simulator's pools key blocks by ints)."""
    return f"{h.hex()[:16]}..." if isinstance(h, bytes) else repr(h)


@dataclass(slots=True, eq=False)
class Block:
    """One KV block's metadata; ``prev``/``next`` link it into the free queue."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class NoFreeBlocks(RuntimeError):
    """``allocate`` was asked for more blocks than are free; call ``can_allocate`` first."""


class FreeBlockQueue:
    """Doubly linked list of free blocks; head is evicted first. All ops O(1) per block.

    Sentinels at both ends mean a block is queued iff its ``prev`` is not None.
    """

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Sequence[Block] = ()) -> None:
        self._head, self._tail = Block(-1), Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None, "free queue link broken"
            yield node
            node = node.next

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail or block is None:
            raise NoFreeBlocks("free block queue is empty")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1

    def append(self, block: Block) -> None:
        self._insert_before(self._tail, block)

    def appendleft(self, block: Block) -> None:
        assert self._head.next is not None
        self._insert_before(self._head.next, block)

    def _insert_before(self, node: Block, block: Block) -> None:
        if block.prev is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        prev = node.prev
        assert prev is not None
        prev.next, block.prev, block.next, node.prev = block, prev, node, block
        self._len += 1


class BlockPool:
    """Blocks, refcounts, prefix map and event emission for one KV medium.

    Check-then-mutate: callers call ``can_allocate`` before ``allocate``. Events go to
    ``events`` (if given) and are drained by the engine once per step.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventQueue | None = None,
        medium: str = MEDIUM_GPU,
        int_hashes: bool | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching, self.events, self.medium = enable_caching, events, medium
        self.int_hashes = int_hashes  # None: vLLM's env default (ints)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        # Called with each hash the device evicts (the offload tiers account restores by
        # how recently the device dropped a block); None: nobody listens.
        self.on_evict: Callable[[BlockHash], None] | None = None
        # Called once per ``allocate`` with the (hash, block id) of every block it evicted,
        # before anyone receives the blocks: the last moment their contents can be read
        # (write-back offload, kv/offload/writeback.py). None: nobody listens.
        self.on_evict_blocks: Callable[[list[tuple[BlockHash, int]]], None] | None = None

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including cached-but-free ones (they are evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Used fraction, as ``vllm:kv_cache_usage_perc`` (cached-but-free counts as free)."""
        return self.num_used_blocks / self.num_blocks

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[Block]:
        """Blocks of the longest cached prefix of ``hashes``; takes no references."""
        if not self.enable_caching:
            return []
        out: list[Block] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # -- mutations ---------------------------------------------------------------
    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on each block; a free (cache-hit) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the free-queue head (ref_cnt 1), evicting cached ones."""
        if n > len(self.free_queue):
            raise NoFreeBlocks(
                f"asked for {n} KV blocks but only {len(self.free_queue)} of {self.num_blocks} "
                "are free; check can_allocate() first, then preempt or wait"
            )
        out = [self.free_queue.popleft() for _ in range(n)]
        evicted: list[tuple[BlockHash, int]] = []
        for block in out:
            if block.block_hash is not None:
                h = self._evict(block)
                if h is not None:
                    evicted.append((h, block.block_id))
            block.ref_cnt = 1
        if evicted and self.on_evict_blocks is not None:
            self.on_evict_blocks(evicted)
        return out

    def _evict(self, block: Block) -> BlockHash | None:
        """Drop ``block``'s hash; returns it if the prefix map pointed at this block."""
        h = block.block_hash
        assert h is not None
        block.block_hash = None
        if self.cached.get(h) is not block:
            return None
        del self.cached[h]
        if self.on_evict is not None:
            self.on_evict(h)
        if self.events is not None:
            self.events.append(BlockRemoved([self._ext(h)], self.medium, group_idx=0))
        return h

    def cache_blocks(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        first_block_index: int,
        parent: BlockHash | None,
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
        session_id: str | None = None,
    ) -> None:
        """Mark newly full blocks as cached and queue BlockStored for them.

        ``blocks[i]``/``hashes[i]`` is block ``first_block_index + i`` of the request;
        ``token_ids`` is either exactly these blocks' tokens or the request's whole token
        list; ``parent`` is the hash of block ``first_block_index - 1`` (None for block 0).
        A hash already mapped to another block (same content computed twice) keeps that
        mapping: this block stays uncached and is not reported. One event per contiguous
        run of newly cached blocks (exactly one in the normal case), so each event's
        ``token_ids`` always match its ``block_hashes``.
        """
        tok_base = self._check_cache_args(blocks, hashes, token_ids, first_block_index)
        if not blocks or not self.enable_caching:
            return
        run: list[int] = []  # indexes into blocks of the current run
        for i, (block, h) in enumerate(zip(blocks, hashes)):
            if self._cache_one(block, h):
                run.append(i)
                continue
            self._emit_stored(run, hashes, token_ids, tok_base, parent, extra_keys, session_id)
            run = []
        self._emit_stored(run, hashes, token_ids, tok_base, parent, extra_keys, session_id)

    def _check_cache_args(self, blocks: Sequence[Block], hashes: Sequence[BlockHash],
                          token_ids: Sequence[int], first_block_index: int) -> int:
        """Validate `cache_blocks`' arguments; the index of `blocks[0]`'s first token in
        `token_ids` (0 when they are these blocks' tokens alone, else the request's)."""
        if len(blocks) != len(hashes):
            raise ValueError(f"cache_blocks: {len(blocks)} blocks but {len(hashes)} hashes")
        n, bs = len(blocks), self.block_size
        # Only these blocks' tokens, or the whole request: unambiguous by length.
        tok_base = 0 if len(token_ids) == n * bs else first_block_index
        if n and len(token_ids) < (tok_base + n) * bs:
            raise ValueError(
                f"cache_blocks: blocks {first_block_index}..{first_block_index + n - 1} need "
                f"{n * bs} tokens of their own or {(first_block_index + n) * bs} of the whole "
                f"request, got {len(token_ids)}"
            )
        return tok_base

    def _cache_one(self, block: Block, h: BlockHash) -> bool:
        """Map ``h`` to ``block``; False if nothing new was cached."""
        if block.ref_cnt <= 0:
            raise ValueError(
                f"cache_blocks: block {block.block_id} is free; cache blocks before freeing them"
            )
        if block.block_hash is not None:
            if block.block_hash != h:
                raise ValueError(
                    f"block {block.block_id} already holds hash {_short(block.block_hash)}, "
                    f"cannot re-cache it as {_short(h)}"
                )
            return False  # a prefix hit passed back in: already cached and reported
        if h in self.cached:
            return False
        block.block_hash = h
        self.cached[h] = block
        return True

    def _emit_stored(
        self,
        run: list[int],
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        tok_base: int,
        parent: BlockHash | None,
        extra_keys: Sequence[tuple[Any, ...] | None] | None,
        session_id: str | None,
    ) -> None:
        if not run or self.events is None:
            return
        i0, bs = run[0], self.block_size
        prev = parent if i0 == 0 else hashes[i0 - 1]
        start, end = (tok_base + i0) * bs, (tok_base + run[-1] + 1) * bs
        self.events.append(
            block_stored(
                [self._ext(hashes[i]) for i in run],
                None if prev is None else self._ext(prev),
                list(token_ids[start:end]),
                bs,
                self.medium,
                None if extra_keys is None else [extra_keys[i] for i in run],
                session_id,
            )
        )

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference per block, given in eviction-priority order (first = first out).

        As vLLM 0.32 (block_pool.py:774-805): freed blocks without a hash go to the queue
        *head* (reused first, nothing to lose), cached ones to the tail (LRU). vLLM frees a
        request's blocks in reverse so the tail of its chain is evicted first.
        """
        uncached: list[Block] = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(
                    f"double free of KV block {block.block_id} (ref_cnt {block.ref_cnt})"
                )
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_queue.append(block)
        for block in reversed(uncached):  # keep their given order at the head
            self.free_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def _ext(self, h: BlockHash) -> int | bytes:
        return to_external(h, self.int_hashes)

    # -- debugging ---------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant (tests, debug mode)."""
        queued: set[int] = set()
        for n, block in enumerate(self.free_queue):
            assert n < self.num_blocks, "free queue has a cycle or foreign blocks"
            assert block.ref_cnt == 0, (
                f"block {block.block_id} is queued as free with ref_cnt {block.ref_cnt}"
            )
            assert block.block_id not in queued, f"block {block.block_id} queued twice"
            assert self.blocks[block.block_id] is block, (
                f"foreign block {block.block_id} in free queue"
            )
            queued.add(block.block_id)
        assert len(queued) == len(self.free_queue), (
            f"free queue length {len(self.free_queue)} != {len(queued)} linked blocks"
        )
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_q = block.block_id in queued
            assert in_q == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{'in' if in_q else 'not in'} the free queue"
            )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"block {block.block_id} holds a hash the prefix map does not point at it for"
                )
        for h, block in self.cached.items():
            assert block.block_hash == h, (
                f"prefix map entry points at block {block.block_id}, which holds another hash"
            )
        used = sum(b.ref_cnt > 0 for b in self.blocks)
        assert used == self.num_used_blocks and used + len(queued) == self.num_blocks, (
            f"used {used} + free {len(queued)} != {self.num_blocks} blocks"
        )
