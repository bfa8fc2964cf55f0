"""Prefill instances: instance-synchronous chunked-prefill steps over their ranks' block pools.

A DEPn instance steps all n ranks together (the MoE all-to-all is a barrier), so one step
lasts as long as `PerfModel` says its slowest rank plus the shared MoE work takes.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable

from agentserve.kv.manager import cdiv
from agentserve.sim.cluster import (
    Clock,
    Rank,
    SimRequest,
    cache_computed,
    fits,
    refresh_cpu,
    store_cpu,
)
from agentserve.sim.perf import PerfModel

# Steps from the one a finished load is reported in to the first that may run its request:
# vLLM's async scheduling (on by default) plans step N+1 before it reads step N's output.
ASYNC_SCHEDULING_LAG = 2


def planned_after(r: Rank) -> int:
    """Steps after the running one until a plan of rank `r` sees what happens now (its input,
    or what the running step reports): a rank with requests plans the next step before it
    reads either (async scheduling), one running the DP wave's dummy batches plans
    synchronously. Both the prefill and the decode instances use this one rule."""
    return ASYNC_SCHEDULING_LAG if r.running or r.waiting or r.holding else 1


class Instance(abc.ABC):
    """Base: a clock, ranks and a perf model; `kick` starts a step when idle."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank]) -> None:
        self.clock, self.perf, self.ranks = clock, perf, ranks
        self.busy = False
        self.busy_s = 0.0  # seconds of the steps started so far, each whole
        self._busy_end = 0.0  # when the step in flight ends

    def kick(self) -> None:
        if not self.busy:
            self._step()

    def _run(self, dt: float, done: Callable[[], None]) -> None:
        self.busy, self.busy_s = True, self.busy_s + dt
        self._busy_end = self.clock.now + dt
        self.clock.at(self._busy_end, done)

    def busy_so_far(self) -> float:
        """Seconds stepped up to now: the step in flight counts up to now only, so a window's
        busy share (two readings' difference) is never above 1."""
        return self.busy_s - max(0.0, self._busy_end - self.clock.now)

    @abc.abstractmethod
    def _step(self) -> None:
        """Start the next step of this instance (prefill chunk or decode batch)."""


