"""Aggregated engines ("both" role, `agentserve up --topology N`): prefill and decode in one step.

Mirrors our engine's scheduler (engine/core/scheduler.py, vLLM V1 style): each step first serves
the running requests in order (a decoding request takes 1 token, a prefilling one the rest of
its prompt up to the budget), then admits waiting requests FCFS while the
`max_num_batched_tokens` budget and `max_num_seqs` last; a new request starts after its GPU
prefix hit. The step that computes a prompt's last token also samples its first output token
(TTFT). Blocks come from the real pool; when a decoding request needs a block and none is
free, the newest running request is preempted (freed, back to the queue head, recomputed).
A waiting head whose next uncached blocks a running request is computing waits for them
(the engine's in-flight prefix sharing: the same `kv.inflight.InflightPrefill`, the same
minimum run, the same release: once the leader has computed them or left the running list).

Stepped per step (one event per step), which is cheap at the scale this is used for (one or
a few engines, tiny models on a CPU). Step time: `PerfModel.measured_step` when the hardware
profile is calibrated (cpu-local), else prefill_step + decode_step of the roofline.
"""

from __future__ import annotations

from collections.abc import Callable

from agentserve.kv.decode_groups import read_keys
from agentserve.kv.inflight import MIN_JOIN_BLOCKS, InflightPrefill
from agentserve.kv.manager import cdiv
from agentserve.sim.cluster import Clock, Rank, SimRequest, cache_computed, fits
from agentserve.sim.config import arrival_stretch, busy_path
from agentserve.sim.perf import PerfModel
from agentserve.sim.pools import Instance


