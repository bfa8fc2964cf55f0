"""Offload tiers below the device: configuration, the CPU DRAM tier, stats, cost model.

A tier stores *offload blocks*: ``TierConfig.block_tokens`` tokens (one or more device
blocks), keyed by the chained hash of the group's last device block (the chain makes
that one hash name the whole prefix). The payload of one offload block is a tensor
``[2 (k, v), num_layers, block_tokens, num_kv_heads, head_dim]``.

All metadata here is mutated on the engine-core thread only; worker threads copy
bytes into or out of slots that the core thread has reserved or pinned.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from agentserve.kv.offload.policies import RetentionPolicy
from agentserve.kv.offload.slots import TierSlots

MEDIUM_CPU, MEDIUM_DISK = "CPU", "DISK"
TIERS = ("gpu", "cpu", "disk")
# Restore latency histogram buckets (seconds).
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


@dataclass(slots=True)
class TierConfig:
    """What ``--kv-cpu-*``, ``--kv-disk-*``, ``--kv-offload-*`` and friends configure."""

    cpu_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    block_tokens: int | None = None  # offload unit; None = device block size
    cpu_policy: str = "lru"
    store_threshold: int = 1  # store a block once it was seen this many times
    store_on: str = "fill"  # fill: write-through as blocks fill | evict: write-back (writeback.py)
    max_loads: int = 4  # concurrent restores; more wait in the queue (backpressure)
    session_ttl: float = 600.0  # idle seconds after which a session counts as finished
    restore_mode: str = "auto"  # auto (cost model) | always | never

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0


@dataclass(slots=True)
class TierStats:
    """Cumulative tier counters, read by /metrics through ``EngineStats.tiers``."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_bytes: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    restore_blocks: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    store_bytes: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    store_blocks: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    # restore; recompute (not worth restoring); pull (a P/D decode leg: pulling from the
    # prefill engine is estimated faster than restoring from its own tier)
    decisions: dict[str, int] = field(default_factory=lambda: {"restore": 0, "recompute": 0,
                                                               "pull": 0})
    # Where each restored offload block went (disjoint): ``used`` by the request that
    # triggered it; wasted as ``repeat`` (restored again for the same request, e.g. after
    # a preemption), ``device_held`` (the device still held that block, just not as part
    # of the consecutive prefix), ``aborted`` (request ended while loading) or ``failed``.
    restore_outcome: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("used", "repeat", "device_held", "aborted", "failed"), 0))
    restore_preempted_blocks: int = 0  # "used" blocks whose request was then preempted
    # before its first token (freed on the device; a later re-restore counts as "repeat")
    # Restores by size (offload blocks) and restored blocks by how long ago the device
    # evicted them ("older": a minute or more ago, or never by this process, e.g. disk).
    restore_sizes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("1", "2-3", "4-7", "8-15", "16+"), 0))
    restore_device_age: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("<2s", "2-10s", "10-60s", "older"), 0))
    restore_failures: int = 0
    # Restores cut short at a corrupt block: the prefix before it kept, the rest recomputed.
    restores_truncated: int = 0
    # Offload blocks a request did not restore because another request's restore was
    # already bringing them back (sub-agents of one group share a prefix): it waited for
    # that restore and then found them on the device.
    restore_joined_blocks: int = 0
    disk_corrupt_blocks: int = 0
    # Disk segments the startup scan could not use, by reason (kv/offload/disk.py, "Startup").
    disk_segments_skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("damaged", "foreign", "unreadable", "stray"), 0))
    disk_disabled: int = 0
    stores_skipped: int = 0  # offered blocks not stored (tier full of pinned blocks, etc.)
    last_restore_estimate_s: float = 0.0
    last_recompute_estimate_s: float = 0.0
    last_pull_estimate_s: float = 0.0
    restore_latency_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(RESTORE_BUCKETS) + 1))
    restore_latency_sum: float = 0.0
    restore_latency_count: int = 0

    def observe_restore(self, seconds: float) -> None:
        self.restore_latency_buckets[bisect.bisect_left(RESTORE_BUCKETS, seconds)] += 1
        self.restore_latency_sum += seconds
        self.restore_latency_count += 1


class CPUTier(TierSlots):
    """Host-memory slots addressed by block hash, evicted by a ``RetentionPolicy``: the
    bookkeeping of ``TierSlots`` (slots.py) over a host buffer ``buf`` of ``num_slots`` blocks.

    A key is *ready* once its store completed; *pinned* keys (being loaded, or being
    written through to disk) are never evicted.
    """

    medium = MEDIUM_CPU

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 policy: RetentionPolicy, pin_memory: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"CPU tier needs at least one slot, got {num_slots}")
        self.buf = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        if not pin_memory:
            # Fault every page in now, as pinning does: a store into never-touched memory
            # pays a page fault per 4 KiB, 3-5x the copy itself (320 blocks of 64 KiB: 17-32
            # ms instead of 5.6), and write-back stores run on the engine-core thread.
            self.buf.zero_()
        super().__init__(num_slots, policy)

    @property
    def block_bytes(self) -> int:
        return self.buf[0].numel() * self.buf.element_size()


class RestoreEstimator:
    """Restore vs recompute from measured bandwidths and the measured prefill speed.

    Bandwidths and prefill speed are exponential moving averages of real transfers
    and real steps; before the first prefill measurement restoring is assumed faster.
    """

    def __init__(self, cpu_bw: float = 4e9, disk_bw: float = 5e8, overhead_s: float = 2e-4,
                 alpha: float = 0.3) -> None:
        self.bw = {"cpu": cpu_bw, "disk": disk_bw}
        self.overhead_s, self.alpha = overhead_s, alpha
        self.prefill_tps: float | None = None

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bw[tier] += self.alpha * (nbytes / seconds - self.bw[tier])

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            tps = tokens / seconds
            self.prefill_tps = tps if self.prefill_tps is None else (
                self.prefill_tps + self.alpha * (tps - self.prefill_tps))

    def restore_s(self, bytes_by_tier: dict[str, int]) -> float:
        return self.overhead_s + sum(b / self.bw[t] for t, b in bytes_by_tier.items() if b)

    def recompute_s(self, tokens: int) -> float:
        if self.prefill_tps is None:
            return float("inf")
        return tokens / self.prefill_tps