class PrefillInstance(Instance):
    """Chunked prefill with prefix hits from GPU, restores from CPU, and stores to CPU:
    write-through (each block as it is computed; the engine's `--kv-store-on fill`) or
    write-back (each block the device evicts; `--kv-store-on evict`, kv/offload/writeback.py)."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank], chunk: int,
                 handoff: Callable[[SimRequest], None], write_back: bool = False) -> None:
        super().__init__(clock, perf, ranks)
        self.chunk, self.handoff = chunk, handoff
        self.cpu_restore_bytes = 0.0
        self.cpu_store_blocks = 0  # blocks written to the CPU tier (SPEC: ~5 TB in 24 min at c128)
        self.hit_tokens = self.cpu_hit_tokens = self.prompt_tokens = 0  # first admissions only
        self.preemptions = 0  # running prefills preempted for want of blocks (recomputed)
        self.unjams = 0  # times the simulator's bound (`_unjam`) freed a wedged rank
        self.step_no = 0  # steps planned so far (a finished load is seen by step number)
        self._loads: list[tuple[Rank, SimRequest, float]] = []  # admitted this plan, not issued
        self._frees: list[tuple[int, Rank, list]] = []  # pulled, not yet seen: (step, rank, blocks)
        self.write_back = write_back
        if write_back:
            for r in ranks:
                if r.cpu is not None:
                    r.pool.on_evict_blocks = self._store_evicted(r)

    def _store_evicted(self, r: Rank) -> Callable[[list], None]:
        def store(evicted: list) -> None:
            self.cpu_store_blocks += store_cpu(r.cpu, [h for h, _ in evicted])
        return store

    # vLLM's V1 scheduler (0.32, `v1/core/sched/scheduler.py`) with the CPU offloading connector,
    # per rank and step: running requests first, each taking the blocks its next chunk needs (a
    # full pool preempts the newest running request: its blocks are freed, still cached, and it
    # goes back to the head of the queue to start over). Then, if nobody was preempted, the
    # requests holding KV blocks (restoring, or restored and waiting to run) ahead of the
    # waiting queue, in order. A request is admitted only if its whole remaining prompt fits in
    # the free blocks (`scheduler_reserve_full_isl`, on by default since vLLM #37307), not just
    # its first chunk; the first that does not fit stops the scan. A prompt whose prefix the CPU
    # tier holds takes blocks for that part only, and only if they fit beside what every
    # in-flight prefill still needs (vLLM #44560's reservation); the load is issued when the
    # step's forward ends, after the rank's earlier loads (one copy stream per direction), and
    # is seen done at the end of the step it finishes in: one step later again under async
    # scheduling (vLLM's default), the request may run. Two prompts never load the same block
    # at once: the second waits for the first (the connector defers it), then hits it.
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
        req.ready_step = -1
        self.preemptions += 1

    def _preempt(self, r: Rank, req: SimRequest) -> None:
        """vLLM's recompute preemption: drop the request, back to the head of the queue."""
        self._drop(r, req)
        r.waiting.appendleft(req)

    @staticmethod
    def _reserved(r: Rank) -> int:
        """Blocks the rank's in-flight prefills (running, restoring, restored) still need to
        hold their whole prompts: what a new restore must leave free."""
        bs = r.pool.block_size
        return sum(cdiv(q.n_in, bs) - len(q.blocks) for q in itertools.chain(r.running, r.holding))

    def _lookup(self, r: Rank, req: SimRequest, budget: int) -> int | None:
        """Admit a request with no blocks: GPU prefix hits, then the CPU tier's continuation
        (a load: blocks for it only, the request joins `r.holding`) or the first chunk.
        Returns the chunk to run now (0 when a load started), None when the whole prompt does
        not fit (the scan stops) and -1 when a block it would restore is being loaded for
        another request (it keeps its place; the scan goes on)."""
        bs = r.pool.block_size
        n = req.head_blocks(bs)
        hits = r.pool.match_prefix(req.hashes[:n])
        g = len(hits)
        c = 0
        if r.cpu is not None:
            while g + c < n and req.hashes[g + c] in r.cpu.ready:
                c += 1
        if c and any(h in r.loading for h in req.hashes[g:g + c]):
            return -1
        if not fits(r.pool, hits, cdiv(req.n_in, bs) - g):  # the whole prompt must fit
            return None
        if c and not fits(r.pool, hits, c, self._reserved(r)):
            return None
        chunk = 0 if c else min(budget, req.n_in - g * bs)
        r.pool.touch(hits)
        need = c if c else cdiv(g * bs + chunk, bs) - g
        if c and self.write_back:  # pinned first, as the engine does: the allocation's
            src = req.hashes[g:g + c]  # evictions are stored into the tier
            for h in src:  # and must not evict what this restores
                r.cpu.pin(h)
            req.blocks = hits + r.pool.allocate(need)
            for h in src:  # unpinned, as the engine's restore finishing: hit, newest
                r.cpu.unpin(h)
                r.cpu.policy.touch(h)
        else:
            req.blocks = hits + r.pool.allocate(need)
        req.computed = req.cached = (g + c) * bs
        req.restored = c * bs
        req.t_admit = self.clock.now
        if not req.counted:  # a prompt counts once, however often it is preempted
            req.counted = True
            self.hit_tokens += g * bs
            self.cpu_hit_tokens += c * bs
            self.prompt_tokens += req.n_in
        if c:  # the load is issued when this step's forward ends (`_issue_loads`)
            req.restore_from = g  # its blocks are registered once loaded (vLLM delays caching)
            self.cpu_restore_bytes += c * bs * self.perf.model.state_bytes_per_token()
            for h in req.hashes[g:g + c]:
                r.loading[h] = r.loading.get(h, 0) + 1
            self._loads.append((r, req, self.perf.cpu_restore_time(c * bs)))
            r.holding.append(req)
        return chunk

    def _promote(self, r: Rank, req: SimRequest, budget: int) -> int | None:
        """A restored request's next chunk, if its whole remaining prompt fits (vLLM runs it
        through the same admission gate); None otherwise."""
        if req.restore_from >= 0:  # restored: now its blocks can be hit
            self._unmark(r, req)
            cache_computed(r.pool, req, req.restore_from, req.computed // r.pool.block_size)
            req.restore_from = -1
        if cdiv(req.n_in, r.pool.block_size) - len(req.blocks) > r.pool.num_free_blocks:
            return None
        n = min(budget, req.n_in - req.computed)
        self._grow(r, req, req.computed + n)
        return n

    def _plan(self, r: Rank) -> list[tuple[SimRequest, int]]:
        budget, out, preempted = self.chunk, [], False
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
        stop = preempted
        k = 0  # requests holding blocks first: restoring ones keep their place
        while not stop and k < len(r.holding) and budget > 0:
            req = r.holding[k]
            if req.ready_step < 0 or req.ready_step > self.step_no:
                k += 1
                continue
            n = self._promote(r, req, budget)
            if n is None:
                stop = True
                break
            del r.holding[k]
            r.running.append(req)
            out.append((req, n))
            budget -= n
        k = 0
        while not stop and k < len(r.waiting) and budget > 0:
            req = r.waiting[k]
            if req.seen_step > self.step_no:  # not yet in the scheduler's queue
                k += 1
                continue
            got = self._lookup(r, req, budget)
            if got is None:
                break
            if got < 0:  # deferred behind another request's load of the same blocks
                k += 1
                continue
            del r.waiting[k]
            if not got:  # restoring: it joined `r.holding`
                continue
            r.running.append(req)
            out.append((req, got))
            budget -= got
        if not out and not r.running and r.pinned == 0 and (r.waiting or r.holding):
            self._unjam(r)
        return out

    def _unjam(self, r: Rank) -> None:
        """Nothing runs, loads or waits to be pulled, and the head of the queue cannot get its
        blocks because restored requests hold them (vLLM's reservation makes this rare; were it
        to happen, vLLM would wait forever). The simulator's bound: every restored request but
        the first gives its blocks back (as a preemption would) and returns to the queue head;
        then the rest fits, as every admitted prompt fits an empty rank."""
        if any(q.ready_step < 0 or q.ready_step > self.step_no for q in r.holding):
            return  # a load is in flight or not yet seen: the rank is not wedged
        held = list(r.holding)[1:]
        for q in reversed(held):
            r.holding.remove(q)
            self._unmark(r, q)
            self._drop(r, q)
            r.waiting.appendleft(q)
        if held:
            self.unjams += 1
            self.clock.at(self.clock.now, self.kick)

    def _issue_loads(self, at: float) -> None:
        """Start this plan's loads on each rank's copy stream at `at` (when the step's forward
        ends, or now if no step runs), one after another."""
        for r, req, d in self._loads:
            r.copy_free = max(at, r.copy_free) + d
            req.ready_at = r.copy_free
            self.clock.at(r.copy_free, lambda r=r, req=req: self._loaded(r, req))
        self._loads = []

    def _loaded(self, r: Rank, req: SimRequest) -> None:
        """A load finished: the worker reports it at the end of the step running now, which
        async scheduling reads after planning the next; an idle engine polls at once (the
        rank has work: the loading request holds its blocks)."""
        req.ready_step = self._seen_step(r)
        self.kick()

    @staticmethod
    def _unmark(r: Rank, req: SimRequest) -> None:
        """The scheduler has seen the request's load done: its blocks are no longer being
        loaded (from now on a lookup finds them on the GPU once the request is promoted)."""
        if req.restore_from < 0:  # already unmarked at an earlier promotion attempt
            return
        for h in req.hashes[req.restore_from:req.computed // r.pool.block_size]:
            left = r.loading.pop(h) - 1
            if left:
                r.loading[h] = left

    def _step(self) -> None:
        self.step_no += 1
        if self._frees:
            self._apply_frees()
        plan = [self._plan(r) for r in self.ranks]
        if not any(plan):
            self._issue_loads(self.clock.now)
            if self._frees or any(q.ready_step > self.step_no for r in self.ranks for q in r.holding) \
                    or any(q.seen_step > self.step_no for r in self.ranks for q in r.waiting):
                # restored requests, arrivals or pulls not yet seen: the engine keeps polling
                # with empty steps (not counted as busy time)
                self.busy = True
                self.clock.at(self.clock.now + self.perf.eff.step_overhead_s, self._idle_step)
                return
            self.busy = False
            return
        dt = self.perf.prefill_step([[(n, q.computed) for q, n in p] for p in plan])
        self._issue_loads(self.clock.now + dt)
        self._run(dt, lambda: self._done(plan))

    def _idle_step(self) -> None:
        self.busy = False
        self._step()

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
                    if not self.write_back:
                        self._offer_cpu(r, req, bs)
                    r.running.remove(req)
                    r.pinned += 1  # held until the decode side has pulled it
                    req.t_pdone = self.clock.now
                    self.handoff(req)
        self.busy = False
        self._step()

    def _offer_cpu(self, r: Rank, req: SimRequest, bs: int) -> None:
        """What vLLM's offloading connector does with a prefilled request's prefix besides
        storing the blocks it computed: a request that restored nothing offers its GPU hits
        too, so those the CPU tier has lost are written back; one that restored refreshes the
        restored blocks' place in the tier's LRU (vLLM 0.32 `offloading/scheduler.py`, stores
        from the end of the loaded hit, else from block 0; `kv_offload/cpu/manager.py`
        refreshes a request's blocks when it finishes)."""
        if r.cpu is None:
            return
        hit = req.cached // bs
        if req.restored:
            refresh_cpu(r.cpu, req.hashes[hit - req.restored // bs:hit])
        elif hit:
            self.cpu_store_blocks += store_cpu(r.cpu, req.hashes[:hit])

    def _seen_step(self, r: Rank) -> int:
        """The first step whose plan sees what happens on rank `r` now (an arrival, a pull's
        end). Under async scheduling a rank with requests plans step N+1 before it reads step
        N's output and its input queue, so what happens during step N is planned into N+2; a
        rank with none runs the DP wave's dummy batches synchronously and plans it next; an idle
        instance plans at once."""
        return self.step_no + (planned_after(r) if self.busy else 1)

    def arrive(self, r: Rank, req: SimRequest) -> None:
        """A prompt reaches rank `r`'s engine core from its API server."""
        req.seen_step = self._seen_step(r)
        r.waiting.append(req)
        self.kick()

    def release(self, req: SimRequest) -> None:
        """The decode side has pulled the KV: the prefill blocks go back into the LRU when the
        rank's scheduler reads the transfer's end from a step's output (vLLM frees them in
        `_update_from_kv_xfer_finished`), which async scheduling plans a step late."""
        assert req.rank is not None
        self._frees.append((self._seen_step(req.rank), req.rank, req.blocks))
        req.blocks = []
        self.kick()  # an idle instance reads it at once

    def _apply_frees(self) -> None:
        """Free the pulled requests' blocks the plan of step `step_no` sees."""
        keep = []
        for item in self._frees:
            step, r, blocks = item
            if step > self.step_no:
                keep.append(item)
                continue
            r.pool.free(list(reversed(blocks)))
            r.pinned -= 1
        self._frees = keep
