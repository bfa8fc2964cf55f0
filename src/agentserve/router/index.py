"""Where blocks live: block key -> holders, per storage tier, with speculative entries.

A *holder* is one (endpoint, data-parallel rank) pair and owns one bit; each tier
(`GPU`, `CPU`, `DISK`, ...) maps a block key to the OR of its holders' bits. Keys are
the low 64 bits of the engine's block hash, which is what vLLM publishes by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) and what a 32-byte hash reduces to, so events
in either encoding and the router's own hashes meet on one key. A dict of int -> int
costs about 100 bytes per block (see `memory_bytes`, measured by
`benchmarks/router_index_memory.py`); masks of up to 8 holders are interned small ints.

`match` answers, for one request, how many leading blocks each holder has in each tier
or better. Default: by bisection, O(changes x log n) lookups (12,500-block prompts cost
~30 lookups instead of 12,500), relying on engines evicting chain tails first so that a
holder's blocks of one chain form a prefix. `exact=True` scans every block in C
(`map(dict.get)`, a running AND, one bisect per distinct value) and sees holes too.

Speculative entries (`speculate`) record "just routed here" for a short TTL so that a
burst of sibling requests sharing a new prefix lands together before the engine's first
BlockStored arrives; they count as GPU-tier holdings and expire on their own.
"""

from __future__ import annotations

import sys
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import and_, neg, or_

Holder = tuple[str, int]  # (endpoint url, data-parallel rank)


def block_key(h: int | bytes) -> int:
    """Index key of a block hash as published (int) or computed (bytes)."""
    if isinstance(h, int):
        return h & 0xFFFFFFFFFFFFFFFF
    return int.from_bytes(h[-8:], "big")


@dataclass(slots=True)
class Match:
    """Leading blocks held per holder: `runs[holder][t]` for tier t or better."""

    num_blocks: int
    tiers: list[str]
    runs: dict[Holder, list[int]]

    def weighted(self, holder: Holder, weights: dict[str, float]) -> float:
        """Blocks held, each counted at the weight of the best tier holding it."""
        runs = self.runs.get(holder)
        if not runs:
            return 0.0
        total, prev = 0.0, 0
        for tier, run in zip(self.tiers, runs):
            if run > prev:
                total += (run - prev) * weights.get(tier, 0.5)
                prev = run
        return total

    def best_run(self, holder: Holder) -> int:
        """Leading blocks held in any tier."""
        runs = self.runs.get(holder)
        return runs[-1] if runs else 0


