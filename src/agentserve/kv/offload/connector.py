"""The engine's side of the offload tiers: what to store, what to restore, and when.

Called on the engine-core thread only (scheduler and core):

- ``on_add`` / ``on_finish``: session hints for the retention policy;
- ``offer(seq, blocks)`` after blocks fill: groups of ``k`` full device blocks whose hash
  was seen ``store_threshold`` times are reserved in CPU memory and copied there on the
  ``kv-store`` thread; the device blocks hold an extra reference until the copy ends,
  so nobody overwrites them meanwhile. The step never waits for a store. With
  ``--kv-store-on evict`` the groups are only remembered, and stored when the device
  evicts them (``kv/offload/writeback.py``);
- ``plan(seq, device_hit)``: the tier hit beyond the device hit, and whether restoring
  it beats recomputing it (``RestoreEstimator``); ``pin`` pins the sources, ``start_load``
  copies into the request's new device blocks on the ``kv-load`` thread; ``joins`` says
  whether another request's restore in flight already brings back the next blocks (the
  scheduler then parks the request until that restore ends, instead of restoring the
  same bytes a second time);
- ``poll()``: applies finished stores and disk writes, returns finished loads.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from agentserve.kv.hashing import to_external
from agentserve.kv.offload.manager import OffloadManager, Source
from agentserve.kv.offload.policies import BlockInfo, Key
from agentserve.kv.pool import Block, BlockPool
from agentserve.kv.offload.audit import RestoreAudit
from agentserve.kv.offload.tiers import RestoreEstimator, TierConfig
from agentserve.kv.offload.copy import TransferWorker
from agentserve.kv.offload.writeback import EvictionStore

log = logging.getLogger("agentserve.kv.offload.tiers")


class TierSeq(Protocol):
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]
    session_id: str | None


@dataclass(slots=True)
class RestorePlan:
    """Restore device blocks [first_block, first_block + num_blocks) from the tiers."""

    first_block: int
    num_blocks: int
    keys: list[Key]
    tiers: list[str]
    skip: int  # sub-blocks of the first group already on the device
    sources: list[Source] = field(default_factory=list)
    started: float = 0.0
    held: list[bool] = field(default_factory=list)  # device already held the key at start
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class LoadDone:
    request_id: str
    ok: bool
    plan: RestorePlan


class TierConnector:
    """Glue between scheduler/core and ``OffloadManager`` + ``TransferWorker``."""

    def __init__(self, cfg: TierConfig, manager: OffloadManager, worker: TransferWorker,
                 pool: BlockPool, device_block_size: int,
                 estimator: RestoreEstimator | None = None) -> None:
        self.cfg, self.mgr, self.worker, self.pool = cfg, manager, worker, pool
        self.bs = device_block_size
        self.k = (cfg.block_tokens or device_block_size) // device_block_size
        self.est = estimator or RestoreEstimator()
        self.stats = manager.stats
        self._offered: dict[str, int] = {}  # request id -> offload groups already offered
        self._seen: OrderedDict[Key, int] = OrderedDict()  # threshold counts, bounded
        self.loads: dict[str, RestorePlan] = {}
        self._restoring: dict[Key, str] = {}  # group key -> request whose restore brings it
        self._recompute_counted: set[str] = set()  # requests whose recompute was counted
        self.audit = RestoreAudit(self.stats, self.session)
        pool.on_evict = self.audit.on_device_evict
        self.writeback: EvictionStore | None = None
        if cfg.store_on == "evict":  # the tier as a victim cache (kv/offload/writeback.py)
            self.writeback = EvictionStore(self, pool.num_blocks)
            pool.on_evict_blocks = self.writeback.on_evict_blocks

    # ---- hints ------------------------------------------------------------------------
    def group_keys(self, hashes: list[bytes], upto_blocks: int | None = None) -> list[Key]:
        n = len(hashes) if upto_blocks is None else min(upto_blocks, len(hashes))
        return [hashes[(g + 1) * self.k - 1] for g in range(n // self.k)]

    @staticmethod
    def session(seq: TierSeq) -> str | None:
        """The session id, else the chain's first block: one conversation per chain root."""
        if seq.session_id:
            return seq.session_id
        return f"root:{seq.block_hashes[0].hex()[:16]}" if seq.block_hashes else None

    def on_add(self, seq: TierSeq) -> None:
        self.audit.trace("add", seq.request_id)
        self.mgr.cpu.policy.on_request(self.session(seq), self.group_keys(seq.block_hashes))

    def on_finish(self, seq: TierSeq) -> None:
        self._offered.pop(seq.request_id, None)
        self._recompute_counted.discard(seq.request_id)
        self.audit.forget(seq.request_id)
        self.mgr.cpu.policy.on_finish(self.session(seq))

    @property
    def busy(self) -> bool:
        return self.worker.pending > 0

    # ---- store ------------------------------------------------------------------------
    def _passes_threshold(self, key: Key) -> bool:
        if self.cfg.store_threshold <= 1:
            return True
        n = self._seen.pop(key, 0) + 1
        self._seen[key] = n
        if len(self._seen) > 1_000_000:
            self._seen.popitem(last=False)
        return n >= self.cfg.store_threshold

    def offer(self, seq: TierSeq, blocks: list[Block]) -> None:
        """Store the request's offload groups that became full since the last offer."""
        ready = min(seq.num_computed_tokens // self.bs, len(seq.block_hashes)) // self.k
        start = self._offered.get(seq.request_id, 0)
        if ready <= start:
            return
        self._offered[seq.request_id] = ready
        keys, infos, ext, groups = [], [], [], []
        for g in range(start, ready):
            key = seq.block_hashes[(g + 1) * self.k - 1]
            if not self._passes_threshold(key):
                continue
            keys.append(key)
            infos.append(BlockInfo(self.session(seq), g))
            members = seq.block_hashes[g * self.k:(g + 1) * self.k]
            ext.append([to_external(h, self.pool.int_hashes) for h in members])
            groups.append(blocks[g * self.k:(g + 1) * self.k])
            if self.writeback is not None:  # stored when the device evicts it
                self.writeback.remember(key, infos[-1], ext[-1], members)
        if not keys or self.writeback is not None:
            return
        to_store, _ = self.mgr.prepare_store(keys, infos, ext)
        if not to_store:
            return
        pos = {k: i for i, k in enumerate(keys)}
        held = [groups[pos[k]] for k, _ in to_store]
        for g in held:
            self.pool.touch(g)  # keep the device blocks until the copy is done
        slots = [s for _, s in to_store]
        ids = [[b.block_id for b in g] for g in held]
        ctx = ([k for k, _ in to_store], [infos[pos[k]] for k, _ in to_store], held)
        self.worker.submit("store", "store", ctx,
                           lambda: self.worker.device_to_host(self.mgr.cpu.buf, slots, ids))

    def store_done(self, ctx: Any, result: Any) -> None:
        """A store job ended: release its device blocks, commit (or drop) its CPU slots."""
        keys, infos, held = ctx
        # Tails first, as a request frees its own blocks: when the request ended before this
        # copy did, this is where its blocks join the device's LRU queue, and freeing heads
        # first would make the device evict every prefix's head before its tail.
        for g in reversed(held):
            self.pool.free(list(reversed(g)))
        ok = not isinstance(result, Exception)
        if not ok:
            log.warning("KV store to CPU failed: %r", result)
            self.stats.stores_skipped += len(keys)
        for key in self.mgr.complete_store(keys, ok, infos):
            self._write_through(key)

    def _write_through(self, key: Key) -> None:
        disk = self.mgr.disk
        if disk is None or not disk.writable:
            return
        loc, dead = self.mgr.prepare_disk_write(key)
        if dead is not None:
            self.worker.submit("store", "noop", None, lambda: disk.delete_segment(dead))
        if loc is None:
            return
        arr = self.mgr.cpu.buf[self.mgr.cpu.slots[key]].view(torch.uint8).reshape(-1).numpy()
        self.worker.submit("store", "disk", key, lambda: disk.write_block(key, loc, arr))

    # ---- restore ----------------------------------------------------------------------
    def joins(self, seq: TierSeq, device_hit: int) -> tuple[str, int] | None:
        """(request id, groups) when the offload groups right past ``device_hit`` blocks are
        being restored for another request: those keys chain the same prefix, so once that
        restore ends they are device blocks this request hits. Concurrent sub-agents of one
        group share a prefix; without this each would restore it (the same bytes n times)."""
        if not self._restoring or not seq.block_hashes:
            return None
        max_blocks = min((len(seq.token_ids) - 1) // self.bs, len(seq.block_hashes))
        g, n, rid = device_hit // self.k, 0, None
        while (g + 1) * self.k <= max_blocks:
            owner = self._restoring.get(seq.block_hashes[(g + 1) * self.k - 1])
            if owner is None or owner == seq.request_id or rid not in (None, owner):
                break
            rid, g, n = owner, g + 1, n + 1
        return (rid, n) if rid is not None else None

    def plan(self, seq: TierSeq, device_hit: int,
             pull_s: Callable[[int], float] | None = None) -> RestorePlan | None:
        """The tier hit beyond ``device_hit`` blocks, if restoring it is worth it: faster
        than recomputing it, or, for a P/D decode leg (``pull_s``: estimated seconds to
        pull that many tokens from its prefill engine instead), faster than pulling it."""
        max_blocks = min((len(seq.token_ids) - 1) // self.bs, len(seq.block_hashes))
        g0, g_end = device_hit // self.k, max_blocks // self.k
        if g_end <= g0:
            return None
        keys = [seq.block_hashes[(g + 1) * self.k - 1] for g in range(g0, g_end)]
        keys = keys[:self.mgr.lookup(keys)]
        if not keys:
            return None
        tiers = [self.mgr.where(k) or "cpu" for k in keys]
        n = self._choose(tiers, device_hit - g0 * self.k, pull_s)
        if n == 0:
            # Counted once per request (a head that waits is planned again every step);
            # a restore is counted when it starts.
            if seq.request_id not in self._recompute_counted:
                self._recompute_counted.add(seq.request_id)
                self.stats.decisions["recompute" if pull_s is None else "pull"] += 1
            return None
        skip = device_hit - g0 * self.k
        plan = RestorePlan(device_hit, n * self.k - skip, keys[:n], tiers[:n], skip)
        plan.tokens_by_tier = self._tokens_by_tier(plan.tiers, skip)
        return plan

    def _tokens_by_tier(self, tiers: list[str], skip: int) -> dict[str, int]:
        """Tokens a restore of these groups brings from each tier (the first group's
        ``skip`` sub-blocks are on the device already)."""
        out: dict[str, int] = {}
        for i, t in enumerate(tiers):
            out[t] = out.get(t, 0) + (self.k - (skip if i == 0 else 0)) * self.bs
        return out

    def _choose(self, tiers: list[str], skip: int,
                pull_s: Callable[[int], float] | None = None) -> int:
        """How many leading groups to restore: the option with the largest time saving
        over the alternative (recompute, or ``pull_s`` for a P/D decode leg)."""
        mode = self.cfg.restore_mode
        other = self.est.recompute_s if pull_s is None else pull_s
        n_cpu = next((i for i, t in enumerate(tiers) if t != "cpu"), len(tiers))
        best, best_gain, full = 0, 0.0, None
        bb = self.mgr.cpu.block_bytes
        for n in sorted({n_cpu, len(tiers)} - {0}):
            # the first n_cpu groups are in CPU memory, the rest on disk
            nbytes = {"cpu": min(n, n_cpu) * bb, "disk": max(0, n - n_cpu) * bb}
            r, c = self.est.restore_s(nbytes), other((n * self.k - skip) * self.bs)
            full = (r, c)
            if c - r > best_gain or mode == "always":
                best, best_gain = n, c - r
        if full is not None:
            self.stats.last_restore_estimate_s = full[0]
            if pull_s is None:
                self.stats.last_recompute_estimate_s = full[1]
            else:
                self.stats.last_pull_estimate_s = full[1]
        if mode == "never":
            best = 0
        return best

    def pin(self, plan: RestorePlan) -> None:
        """Pin the plan's sources. Before its device blocks are allocated: that allocation
        may evict device blocks into the CPU tier (write-back), which must not evict these."""
        plan.sources = self.mgr.prepare_load(plan.keys)

    def unpin(self, plan: RestorePlan) -> None:
        """Release a pinned plan that will not be loaded (no room on the device)."""
        self.mgr.cancel_load(plan.keys, plan.sources)
        plan.sources = []

    def start_load(self, seq: TierSeq, plan: RestorePlan, block_ids: list[int]) -> None:
        """Copy the pinned sources into ``block_ids`` (the plan's device blocks)."""
        if len(plan.sources) != len(plan.keys):
            raise ValueError("start_load: pin the plan first")
        self.stats.decisions["restore"] += 1
        plan.started = time.monotonic()
        plan.held = [k in self.pool.cached for k in plan.keys]
        self.loads[seq.request_id] = plan
        for key in plan.keys:
            self._restoring.setdefault(key, seq.request_id)
        self.worker.submit("load", "load", seq.request_id,
                           lambda: self._load_job(plan, block_ids))

    def _load_job(self, plan: RestorePlan, block_ids: list[int]) -> list[Key]:
        """Worker thread: copy every source; returns the first key found corrupt, if any.

        A restore is a chain in prefix order, so it stops at a bad block: the blocks before
        it are copied (valid KV for the prefix), the bad one and the rest are not."""
        cpu = self.mgr.cpu
        # copied in groups of at most the worker's staging size, so a long restore from disk
        # holds a bounded amount of read-back bytes
        group = max(1, self.worker.stage_bytes // cpu.block_bytes)
        hosts: list[torch.Tensor] = []
        at, skip = 0, plan.skip
        for i, (key, src) in enumerate(zip(plan.keys, plan.sources)):
            host = self._host_block(key, src)
            if host is None:
                if hosts:  # the good prefix before it
                    n = len(hosts) * self.k - skip
                    self.worker.host_to_device(hosts, skip, block_ids[at:at + n])
                return [key]
            hosts.append(host)
            if len(hosts) == group or i == len(plan.keys) - 1:
                n = len(hosts) * self.k - skip
                self.worker.host_to_device(hosts, skip, block_ids[at:at + n])
                hosts, at, skip = [], at + n, 0
        return []

    def _host_block(self, key: Key, src: Source) -> torch.Tensor | None:
        """Worker thread: one source block as a host tensor, or None if it cannot be used
        (a disk record missing, torn, failing its checksum or of the wrong size)."""
        cpu, disk = self.mgr.cpu, self.mgr.disk
        if src.tier == "cpu":
            return cpu.buf[src.slot]
        if disk is None or src.loc is None:
            return None
        raw = disk.read_block(key, src.loc)
        if raw is None or len(raw) != cpu.block_bytes:
            return None
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(
            cpu.buf.dtype).view(cpu.buf.shape[1:])

    def abandon_load(self, rid: str, exc: Exception) -> None:
        """A restore whose start failed after ``start_load`` registered it: booked as a
        failed load (its sources unpinned, its keys no longer claimed)."""
        self._load_done(rid, exc)

    def _load_done(self, rid: str, result: Any) -> LoadDone | None:
        plan = self.loads.pop(rid, None)
        if plan is None:
            return None
        for key in plan.keys:
            if self._restoring.get(key) == rid:
                del self._restoring[key]
        bad = [] if isinstance(result, Exception) else list(result)
        self.mgr.complete_load(plan.keys, plan.sources, bad, None)
        kept = plan.keys.index(bad[0]) if bad and bad[0] in plan.keys else 0
        if isinstance(result, Exception) or (bad and kept == 0):
            self.stats.restore_failures += 1
            log.warning("KV restore for %s failed (%s); recomputing", rid,
                        result if isinstance(result, Exception) else "corrupt block on disk")
            return LoadDone(rid, False, plan)
        if bad:
            self._truncate(rid, plan, kept)
        secs = time.monotonic() - plan.started
        self.stats.observe_restore(secs)
        nbytes = {"cpu": 0, "disk": 0}
        for t in plan.tiers:
            nbytes[t] += self.mgr.cpu.block_bytes
            self.stats.restore_blocks[t] += 1
        for t, b in nbytes.items():
            self.stats.restore_bytes[t] += b
            self.est.observe_transfer(t, b, secs * b / max(1, sum(nbytes.values())))
        for t, toks in plan.tokens_by_tier.items():
            self.stats.hit_tokens[t] += toks
        return LoadDone(rid, True, plan)

    def _truncate(self, rid: str, plan: RestorePlan, kept: int) -> None:
        """Cut ``plan`` to its first ``kept`` groups (a corrupt block followed them): the
        request is admitted with those restored and computes the rest in the device blocks
        it already holds; only the kept prefix is then cached (and announced)."""
        self.stats.restores_truncated += 1
        self.stats.restore_outcome["failed"] += len(plan.keys) - kept
        log.warning("KV restore for %s: corrupt block on disk after %d of %d blocks; keeping "
                    "those, recomputing the rest", rid, kept, len(plan.keys))
        plan.keys, plan.tiers, plan.held = plan.keys[:kept], plan.tiers[:kept], plan.held[:kept]
        plan.sources = plan.sources[:kept]
        plan.num_blocks = kept * self.k - plan.skip
        plan.tokens_by_tier = self._tokens_by_tier(plan.tiers, plan.skip)

    # ---- completions ------------------------------------------------------------------
    def poll(self, timeout: float | None = None) -> list[LoadDone]:
        """Apply finished stores/disk writes; return finished loads."""
        loads = []
        for tag, ctx, result in self.worker.poll(timeout):
            if tag == "store":
                self.store_done(ctx, result)
            elif tag == "disk":
                err = repr(result) if isinstance(result, Exception) else None
                self.mgr.complete_disk_write(ctx, err is None, err)
            elif tag == "load":
                done = self._load_done(ctx, result)
                if done is not None:
                    loads.append(done)
        return loads

    def drain(self, timeout: float = 10.0) -> list[LoadDone]:
        """Wait for every job in flight (shutdown, tests)."""
        deadline, out = time.monotonic() + timeout, []
        while self.worker.pending and time.monotonic() < deadline:
            out += self.poll(0.05)
        return out

    def take_events(self) -> list:
        return self.mgr.take_events()
