"""A tier's slots without their bytes: which keys it holds, which are pinned, what to evict.

``CPUTier`` (tiers.py) is this bookkeeping plus a host buffer the copy threads fill; the
simulator's CPU tier (sim/cluster.py) is this bookkeeping alone, on its clock (it has no bytes
to copy). Torch-free, one thread only.
"""

from __future__ import annotations

from agentserve.kv.offload.policies import BlockInfo, Key, PinCounts, RetentionPolicy


class TierSlots:
    """Slots addressed by block hash, evicted by a ``RetentionPolicy``.

    A key is *ready* once its store completed; *pinned* keys (being loaded, or being
    written through to disk) are never evicted.
    """

    def __init__(self, num_slots: int, policy: RetentionPolicy) -> None:
        if num_slots <= 0:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        self.num_slots, self.policy = num_slots, policy
        self.slots: dict[Key, int] = {}
        self.ready: set[Key] = set()
        self.pins = PinCounts()
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def usage(self) -> float:
        return len(self.slots) / self.num_slots

    def contains(self, key: Key) -> bool:
        return key in self.ready

    def is_pinned(self, key: Key) -> bool:
        return self.pins.get(key, 0) > 0 or (key in self.slots and key not in self.ready)

    def pin(self, key: Key) -> None:
        self.pins.pin(key)

    def unpin(self, key: Key) -> None:
        self.pins.unpin(key)

    def reserve(self, key: Key, info: BlockInfo) -> tuple[int | None, list[Key]]:
        """A slot for ``key`` (evicting if needed) and the keys evicted; slot None if full."""
        evicted: list[Key] = []
        while not self.free_slots:
            victim = self.policy.victim(self.is_pinned)
            if victim is None:
                return None, evicted
            self.drop(victim)
            evicted.append(victim)
        slot = self.free_slots.pop()
        self.slots[key] = slot
        return slot, evicted

    def commit(self, key: Key, ok: bool, info: BlockInfo) -> bool:
        """Finish a store: the key becomes ready (and known to the policy) or is dropped."""
        if key not in self.slots:
            return False
        if not ok:
            self.free_slots.append(self.slots.pop(key))
            return False
        self.ready.add(key)
        self.policy.insert(key, info)
        return True

    def drop(self, key: Key) -> None:
        """Forget ``key`` and free its slot (check ``is_pinned`` first)."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.ready.discard(key)
        self.policy.remove(key)
