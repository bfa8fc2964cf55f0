"""Prefill and decode instances: instance-synchronous steps over their ranks' block pools.

A DEPn instance steps all n ranks together (the MoE all-to-all is a barrier), so one step
lasts as long as `PerfModel` says its slowest rank plus the shared MoE work takes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from agentserve.kv.manager import cdiv
from agentserve.sim.cluster import (Clock, Rank, SimRequest, cache_computed, mtp_accepted,
                                    store_cpu)
from agentserve.sim.perf import PerfModel


class Instance:
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

    def _step(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class PrefillInstance(Instance):
    """Chunked prefill with prefix hits from GPU, restores from CPU, write-through to CPU."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank], chunk: int,
                 handoff: Callable[[SimRequest], None]) -> None:
        super().__init__(clock, perf, ranks)
        self.chunk, self.handoff = chunk, handoff
        self.cpu_restore_bytes = 0.0
        self.hit_tokens = self.cpu_hit_tokens = self.prompt_tokens = 0

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
        if need + sum(1 for b in hits if b.ref_cnt == 0) > r.pool.num_free_blocks:
            return False
        r.pool.touch(hits)
        req.blocks = hits + r.pool.allocate(need)
        req.computed = req.cached = (g + c) * bs
        req.restored = c * bs
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
                store_cpu(r.cpu, req.hashes[before:full], req.n_in)
                if req.computed >= req.n_in:
                    r.running.remove(req)
                    r.inflight_tokens -= req.n_in
                    self.handoff(req)
        self.busy = False
        self._step()

    def release(self, req: SimRequest) -> None:
        """After the decode side pulled the KV: free the prefill blocks into the LRU."""
        assert req.rank is not None
        req.rank.pool.free(list(reversed(req.blocks)))
        req.blocks = []


class DecodeInstance(Instance):
    """Continuous batching with MTP; preempts the newest request when blocks run out."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank], max_seqs: int,
                 rng: np.random.Generator) -> None:
        super().__init__(clock, perf, ranks)
        self.max_seqs, self.rng = max_seqs, rng
        self.draft = perf.mtp_draft if perf.topo.mtp else 0
        self.preemptions = 0

    def local_prefix(self, r: Rank, req: SimRequest) -> int:
        """Prompt tokens this rank already holds (so need not be pulled)."""
        n = max(0, (req.n_in - 1) // r.pool.block_size)
        return len(r.pool.match_prefix(req.hashes[:n])) * r.pool.block_size

    def _grow(self, r: Rank, req: SimRequest, tokens: int) -> bool:
        bs = r.pool.block_size
        if not req.blocks:  # admission: local prefix hits + room for the prompt
            hits = r.pool.match_prefix(req.hashes[: max(0, (req.n_in - 1) // bs)])
            need = cdiv(tokens, bs) - len(hits)
            if need + sum(1 for b in hits if b.ref_cnt == 0) > r.pool.num_free_blocks:
                return False
            r.pool.touch(hits)
            req.blocks = hits + r.pool.allocate(need)
            req.computed = req.n_in
            cache_computed(r.pool, req, len(hits), req.n_in // bs)
            return True
        need = cdiv(tokens, bs) - len(req.blocks)
        if need > r.pool.num_free_blocks:
            return False
        if need > 0:
            req.blocks += r.pool.allocate(need)
        return True

    def _plan(self, r: Rank) -> list[SimRequest]:
        q = 1 + self.draft
        for req in list(r.running):
            while not self._grow(r, req, req.n_in + req.out_done + q):
                victim = r.running.pop()  # newest first, as vLLM
                r.pool.free(list(reversed(victim.blocks)))
                victim.blocks = []  # recomputed/re-pulled on re-admission
                r.waiting.appendleft(victim)
                self.preemptions += 1
                if victim is req:
                    break
        while (r.waiting and len(r.running) < self.max_seqs
               and self._grow(r, r.waiting[0], r.waiting[0].n_in + r.waiting[0].out_done + q)):
            r.running.append(r.waiting.popleft())
        return list(r.running)

    def _step(self) -> None:
        plan = [self._plan(r) for r in self.ranks]
        if not any(plan):
            self.busy = False
            return
        dt = self.perf.decode_step([[q.n_in + q.out_done for q in p] for p in plan], self.draft)
        self._run(dt, lambda: self._done(plan))

    def _done(self, plan: list[list[SimRequest]]) -> None:
        now = self.clock.now
        for r, p in zip(self.ranks, plan):
            for req in p:
                acc = min(1 + mtp_accepted(self.rng, self.draft), req.n_out - req.out_done)
                req.out_done += acc
                rec = req.rec
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                rec.chunk_times.append(now - rec.start)
                rec.chunk_tokens.append(acc)
                if req.out_done >= req.n_out:
                    r.running.remove(req)
                    r.inflight_tokens -= req.n_in + req.n_out
                    r.pool.free(list(reversed(req.blocks)))
                    req.blocks = []
                    rec.e2e, rec.output_tokens = now - rec.start, req.out_done
                    req.on_done(req)
        self.busy = False
        self._step()
