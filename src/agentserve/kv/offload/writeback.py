"""Write-back offload (``--kv-store-on evict``): the CPU tier receives what the device evicts.

Under ``fill`` (write-through, as vLLM's offloading connector and LMCache do it) each block
is copied to the CPU tier as it fills. The tier's newest content then mirrors what the
device still holds, and what it loses first (its oldest blocks) is exactly what the device
already lost: a tier smaller than the device serves nothing, and a larger one serves only
its excess over the device. Under ``evict`` the tier is a *victim cache*: it receives the
blocks the device drops, when it drops them, so the two hold disjoint blocks and their
capacities add up. Blocks that are never evicted are never copied.

The copy must read a block before anything overwrites it. ``BlockPool.allocate`` calls
``on_evict_blocks`` with the blocks it evicted before it hands them to anyone (a prefill,
a restore, a P/D pull), and the copy is issued right there, on the engine-core thread:
on CPU it is done when the call returns; on CUDA it is enqueued on the compute stream,
so it runs before every kernel enqueued later, and a restore's side stream waits on an
event recorded after it. The store then completes as any other (``_store_done``) once
the ``kv-store`` thread has seen that event. The price: the copy is on the step's path
(on CUDA, on the compute stream) instead of overlapping it, and only for evicted blocks.

Which blocks qualify is decided at fill time (``remember``, called by ``offer``: the
store threshold, the session and chain position the retention policy needs, the external
hashes for the CPU tier's events). With offload blocks of ``k`` device blocks, the first
member the device evicts stores the whole group while its other members are still cached;
a group whose members have already gone is counted in ``stores_skipped``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentserve.kv.hashing import BlockHash
from agentserve.kv.offload.policies import BlockInfo, Key

if TYPE_CHECKING:
    from agentserve.kv.offload.connector import TierConnector

log = logging.getLogger("agentserve.kv.offload.tiers")


@dataclass(slots=True)
class _Group:
    info: BlockInfo
    ext: list[int | bytes]
    members: list[BlockHash]  # the k device-block hashes, in chain order


class EvictionStore:
    """Fill-time bookkeeping and the pool's eviction hook for ``--kv-store-on evict``."""

    def __init__(self, conn: TierConnector, max_groups: int) -> None:
        self.conn = conn
        self.max_groups = max(1, max_groups)
        self._groups: OrderedDict[Key, _Group] = OrderedDict()
        self._member: dict[BlockHash, Key] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def remember(self, key: Key, info: BlockInfo, ext: list[int | bytes],
                 members: list[BlockHash]) -> None:
        """``key``'s group filled on the device: store it there when the device evicts it."""
        if key in self._groups:
            self._groups.move_to_end(key)
            return
        self._groups[key] = _Group(info, ext, members)
        for h in members:
            self._member[h] = key
        # Bounded: a group whose blocks the pool cached under another block (the same
        # content computed twice) is never evicted by that hash; forget the oldest.
        while len(self._groups) > self.max_groups:
            self._forget(next(iter(self._groups)))

    def _forget(self, key: Key) -> _Group | None:
        g = self._groups.pop(key, None)
        if g is not None:
            for h in g.members:
                if self._member.get(h) == key:
                    del self._member[h]
        return g

    def flush(self, timeout: float) -> int:
        """At shutdown, with a disk tier: store what the device still holds, so a restart
        serves it (a write-back cache's flush). Oldest groups first, in batches of half the
        CPU tier, each stored and written to disk before the next (disk writes pin their CPU
        slots); stops at ``timeout``. Core thread stopped. Returns the groups flushed."""
        disk = self.conn.mgr.disk
        if disk is None or not disk.writable:
            return 0
        deadline = time.monotonic() + timeout
        batch = max(1, self.conn.mgr.cpu.num_slots // 2)
        cached, flushed = self.conn.pool.cached, 0
        while self._groups and time.monotonic() < deadline:
            # as if the device evicted each group's last block: _store reads the rest from
            # the prefix map and skips a group part of which is gone
            held = []
            for k in list(self._groups)[:batch]:
                last = cached.get(self._groups[k].members[-1])
                if last is None:
                    self._forget(k)
                else:
                    held.append((last.block_hash, last.block_id))
            self._store(held)
            self.conn.drain(max(0.0, deadline - time.monotonic()))
            flushed += len(held)
        if self._groups:
            log.warning("write-back flush: %d offload blocks not written to disk in time",
                        len(self._groups))
        return flushed

    def on_evict_blocks(self, evicted: list[tuple[BlockHash, int]]) -> None:
        """Pool hook: copy the evicted blocks' groups to the CPU tier now (never raises)."""
        try:
            self._store(evicted)
        except Exception:  # noqa: BLE001 - a failed offload must not fail the allocation
            log.exception("write-back KV store failed; those blocks are recomputed if needed")
            self.conn.stats.stores_skipped += 1

    def _store(self, evicted: list[tuple[BlockHash, int]]) -> None:
        now = dict(evicted)  # evicted by this allocation: hash -> block id, still intact
        cached = self.conn.pool.cached
        keys, groups, ids = [], [], []
        for h, _ in evicted:
            key = self._member.get(h)
            if key is None:
                continue
            g = self._forget(key)
            assert g is not None
            members: list[int] = []
            for m in g.members:
                bid = now.get(m)
                if bid is None:
                    block = cached.get(m)
                    if block is None:
                        break
                    bid = block.block_id
                members.append(bid)
            if len(members) < len(g.members):
                self.conn.stats.stores_skipped += 1  # part of the group is gone already
                continue
            keys.append(key)
            groups.append(g)
            ids.append(members)
        if not keys:
            return
        mgr, worker = self.conn.mgr, self.conn.worker
        infos = [g.info for g in groups]
        to_store, _ = mgr.prepare_store(keys, infos, [g.ext for g in groups])
        if not to_store:
            return
        pos = {k: i for i, k in enumerate(keys)}
        idx = [pos[k] for k, _ in to_store]
        slots = [s for _, s in to_store]
        # In chunks of the worker's staging size: a long allocation (a restore, a pull)
        # may evict many blocks, and each chunk's gathered copy is a temporary.
        per = max(1, worker.stage_bytes // mgr.cpu.block_bytes)
        ctx = ([keys[i] for i in idx], [infos[i] for i in idx], [])
        try:
            for c in range(0, len(idx), per):
                worker.device_to_host(mgr.cpu.buf, slots[c:c + per],
                                      [ids[i] for i in idx[c:c + per]])
        except Exception as exc:  # noqa: BLE001 - releases the reserved slots, logs, counts
            self.conn.store_done(ctx, exc)
            return
        # Nothing left to copy: the job only orders completion after the copies (CUDA event).
        worker.submit("store", "store", ctx, lambda: None)