class PrefixIndex:
    """Block key -> holder bitmask per tier; plus TTL'd speculative GPU entries."""

    def __init__(self, tier_weights: dict[str, float] | None = None,
                 exact: bool = False) -> None:
        self.exact = exact  # True: scan every block (holes found); False: bisect (prefix runs)
        self.tier_weights = tier_weights or {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5}
        self.tiers: dict[str, dict[int, int]] = {"GPU": {}}
        self._bits: dict[Holder, int] = {}
        self._holders: dict[int, Holder] = {}
        self._spec: dict[int, int] = {}
        self._spec_q: deque[tuple[float, int, Sequence[int]]] = deque()

    # ---- holders ------------------------------------------------------------------
    def bit(self, holder: Holder) -> int:
        """The holder's bit (allocated on first use; freed by `drop_endpoint`)."""
        b = self._bits.get(holder)
        if b is None:
            i = 0
            while (1 << i) in self._holders:
                i += 1
            b = 1 << i
            self._bits[holder] = b
            self._holders[b] = holder
        return b

    def endpoint_mask(self, endpoint: str) -> int:
        return sum(b for (ep, _), b in self._bits.items() if ep == endpoint)

    # ---- events -------------------------------------------------------------------
    def _tier(self, medium: str | None) -> dict[int, int]:
        name = (medium or "GPU").upper()
        d = self.tiers.get(name)
        if d is None:
            d = self.tiers[name] = {}
        return d

    def store(self, holder: Holder, keys: list[int], medium: str | None = "GPU") -> None:
        d, b = self._tier(medium), self.bit(holder)
        get = d.get
        for k in keys:
            d[k] = get(k, 0) | b

    def remove(self, holder: Holder, keys: list[int], medium: str | None = "GPU") -> None:
        _drop_bits(self._tier(medium), keys, ~self.bit(holder))

    def clear(self, mask: int, medium: str | None = None) -> int:
        """Drop the holders in `mask` from one tier (None: all tiers); O(index size)."""
        dropped, nm = 0, ~mask
        tiers = [self._tier(medium)] if medium else list(self.tiers.values())
        for d in tiers:
            hit = [k for k, m in d.items() if m & mask]
            for k in hit:
                m = d[k] & nm
                if m:
                    d[k] = m
                else:
                    del d[k]
            dropped += len(hit)
        return dropped

    def clear_holder(self, holder: Holder, medium: str | None = None) -> int:
        return self.clear(self.bit(holder), medium)

    def drop_endpoint(self, endpoint: str) -> None:
        """Forget an endpoint entirely (its entries and its bits)."""
        mask = self.endpoint_mask(endpoint)
        self.clear(mask)
        for k in [k for k, m in self._spec.items() if m & mask]:
            self._spec[k] &= ~mask
        for h in [h for h in self._bits if h[0] == endpoint]:
            del self._holders[self._bits.pop(h)]

    # ---- speculation ----------------------------------------------------------------
    def speculate(self, holder: Holder, keys: Sequence[int], ttl_s: float,
                  now: float | None = None) -> None:
        """Pretend `holder` has `keys` on GPU until `ttl_s` from now."""
        if ttl_s <= 0 or not keys:
            return
        now = time.monotonic() if now is None else now
        self.expire(now)
        b, d = self.bit(holder), self._spec
        get = d.get
        for k in keys:
            d[k] = get(k, 0) | b
        self._spec_q.append((now + ttl_s, b, keys))

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        q, d = self._spec_q, self._spec
        while q and q[0][0] <= now:
            _, b, keys = q.popleft()
            _drop_bits(d, keys, ~b)

    # ---- lookup -----------------------------------------------------------------------
    def _ordered_tiers(self) -> list[str]:
        live = [t for t, d in self.tiers.items() if d]
        if "GPU" not in live:
            live.insert(0, "GPU")
        return sorted(live, key=lambda t: -self.tier_weights.get(t, 0.5))

    def match(self, keys: Sequence[int], now: float | None = None) -> Match:
        """Leading blocks of `keys` held by each holder, per tier-or-better."""
        if self._spec:
            self.expire(now)
        tiers = self._ordered_tiers()
        runs: dict[Holder, list[int]] = {}
        if not keys:
            return Match(0, tiers, runs)
        scan = self._scan_exact if self.exact else self._scan_bisect
        for ti in range(len(tiers)):
            scan(keys, [self.tiers.get(t) or {} for t in tiers[:ti + 1]], ti, len(tiers), runs)
        return Match(len(keys), tiers, runs)

    def _lookups(self, dicts: list[dict[int, int]]) -> list:
        gets = [d.get for d in dicts if d]
        if self._spec:
            gets.append(self._spec.get)
        return gets

    def _scan_exact(self, keys: list[int], dicts: list[dict[int, int]], ti: int, nt: int,
                    runs: dict[Holder, list[int]]) -> None:
        """O(n) in C: map(dict.get) over all keys, OR the tiers, running AND, bisect."""
        masks: list[int] | None = None
        for get in self._lookups(dicts):
            col = map(get, keys, repeat(0))
            masks = list(col) if masks is None else list(map(or_, masks, col))
        if masks and masks[0]:
            self._runs_from(list(accumulate(masks, and_)), ti, nt, runs)

    def _scan_bisect(self, keys: list[int], dicts: list[dict[int, int]], ti: int, nt: int,
                     runs: dict[Holder, list[int]]) -> None:
        """O(changes * log n) lookups, assuming each holder's blocks form a prefix.

        Engines evict a chain's tail first (vLLM frees a request's blocks in reverse order
        into its LRU free queue), so the set of holders of block i only shrinks with i:
        bisect for the positions where it changes instead of looking up every block.
        """
        gets = self._lookups(dicts)

        def mask(i: int) -> int:
            k, m = keys[i], 0
            for g in gets:
                m |= g(k, 0)
            return m

        n = len(keys)
        m0 = mask(0)
        mn = mask(n - 1) & m0
        if not m0:
            return
        drops: list[tuple[int, int]] = []  # (run length, bits that end there)
        stack = [(0, n - 1, m0, mn)]
        while stack:
            lo, hi, mlo, mhi = stack.pop()
            if mlo == mhi:
                continue
            if hi - lo == 1:
                drops.append((hi, mlo & ~mhi))
                continue
            mid = (lo + hi) // 2
            mm = mask(mid) & mlo  # a holder gone at lo stays gone
            stack += [(lo, mid, mlo, mm), (mid, hi, mm, mhi & mm)]
        drops.append((n, mn))
        for run, bits in drops:
            self._set_runs(bits, run, ti, nt, runs)

    def _set_runs(self, bits: int, run: int, ti: int, nt: int,
                  runs: dict[Holder, list[int]]) -> None:
        while bits:
            b = bits & -bits
            bits ^= b
            holder = self._holders.get(b)
            if holder is not None:
                r = runs.setdefault(holder, [0] * nt)
                for t in range(ti, nt):
                    if run > r[t]:
                        r[t] = run

    def _runs_from(self, acc: list[int], ti: int, nt: int,
                   runs: dict[Holder, list[int]]) -> None:
        """Run length per holder bit from the running AND `acc` of the block masks.

        `acc` only loses bits, so as integers it is non-increasing: each distinct value
        ends at one C-level bisect, and the bits it loses there have that run length.
        """
        n, i, cur = len(acc), 0, acc[0]
        while cur:
            j = bisect_right(acc, -cur, lo=i, key=neg)  # first index with acc < cur
            nxt = acc[j] if j < n else 0
            self._set_runs(cur & ~nxt, j, ti, nt, runs)
            i, cur = j, nxt

    # ---- size ------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(d) for d in self.tiers.values())

    def memory_bytes(self) -> int:
        """Bytes held by the index tables (dicts, keys, non-interned masks)."""
        total = 0
        for d in list(self.tiers.values()) + [self._spec]:
            total += sys.getsizeof(d)
            for k, m in d.items():
                total += sys.getsizeof(k) + (sys.getsizeof(m) if m > 256 else 0)
        return total


def _drop_bits(d: dict[int, int], keys: list[int], keep_mask: int) -> None:
    """Clear holder bits (`keep_mask` = ~bits) from `keys`; a key left with none is deleted."""
    for k in keys:
        m = d.get(k)
        if m is not None:
            m &= keep_mask
            if m:
                d[k] = m
            else:
                del d[k]
