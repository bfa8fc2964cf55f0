"""Per-request block tables on top of the shared `BlockPool`.

The scheduler asks three questions, always check-then-mutate:
`get_computed_blocks` (what prefix is already cached?), `allocate_slots`
(can this request grow by N tokens? if so, take the blocks), `free`.
`cache_blocks` registers newly filled blocks so later requests can hit them.

The engine drives this class: it is the one place that decides which blocks an engine
request holds. The simulator does not: its engines (sim/agg.py, sim/pools.py, sim/decode.py)
keep each request's block list themselves, on the same pools (`BlockPool`, `LazyBlockPool`),
because each mirrors its own role's admission rules (vLLM's prefill, decode and aggregated
schedulers); from here it takes `cdiv` only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from agentserve.kv.hashing import BlockHasher
from agentserve.kv.pool import Block, BlockPool


class KVRequest(Protocol):
    """What the manager needs to know about a request."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to their block lists and keeps the pool's prefix map fed."""

    def __init__(self, pool: BlockPool, hasher: BlockHasher, enable_caching: bool = True) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks already registered per request

    def update_hashes(self, req: KVRequest) -> None:
        """Hash the request's newly completed full blocks (each block hashed once)."""
        if self.enable_caching and len(req.block_hashes) < len(req.token_ids) // self.block_size:
            self.hasher.extend(req.block_hashes, req.token_ids)

    def get_computed_blocks(self, req: KVRequest) -> list[Block]:
        """Longest cached prefix of `req`, leaving the last token to be recomputed for logits."""
        if not self.enable_caching:
            return []
        self.update_hashes(req)
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        return self.pool.match_prefix(req.block_hashes[:max_blocks])

    def can_allocate(self, req: KVRequest, num_new_tokens: int, computed: Seq[Block] = ()) -> bool:
        held = len(self.req_blocks.get(req.request_id, ())) + len(computed)
        needed = cdiv(req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens,
                      self.block_size) - held
        # Touching a cached block with no owner takes it out of the free queue.
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        return needed + revived <= self.pool.num_free_blocks

    def allocate_slots(self, req: KVRequest, num_new_tokens: int, computed: Seq[Block] = ()) -> bool:
        """Give `req` room for `num_new_tokens` more tokens (plus the cached `computed` prefix).

        Returns False, changing nothing, when the pool is too small.
        """
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self._num_cached_blocks[req.request_id] = len(blocks)
        total = cdiv(req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens,
                     self.block_size)
        if total > len(blocks):
            blocks.extend(self.pool.allocate(total - len(blocks)))
        return True

    def cache_blocks(self, req: KVRequest) -> None:
        """Register the request's blocks that became full since the last call."""
        if not self.enable_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= done:
            return
        self.update_hashes(req)
        blocks = self.req_blocks[req.request_id]
        bs = self.block_size
        self.pool.cache_blocks(
            blocks[done:num_full],
            req.block_hashes[done:num_full],
            req.token_ids[done * bs:num_full * bs],
            done,
            req.block_hashes[done - 1] if done > 0 else None,
        )
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req: KVRequest) -> None:
        """Release the request's blocks; its tail is evicted first (freed in reverse)."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        return self.pool.usage
