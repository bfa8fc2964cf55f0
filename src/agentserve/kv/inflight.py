"""Prompt blocks that running requests are computing right now (in-flight prefix sharing).

A sub-agent group starts its requests together, and their prompts share a head (the
group's system prompt and tools, 6-10K tokens in production traces) that is not cached the
first time. Admitted together, each request would compute that head itself: the same
prefill n times, each at 1/n of the step budget. Instead, a waiting request whose next
uncached blocks a running request is computing (same chained block hashes: the same
prefix) is parked until that request has computed them; it then hits them in the prefix
cache and computes only its own part. SGLang does the like for requests that share a
prefix within one batch; here it also covers a request that arrives while the first is
mid-prefill (a long head takes several chunked steps).

Only a shared run of at least ``MIN_JOIN_BLOCKS`` blocks is worth a wait. A parked request
is released as soon as its leader has computed the shared blocks, or is no longer computing
(finished, preempted, failed): it then computes whatever is still missing.

One class, two clocks: the engine's scheduler (``engine/core/scheduler.py``, its sequences)
and the simulator's aggregated engines (``sim/agg.py``, its requests) both use it, over
anything that has the four attributes of ``Prefilling``; each says what "still computing"
means for its requests (``computing``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

MIN_JOIN_BLOCKS = 4  # 64 tokens at block size 16: less is cheaper to compute than to wait for


class Prefilling(Protocol):
    """What in-flight sharing reads of a request."""

    @property
    def request_id(self) -> Hashable: ...  # unique while the request lives

    @property
    def block_hashes(self) -> Sequence[Hashable]: ...  # its prompt's chained block hashes

    @property
    def num_tokens(self) -> int: ...  # tokens it computes KV for (its prompt, at least)

    @property
    def num_computed_tokens(self) -> int: ...  # of which computed so far


R = TypeVar("R", bound=Prefilling)


class InflightPrefill(Generic[R]):
    """Block hash -> the running request computing that block (one thread only).

    ``computing(request)``: the request is still in the running set (the engine: its status
    is RUNNING). ``min_blocks``: the shortest shared run worth a wait, in this class's blocks
    (``MIN_JOIN_BLOCKS`` unless the caller's blocks are not the engine's)."""

    def __init__(self, block_size: int, computing: Callable[[R], bool],
                 min_blocks: int = MIN_JOIN_BLOCKS) -> None:
        self.bs = block_size
        self.computing = computing
        self.min_blocks = min_blocks
        self.owner: dict[Hashable, Hashable] = {}
        self._seqs: dict[Hashable, tuple[R, Sequence[Hashable], int]] = {}  # rid -> (seq, keys, end)

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seq: R, first_block: int) -> None:
        """``seq`` was admitted to compute its full blocks from ``first_block`` on."""
        hashes = seq.block_hashes
        end = min(len(hashes), seq.num_tokens // self.bs)
        if end - first_block < self.min_blocks:
            return
        keys = hashes[first_block:end]
        rid = seq.request_id
        self._seqs[rid] = (seq, keys, end * self.bs)
        owner = self.owner
        for h in keys:
            owner.setdefault(h, rid)

    def drop(self, request_id: Hashable) -> None:
        entry = self._seqs.pop(request_id, None)
        if entry is None:
            return
        owner = self.owner
        for h in entry[1]:
            if owner.get(h) == request_id:
                del owner[h]

    def prune(self) -> None:
        """Forget requests that computed all their registered blocks or stopped computing."""
        for rid, (seq, _, end) in list(self._seqs.items()):
            if not self.computing(seq) or seq.num_computed_tokens >= end:
                self.drop(rid)

    def joins(self, seq: R, device_hit: int) -> tuple[Hashable, int] | None:
        """(leader request id, tokens the leader must have computed) when the blocks right
        past ``seq``'s ``device_hit`` blocks are being computed by one running request."""
        if not self.owner:
            return None
        hashes, me, get = seq.block_hashes, seq.request_id, self.owner.get
        end = min(len(hashes), (seq.num_tokens - 1) // self.bs)
        rid, n = None, 0
        for i in range(device_hit, end):
            owner = get(hashes[i])
            if owner is None or owner == me or rid not in (None, owner):
                break
            rid, n = owner, n + 1
        if rid is None or n < self.min_blocks:
            return None
        return rid, (device_hit + n) * self.bs

    def ready(self, leader: Hashable, need_tokens: int) -> bool:
        """The leader has computed ``need_tokens`` tokens, or is no longer computing."""
        entry = self._seqs.get(leader)
        if entry is None:
            return True
        seq = entry[0]
        return not self.computing(seq) or seq.num_computed_tokens >= need_tokens
