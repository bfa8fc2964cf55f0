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
is released as soon as its leader has computed the shared blocks, or leaves ``running``
(finished, preempted, failed): it then computes whatever is still missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentserve.engine.core.status import RequestStatus

if TYPE_CHECKING:  # (torch-free at run time: the simulator imports MIN_JOIN_BLOCKS)
    from agentserve.engine.core.sequence import Sequence

MIN_JOIN_BLOCKS = 4  # 64 tokens at block size 16: less is cheaper to compute than to wait for


class InflightPrefill:
    """Block hash -> the running request computing that block (core thread only)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.owner: dict[bytes, str] = {}
        self._seqs: dict[str, tuple[Sequence, list[bytes], int]] = {}  # rid -> (seq, keys, end)

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seq: Sequence, first_block: int) -> None:
        """``seq`` was admitted to compute its full blocks from ``first_block`` on."""
        end = min(len(seq.block_hashes), seq.num_tokens // self.bs)
        if end - first_block < MIN_JOIN_BLOCKS:
            return
        keys = seq.block_hashes[first_block:end]
        self._seqs[seq.request_id] = (seq, keys, end * self.bs)
        for h in keys:
            self.owner.setdefault(h, seq.request_id)

    def drop(self, request_id: str) -> None:
        entry = self._seqs.pop(request_id, None)
        if entry is None:
            return
        for h in entry[1]:
            if self.owner.get(h) == request_id:
                del self.owner[h]

    def prune(self) -> None:
        """Forget requests that computed all their registered blocks or left ``running``."""
        for rid, (seq, _, end) in list(self._seqs.items()):
            if seq.status != RequestStatus.RUNNING or seq.num_computed_tokens >= end:
                self.drop(rid)

    def joins(self, seq: Sequence, device_hit: int) -> tuple[str, int] | None:
        """(leader request id, tokens the leader must have computed) when the blocks right
        past ``seq``'s ``device_hit`` blocks are being computed by one running request."""
        if not self.owner:
            return None
        end = min(len(seq.block_hashes), (seq.num_tokens - 1) // self.bs)
        rid, n = None, 0
        for i in range(device_hit, end):
            owner = self.owner.get(seq.block_hashes[i])
            if owner is None or owner == seq.request_id or rid not in (None, owner):
                break
            rid, n = owner, n + 1
        if rid is None or n < MIN_JOIN_BLOCKS:
            return None
        return rid, (device_hit + n) * self.bs

    def ready(self, leader: str, need_tokens: int) -> bool:
        """The leader has computed ``need_tokens`` tokens, or is no longer computing."""
        entry = self._seqs.get(leader)
        if entry is None:
            return True
        seq = entry[0]
        return seq.status != RequestStatus.RUNNING or seq.num_computed_tokens >= need_tokens
