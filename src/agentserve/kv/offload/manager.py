"""Offload manager: vLLM's protocol shape over a CPU tier with an optional disk tier.

Protocol (vllm/v1/kv_offload/abstract.py ``OffloadingManager``), keys = offload-block
hashes, all calls on one thread:

- ``lookup(keys) -> n``: how many leading keys are stored (CPU or disk) and readable;
- ``prepare_load(keys) -> sources``: pin them (no eviction while loading) and say where
  each one is; ``complete_load(keys, bad=())``: unpin, count hits; keys in ``bad`` were
  found corrupt and are dropped;
- ``prepare_store(keys, infos) -> (to_store, evicted)``: reserve CPU slots for keys not
  yet stored, evicting by policy; ``complete_store(keys, ok)``: make them readable;
- ``take_events()``: BlockStored / BlockRemoved with medium ``CPU`` / ``DISK``.

The disk tier sits behind the CPU tier and is written through: every block that lands
in CPU memory is queued for disk (``prepare_disk_write``/``complete_disk_write``), so a
restarted engine finds its prefixes on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentserve.kv.offload.disk import DiskTier, Loc
from agentserve.kv.events import BlockRemoved, KVEvent, block_stored
from agentserve.kv.offload.policies import BlockInfo, Key
from agentserve.kv.offload.tiers import MEDIUM_CPU, MEDIUM_DISK, CPUTier, TierStats


@dataclass(slots=True, frozen=True)
class Source:
    """Where one key is read from during a load."""

    tier: str  # "cpu" | "disk"
    slot: int | None = None  # CPU slot
    loc: Loc | None = None  # disk location


class OffloadManager:
    """CPU (+ disk) tiers behind one lookup/load/store protocol, with per-tier events."""

    def __init__(self, cpu: CPUTier, disk: DiskTier | None, block_size: int,
                 stats: TierStats | None = None) -> None:
        self.cpu, self.disk, self.block_size = cpu, disk, block_size
        self.stats = stats or TierStats()
        # Each key's device-block hashes as they go out in events (router granularity).
        self.ext: dict[Key, list[int | bytes]] = {}
        self._events: list[KVEvent] = []

    # ---- lookup and load ------------------------------------------------------------
    def where(self, key: Key) -> str | None:
        if self.cpu.contains(key):
            return "cpu"
        if self.disk is not None and self.disk.contains(key):
            return "disk"
        return None

    def lookup(self, keys: Sequence[Key]) -> int:
        n = 0
        for k in keys:
            if self.where(k) is None:
                break
            n += 1
        return n

    def prepare_load(self, keys: Sequence[Key]) -> list[Source]:
        """Pin ``keys`` (all must be found by ``lookup``) and return their sources."""
        out = []
        for k in keys:
            tier = self.where(k)
            if tier == "cpu":
                self.cpu.pin(k)
                out.append(Source("cpu", slot=self.cpu.slots[k]))
            elif tier == "disk":
                assert self.disk is not None
                self.disk.pin(k)
                out.append(Source("disk", loc=self.disk.index[k]))
            else:
                raise KeyError(f"prepare_load: block {k.hex()[:16]} is not stored; lookup first")
        return out

    def cancel_load(self, keys: Sequence[Key], sources: Sequence[Source]) -> None:
        """Unpin keys that ``prepare_load`` pinned for a load that will not run."""
        for k, src in zip(keys, sources):
            if src.tier == "cpu":
                self.cpu.unpin(k)
            elif self.disk is not None:
                self.disk.unpin(k)

    def complete_load(self, keys: Sequence[Key], sources: Sequence[Source],
                      bad: Sequence[Key] = (), info: Sequence[BlockInfo] | None = None) -> None:
        """Unpin; hits refresh the policy, corrupt disk blocks are dropped and counted."""
        bad_set = set(bad)
        for i, (k, src) in enumerate(zip(keys, sources)):
            if src.tier == "cpu":
                self.cpu.unpin(k)
                if k in self.cpu.ready:
                    self.cpu.policy.touch(k, None if info is None else info[i])
            elif self.disk is not None:
                self.disk.unpin(k)
                if k in bad_set:
                    self.stats.disk_corrupt_blocks += 1
                    self.disk.forget(k)
                    self._removed([k], MEDIUM_DISK)

    # ---- store ------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[Key], infos: Sequence[BlockInfo],
                      ext: Sequence[list[int | bytes]]) -> tuple[list[tuple[Key, int]], list[Key]]:
        """CPU slots for the keys not stored yet: ([(key, slot)], evicted keys)."""
        to_store: list[tuple[Key, int]] = []
        evicted: list[Key] = []
        for k, info, e in zip(keys, infos, ext):
            if k in self.cpu.slots:
                if k in self.cpu.ready:
                    self.cpu.policy.touch(k, info)
                continue
            slot, ev = self.cpu.reserve(k, info)
            evicted += ev
            if slot is None:
                self.stats.stores_skipped += 1
                continue
            self.ext[k] = e
            to_store.append((k, slot))
        self.stats.evictions["cpu"] += len(evicted)
        self._removed(evicted, MEDIUM_CPU)
        return to_store, evicted

    def complete_store(self, keys: Sequence[Key], ok: bool, infos: Sequence[BlockInfo]) -> list[Key]:
        """Make stored keys readable (or release them); returns the keys now in CPU."""
        done = [k for k, info in zip(keys, infos) if self.cpu.commit(k, ok, info)]
        if done:
            self.stats.store_blocks["cpu"] += len(done)
            self.stats.store_bytes["cpu"] += len(done) * self.cpu.block_bytes
            self._stored(done, MEDIUM_CPU)
        return done

    # ---- disk write-through -------------------------------------------------------------
    def prepare_disk_write(self, key: Key) -> tuple[Loc | None, int | None]:
        """(location, segment to delete) for writing ``key`` from CPU to disk; pins it in CPU."""
        if self.disk is None or not self.cpu.contains(key):
            return None, None
        loc, evicted, dead = self.disk.reserve(key)
        self.stats.evictions["disk"] += len(evicted)
        self._removed(evicted, MEDIUM_DISK)
        if loc is not None:
            self.cpu.pin(key)
        return loc, dead

    def complete_disk_write(self, key: Key, ok: bool, error: str | None = None) -> None:
        assert self.disk is not None
        self.cpu.unpin(key)
        self.disk.commit(key, ok)
        if ok:
            self.stats.store_blocks["disk"] += 1
            self.stats.store_bytes["disk"] += self.disk.payload_bytes
            self._stored([key], MEDIUM_DISK)
        elif error is not None:
            self.disk.disable(error)
            self.stats.disk_disabled = 1

    # ---- events -----------------------------------------------------------------------
    def _stored(self, keys: list[Key], medium: str) -> None:
        hashes = [h for k in keys for h in self.ext.get(k, ())]
        if hashes:
            self._events.append(block_stored(hashes, None, [], self.block_size, medium))

    def _removed(self, keys: list[Key], medium: str) -> None:
        for k in keys:
            e = self.ext.get(k, ())
            if e:
                self._events.append(BlockRemoved(list(e), medium))
            if k not in self.cpu.slots and (self.disk is None or k not in self.disk.index):
                self.ext.pop(k, None)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def adopt_disk_keys(self, keys: Sequence[Key], ext: Sequence[list[int | bytes]] | None) -> None:
        """Keys found on disk at startup; announced when their device hashes are known."""
        if self.disk is not None:
            self.stats.disk_corrupt_blocks += self.disk.corrupt_at_scan
            for reason, n in self.disk.skipped.items():
                self.stats.disk_segments_skipped[reason] = \
                    self.stats.disk_segments_skipped.get(reason, 0) + n
        if ext is not None:
            for k, e in zip(keys, ext):
                self.ext[k] = e
            self._stored(list(keys), MEDIUM_DISK)