class AggInstance(Instance):
    """One aggregated engine over one rank (width 1)."""

    def __init__(self, clock: Clock, perf: PerfModel, rank: Rank, budget: int, max_seqs: int,
                 engine_block: int | None = None) -> None:
        super().__init__(clock, perf, [rank])
        self.rank, self.budget, self.max_seqs = rank, budget, max_seqs
        self.engine_block = engine_block or rank.pool.block_size
        self.preemptions = 0
        # what a request reaching this engine while it steps waits: (fixed s, s a prompt token)
        self.busy_wait = busy_path(perf.hw)
        # what a request reaching this engine adds to the step in flight, when the profile
        # says (opt-in, `config.arrival_stretch`): (fixed s, s a prompt token)
        self.stretch = arrival_stretch(perf.hw)
        self._owed = 0.0  # what arrivals during the step in flight added to it so far
        self.hit_tokens = self.prompt_tokens = self.joined_tokens = 0
        bs = rank.pool.block_size
        # block hash -> the running request computing it; the engine's minimum run, in pool blocks
        self.inflight: InflightPrefill[SimRequest] = InflightPrefill(
            bs, computing=lambda q: q.rank is rank and q in rank.running,
            min_blocks=cdiv(MIN_JOIN_BLOCKS * self.engine_block, bs))
        # steps as the engine's step trace records them, when a list (engine/core/steptrace.py)
        self.trace: list[dict] | None = None
        # when a dict: request id -> its path's stamps, as the engine's request trace has
        # them (`route`: reached this engine, `adm`: queued after any busy wait, `sched`: its
        # first step began, `tok`: its first token; `busy`: the engine was stepping at `route`)
        self.req_trace: dict[str, dict] | None = None
        self.on_first: Callable[[SimRequest], None] | None = None  # a request's first token
        self._parked: list[tuple[SimRequest, int, int]] = []  # (request, leader's id, need)
        self._join_base: dict[int, int] = {}  # id(parked request) -> its hit when it first parked

    @property
    def waiting_count(self) -> int:
        """Requests queued here: FCFS, or parked on a leader's blocks (both are waiting to
        the engine's scheduler)."""
        return len(self.rank.waiting) + len(self._parked)

    def arrive(self, req: SimRequest, waited: bool = False) -> None:
        """Queue `req` on this engine; `busy_wait` (fixed + per prompt token) s later while the
        engine has requests running: our engine's API server shares its process (and the GIL)
        with the core thread, so a request's own handling waits while that thread steps (the
        cpu-local profile's `request_overhead_busy_s` and `_busy_per_token_s`)."""
        fixed, per_token = self.busy_wait
        if self.req_trace is not None and not waited:
            self.req_trace[req.rec.request_id] = {"n": req.n_in, "route": self.clock.now,
                                                  "busy": bool(self.rank.running)}
        if not waited and self.busy:  # its handling stretches the step in flight
            self._owed += self.stretch[0] + self.stretch[1] * req.n_in
        if not waited and (fixed or per_token) and self.rank.running:
            delay = fixed + per_token * req.n_in
            self.clock.at(self.clock.now + delay, lambda: self.arrive(req, True))
            return
        if self.req_trace is not None:
            self.req_trace[req.rec.request_id]["adm"] = self.clock.now
        self.rank.waiting.append(req)
        self.kick()

    def _hits(self, req: SimRequest) -> list:
        bs = self.rank.pool.block_size
        hits = self.rank.pool.match_prefix(req.hashes[: req.head_blocks(bs)])
        if self.engine_block > bs:  # the engine reuses whole blocks of its own size only
            hits = hits[: len(hits) * bs // self.engine_block * self.engine_block // bs]
        return hits

    def _joins(self, req: SimRequest, hit_blocks: int) -> tuple[int, int] | None:
        """(leader's id, prompt tokens it must have computed) when the blocks right past the
        head's hit are being computed by one running request (kv/inflight.py)."""
        return self.inflight.joins(req, hit_blocks)  # type: ignore[return-value]

    def _release_parked(self) -> None:
        """Back to the queue head, in order: those whose leader computed their shared blocks
        or left the running list."""
        r, keep, back, ready = self.rank, [], [], self.inflight.ready
        for f, leader, need in self._parked:
            (back if ready(leader, need) else keep).append((f, leader, need))
        self._parked = keep
        for f, _, _ in reversed(back):
            r.waiting.appendleft(f)

    def _admit(self, req: SimRequest, hits: list) -> bool:
        r = self.rank
        bs = r.pool.block_size
        need = cdiv(req.n_in + req.out_done, bs) - len(hits)
        if not fits(r.pool, hits, need):
            return False
        r.pool.touch(hits)
        req.blocks = hits + r.pool.allocate(need)
        req.computed = req.cached = len(hits) * bs
        if req.out_done == 0:  # count a prompt once, as the engine does
            self.hit_tokens += req.cached
            self.prompt_tokens += req.n_in
        self.inflight.add(req, len(hits))
        return True

    def _preempt(self) -> SimRequest:
        r = self.rank
        victim = r.running.pop()
        self.inflight.drop(victim.uid)
        r.pool.free(list(reversed(victim.blocks)))
        victim.blocks, victim.computed = [], 0
        r.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def _step(self) -> None:
        r, bs = self.rank, self.rank.pool.block_size
        budget, plan = self.budget, []
        i = 0
        while i < len(r.running) and budget > 0:
            req = r.running[i]
            prompt_left = req.n_in - req.computed
            n = min(prompt_left, budget) if prompt_left > 0 else 1
            if prompt_left <= 0:  # decoding: the next token's KV slot
                while cdiv(req.n_in + req.out_done + 1, bs) > len(req.blocks):
                    if r.pool.num_free_blocks:
                        req.blocks += r.pool.allocate(1)
                    elif self._preempt() is req:
                        n = 0
                        break
                if n == 0:
                    continue  # preempted itself; the loop index now points past the list
            plan.append((req, n))
            budget -= n
            i += 1
        if self._parked:  # after the running ones: a leader preempted just now releases too
            self._release_parked()
        while r.waiting and budget > 0 and len(r.running) < self.max_seqs:
            head = r.waiting[0]
            hits = self._hits(head)
            join = self._joins(head, len(hits))
            if join is not None:  # wait for the leader's computation of the shared blocks
                r.waiting.popleft()
                self._parked.append((head, *join))
                self._join_base.setdefault(id(head), len(hits) * bs)
                continue
            if (base := self._join_base.pop(id(head), None)) is not None:
                self.joined_tokens += max(len(hits) * bs - base, 0)  # as the engine counts it
            if not self._admit(head, hits):
                break
            req = r.waiting.popleft()
            req.rank = r
            r.running.append(req)
            n = min(req.n_in - req.computed, budget)
            if n <= 0:  # whole prompt cached: the engine still recomputes its last token
                req.computed, n = req.n_in - 1, 1
            plan.append((req, n))
            budget -= n
        if not plan:
            self.busy = False
            return
        pre = [(n, q.computed) for q, n in plan if q.computed < q.n_in]
        dec = [q for q, n in plan if q.computed >= q.n_in]
        # Our engine's decode attention runs one SDPA per group of similar contexts, each over
        # a block table padded to the group's longest (kv/decode_groups.py): it reads
        # sum(group size x its longest), not the sum of contexts; decodes that share a prefix
        # (same block hashes: a sub-agent burst) read it once first, in whole engine blocks.
        # Calibration decodes equal contexts sharing nothing (one group), where all agree.
        ctx = float(read_keys([q.hashes for q in dec], [q.n_in + q.out_done for q in dec], bs,
                              shared_floor=self.engine_block))
        if self.perf.linear:
            dt = self.perf.measured_step(pre, ctx, len(dec))
        else:
            dt = (self.perf.prefill_step([pre]) if pre else 0.0) + (
                self.perf.decode_step([[q.n_in + q.out_done for q in dec]], 0) if dec else 0.0)
        if self.req_trace is not None:
            for q, _ in plan:
                stamps = self.req_trace.get(q.rec.request_id)
                if stamps is not None and "sched" not in stamps:
                    stamps["sched"], stamps["hit"] = self.clock.now, q.cached
        if self.trace is not None:
            self.trace.append({"t": self.clock.now, "dt": dt, "pre": pre,
                               "dec": [q.n_in + q.out_done for q in dec]})
        self._owed = 0.0
        self._run(dt, lambda: self._end(plan))

    def _end(self, plan: list[tuple[SimRequest, int]]) -> None:
        """The step's end, unless requests that arrived during it owe it time
        (`arrival_stretch`): then it ends that much later, and what arrives meanwhile adds."""
        owed = self._owed
        if owed > 0:
            self._owed = 0.0
            self.busy_s += owed
            self._busy_end = self.clock.now + owed
            self.clock.at(self._busy_end, lambda: self._end(plan))
            return
        self._done(plan)

    def _done(self, plan: list[tuple[SimRequest, int]]) -> None:
        r, bs, now = self.rank, self.rank.pool.block_size, self.clock.now
        for req, n in plan:
            if req.rank is not r or req not in r.running:
                continue  # preempted during planning of this step
            rec = req.rec
            if req.computed < req.n_in:
                before = req.computed // bs
                req.computed += n
                cache_computed(r.pool, req, before, req.computed // bs)
                if req.computed < req.n_in:
                    continue
                self.inflight.drop(req.uid)
            req.out_done += 1
            rec.chunk_times.append(now - rec.start)
            rec.chunk_tokens.append(1)
            if rec.ttft is None:
                rec.ttft = now - rec.start
                if self.req_trace is not None and rec.request_id in self.req_trace:
                    self.req_trace[rec.request_id]["tok"] = now
                if self.on_first is not None:
                    self.on_first(req)
            if req.out_done >= req.n_out:
                r.running.remove(req)
                r.pool.free(list(reversed(req.blocks)))
                req.blocks = []
                rec.cached_tokens = req.cached
                rec.e2e, rec.output_tokens = now - rec.start, req.out_done
                req.on_done(req)
        self.busy = False
        self._step()
