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
        self.preemptions = 0  # running prefills preempted for want of blocks (recomputed)
        self.write_back = write_back
        if write_back:
            for r in ranks:
                if r.cpu is not None:
                    r.pool.on_evict_blocks = self._store_evicted(r)

    def _store_evicted(self, r: Rank) -> Callable[[list], None]:
        def store(evicted: list) -> None:
            self.cpu_store_blocks += store_cpu(r.cpu, [h for h, _ in evicted])
        return store

    # vLLM's V1 scheduler, per rank and step: running requests first, each taking the blocks
    # its next chunk needs (a full pool preempts the newest running request: its blocks are
    # freed, still cached, and it goes back to the head of the queue to start over); then, if
    # nobody was preempted, the waiting queue in order. A waiting request whose prefix the CPU
    # tier holds takes blocks for that part only and waits for the restore (the offloading
    # connector loads asynchronously); its chunks take blocks as they run. So a rank admits
    # more prompts than it can finish at once, and under pressure restores a prefix again after
    # preempting it (the reference's small ranks restored more tokens than they served; this
    # alone does not reproduce that: sim/NOTEBOOK.md, stop 26).
    def _grow(self, r: Rank, req: SimRequest, upto: int) -> bool:
        """Blocks for the request's first `upto` tokens; False when the pool lacks them."""
        need = cdiv(upto, r.pool.block_size) - len(req.blocks)
        if need > r.pool.num_free_blocks:
            return False
        if need > 0:
            req.blocks += r.pool.allocate(need)
        return True

    def _drop(self, r: Rank, req: SimRequest) -> None:
        """Free the request's blocks (computed ones stay cached for a later hit) and forget its
        progress: it starts over from a fresh lookup."""
        r.pool.free(list(reversed(req.blocks)))
        req.blocks, req.computed, req.cached, req.restored, req.restore_from = [], 0, 0, 0, -1
        self.preemptions += 1

    def _preempt(self, r: Rank, req: SimRequest) -> None:
        """vLLM's recompute preemption: drop the request, back to the head of the queue."""
        self._drop(r, req)
        r.waiting.appendleft(req)

    def _lookup(self, r: Rank, req: SimRequest, budget: int) -> int | None:
        """Admit a request with no blocks: GPU prefix hits, then the CPU tier's continuation
        (restored asynchronously: blocks for it only) or the first chunk. Returns the chunk to
        run now (0 while restoring), or None when the pool is too full."""
        bs = r.pool.block_size
        n = req.head_blocks(bs)
        hits = r.pool.match_prefix(req.hashes[:n])
        g = len(hits)
        c = 0
        if r.cpu is not None:
            while g + c < n and req.hashes[g + c] in r.cpu.cached:
                c += 1
        chunk = 0 if c else min(budget, req.n_in - g * bs)
        need = c if c else cdiv(g * bs + chunk, bs) - g
        if not fits(r.pool, hits, need):
            return None
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
            req.restore_from = g  # its blocks are registered once loaded (vLLM delays caching)
            self.cpu_restore_bytes += c * bs * self.perf.model.kv_bytes_per_token()
            req.ready_at = self.clock.now + self.perf.cpu_restore_time(c * bs)
            self.clock.at(req.ready_at, self.kick)
        return chunk

    def _plan(self, r: Rank) -> list[tuple[SimRequest, int]]:
        budget, out, now, preempted = self.chunk, [], self.clock.now, False
        i = 0
        while i < len(r.running) and budget > 0:
            req = r.running[i]
            n = min(budget, req.n_in - req.computed)
            while not self._grow(r, req, req.computed + n):
                victim = r.running.pop()  # the newest (FCFS)
                self._preempt(r, victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append((req, n))
                budget -= n
                i += 1
                continue
            break
        k = 0
        while not preempted and k < len(r.waiting) and budget > 0:
            req = r.waiting[k]
            if req.ready_at > now:  # restoring from CPU: skipped, keeps its place
                k += 1
                continue
            if req.restore_from >= 0:  # restored: now its blocks can be hit
                cache_computed(r.pool, req, req.restore_from, req.computed // r.pool.block_size)
                req.restore_from = -1
            if req.blocks:  # restored earlier: its next chunk
                n = min(budget, req.n_in - req.computed)
                if not self._grow(r, req, req.computed + n):
                    break
            else:
                got = self._lookup(r, req, budget)
                if got is None:
                    break
                if not got:  # restoring
                    k += 1
                    continue
                n = got
            del r.waiting[k]
            r.running.append(req)
            out.append((req, n))
            budget -= n
        if not out and not r.running and r.pinned == 0 and r.waiting:
            self._unjam(r, now)
        return out

    def _unjam(self, r: Rank, now: float) -> None:
        """Nothing runs, nothing is being restored or pulled, and the queue head cannot get
        blocks because requests behind it hold restored prefixes: vLLM would wait forever. The
        simulator's bound: those requests give their blocks back (as a preemption would) and
        keep their places; the head then fits, as every admitted prompt fits an empty rank."""
        if any(q.ready_at > now for q in r.waiting):
            return
        held = [q for q in list(r.waiting)[1:] if q.blocks]
        for q in held:
            self._drop(r, q)
        if held:
            self.clock.at(now, self.kick)

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
                    r.pinned += 1  # held until the decode side has pulled it
                    req.t_pdone = self.clock.now
                    self.handoff(req)
        self.busy = False
        self._step()

    def release(self, req: SimRequest) -> None:
        """After the decode side pulled the KV: free the prefill blocks into the LRU."""
        assert req.rank is not None
        req.rank.pool.free(list(reversed(req.blocks)))
        req.rank.pinned -= 1
        req.blocks = []
        self.kick()  # a rank may have been waiting for these blocks
