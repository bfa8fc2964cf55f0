"""Prefill instances: instance-synchronous chunked-prefill steps over their ranks' block pools.

A DEPn instance steps all n ranks together (the MoE all-to-all is a barrier), so one step
lasts as long as `PerfModel` says its slowest rank plus the shared MoE work takes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from agentserve.kv.manager import cdiv
from agentserve.sim.cluster import (
    Clock,
    Rank,
    SimRequest,
    cache_computed,
    fits,
    store_cpu,
)
from agentserve.sim.perf import PerfModel


class Instance(abc.ABC):
    """Base: a clock, ranks and a perf model; `kick` starts a step when idle."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank]) -> None:
        self.clock, self.perf, self.ranks = clock, perf, ranks
        self.busy = False
        self.busy_s = 0.0

    def kick(self) -> None:
        if not self.busy:
            self._step()

    def _run(self, dt: float, done: Callable[[], None]) -> None:
        self.busy, self.busy_s = True, self.busy_s + dt
        self.clock.at(self.clock.now + dt, done)

    @abc.abstractmethod
    def _step(self) -> None:
        """Start the next step of this instance (prefill chunk or decode batch)."""


class PrefillInstance(Instance):
    """Chunked prefill with prefix hits from GPU, restores from CPU, and stores to CPU:
    write-through (each block as it is computed; the engine's `--kv-store-on fill`) or
    write-back (each block the device evicts; `--kv-store-on evict`, kv/writeback.py)."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank], chunk: int,
                 handoff: Callable[[SimRequest], None], write_back: bool = False) -> None:
        super().__init__(clock, perf, ranks)
        self.chunk, self.handoff = chunk, handoff
        self.cpu_restore_bytes = 0.0
        self.cpu_store_blocks = 0  # blocks written to the CPU tier (SPEC: ~5 TB in 24 min at c128)
        self.hit_tokens = self.cpu_hit_tokens = self.prompt_tokens = 0
        self.write_back = write_back
        if write_back:
            for r in ranks:
                if r.cpu is not None:
                    r.pool.on_evict_blocks = self._store_evicted(r)

    def _store_evicted(self, r: Rank) -> Callable[[list], None]:
        def store(evicted: list) -> None:
            self.cpu_store_blocks += store_cpu(r.cpu, [h for h, _ in evicted])
        return store

    def _admit(self, r: Rank, req: SimRequest) -> bool:
        """Match the prefix (GPU, then CPU), take blocks; False when the pool is too full."""
        bs = r.pool.block_size
        n = max(0, (req.n_in - 1) // bs)
        hits = r.pool.match_prefix(req.hashes[:n])
        g = len(hits)
        c = 0
        if r.cpu is not None:
            while g + c < n and req.hashes[g + c] in r.cpu.cached:
                c += 1
        need = cdiv(req.n_in, bs) - g
        if not fits(r.pool, hits, need):
            return False
        r.pool.touch(hits)
        if c and self.write_back:  # pinned first, as the engine does: the allocation's
            src = [r.cpu.cached[h] for h in req.hashes[g:g + c]]  # evictions are stored
            r.cpu.touch(src)  # into the tier and must not evict what this restores
            req.blocks = hits + r.pool.allocate(need)
            r.cpu.free(src)
        else:
            req.blocks = hits + r.pool.allocate(need)
        req.computed = req.cached = (g + c) * bs
        req.restored = c * bs
        req.t_admit = self.clock.now
        self.hit_tokens += g * bs
        self.cpu_hit_tokens += c * bs
        self.prompt_tokens += req.n_in
        if c:  # restore overlaps other ranks' work; the request waits for its bytes
            cache_computed(r.pool, req, g, g + c)
            self.cpu_restore_bytes += c * bs * self.perf.model.kv_bytes_per_token()
            req.ready_at = self.clock.now + self.perf.cpu_restore_time(c * bs)
            self.clock.at(req.ready_at, self.kick)
        return True

    def _plan(self, r: Rank) -> list[tuple[SimRequest, int]]:
        while r.waiting and self._admit(r, r.waiting[0]):
            r.running.append(r.waiting.popleft())
        budget, out = self.chunk, []
        for req in r.running:
            if budget <= 0:
                break
            if req.ready_at > self.clock.now:
                continue
            n = min(budget, req.n_in - req.computed)
            out.append((req, n))
            budget -= n
        return out

    def _step(self) -> None:
        plan = [self._plan(r) for r in self.ranks]
        if not any(plan):
            self.busy = False
            return
        dt = self.perf.prefill_step([[(n, q.computed) for q, n in p] for p in plan])
        self._run(dt, lambda: self._done(plan))

    def _done(self, plan: list[list[tuple[SimRequest, int]]]) -> None:
        bs = self.ranks[0].pool.block_size
        for r, p in zip(self.ranks, plan):
            for req, n in p:
                before = req.computed // bs
                req.computed += n
                full = req.computed // bs
                cache_computed(r.pool, req, before, full)
                if not self.write_back:
                    self.cpu_store_blocks += store_cpu(r.cpu, req.hashes[before:full])
                if req.computed >= req.n_in:
                    r.running.remove(req)
                    req.t_pdone = self.clock.now
                    self.handoff(req)
        self.busy = False
        self._step()

    def release(self, req: SimRequest) -> None:
        """After the decode side pulled the KV: free the prefill blocks into the LRU."""
        assert req.rank is not None
        req.rank.pool.free(list(reversed(req.blocks)))
        req.blocks = []
