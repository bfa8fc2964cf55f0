"""Where restored bytes go: every restored block classified (`TierStats.restore_*`).

A restored block is `used` by the request that asked for it, or wasted as `repeat`
(restored twice for one request), `device_held` (the device still had it), `aborted` or
`failed`; used blocks whose request is preempted before its first token are counted
apart, and each restore is bucketed by size and by how long before the device had
evicted its blocks. With ``AGENTSERVE_KV_TRACE=FILE`` the admissions, evictions and
request ends are also written as JSONL, for offline replays of eviction orders
(`benchmarks/kvtier_sessions.py --kv-trace`).

Engine-core thread only, like the connector that owns it.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentserve.kv.offload.connector import RestorePlan, TierSeq
    from agentserve.kv.offload.tiers import TierStats

_AGE_WINDOW_S = 60.0  # device evictions older than this (or never seen) read "older"
_MAX_AGES = 200_000


class RestoreAudit:
    """Per-request restore bookkeeping; all state is dropped when the request ends."""

    def __init__(self, stats: TierStats, session: Callable[[Any], str | None]) -> None:
        self.stats = stats
        self.session = session
        self._restored: dict[str, set[Any]] = {}  # keys restored per live request
        self._unproven: dict[str, int] = {}  # used blocks not yet past the first token
        self._evicted_at: OrderedDict[bytes, float] = OrderedDict()
        path = os.environ.get("AGENTSERVE_KV_TRACE")
        self._trace = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    # ---- events -------------------------------------------------------------------
    def on_device_evict(self, h: bytes) -> None:
        now = time.monotonic()
        ages = self._evicted_at
        ages[h] = now
        ages.move_to_end(h)
        while ages and (now - next(iter(ages.values())) > _AGE_WINDOW_S
                        or len(ages) > _MAX_AGES):
            ages.popitem(last=False)
        if self._trace is not None:
            self._trace.write(f'{{"ev":"evict","t":{now:.4f},"h":"{h.hex()[:16]}"}}\n')

    def account(self, seq: TierSeq, plan: RestorePlan, ok: bool, admitted: bool) -> None:
        """Classify a finished restore's blocks into ``TierStats.restore_outcome``."""
        out, n = self.stats.restore_outcome, len(plan.keys)
        if not ok:
            out["failed"] += n
            return
        if not admitted:
            out["aborted"] += n
            return
        seen = self._restored.setdefault(seq.request_id, set())
        used = 0
        for key, held in zip(plan.keys, plan.held):
            cls = "device_held" if held else "repeat" if key in seen else "used"
            out[cls] += 1
            used += cls == "used"
            seen.add(key)
            at = self._evicted_at.get(key)
            age = None if at is None else plan.started - at
            self.stats.restore_device_age[
                "older" if age is None or age >= _AGE_WINDOW_S else "<2s" if age < 2
                else "2-10s" if age < 10 else "10-60s"] += 1
        self._unproven[seq.request_id] = self._unproven.get(seq.request_id, 0) + used
        self.stats.restore_sizes["1" if n == 1 else "2-3" if n < 4 else "4-7" if n < 8
                                 else "8-15" if n < 16 else "16+"] += 1

    def on_first_token(self, seq: TierSeq) -> None:
        self._unproven.pop(seq.request_id, None)

    def on_preempt(self, seq: TierSeq) -> None:
        self.stats.restore_preempted_blocks += self._unproven.pop(seq.request_id, 0)

    def forget(self, rid: str) -> None:
        """The request ended."""
        self._restored.pop(rid, None)
        self._unproven.pop(rid, None)
        self.trace("finish", rid)

    # ---- debug trace --------------------------------------------------------------
    def trace(self, ev: str, rid: str) -> None:
        if self._trace is not None:
            self._trace.write(f'{{"ev":"{ev}","t":{time.monotonic():.4f},"rid":"{rid}"}}\n')

    def trace_admit(self, seq: TierSeq, device_blocks: int, restore_blocks: int) -> None:
        """One line per admission from the queue."""
        if self._trace is None:
            return
        self._trace.write(json.dumps({
            "ev": "admit", "t": round(time.monotonic(), 4), "rid": seq.request_id,
            "sid": self.session(seq), "dev": device_blocks, "res": restore_blocks,
            "n": len(seq.token_ids), "h": [h.hex()[:16] for h in seq.block_hashes]}) + "\n")
