"""Decode instance: continuous batching with MTP, stepped by events per request, not per token.

Every running request takes part in every step (continuous batching), so a request's whole
future is known when it is admitted: its MTP acceptances are drawn at once (position i of a
step is accepted with probability `MTP_ACCEPT[i]`, one uniform per step as `mtp_accepted`;
the first step of a segment has no drafts yet and yields one token),
which fixes the step it finishes on and the steps on which it needs a new 64-token block.
The instance then touches a request only at those events (~1 in 20 steps, MTP on) instead
of every step; the step time comes from per-rank sums kept up to date at each event
(`PerfModel.decode_step_agg`), exact to one block of context (<0.2% of a 47K-token prompt).

Semantics are those of a per-step loop: blocks are allocated by the real pool when the next
step's `context + 1 + drafts` tokens no longer fit; when a rank runs out, its newest request
is preempted (vLLM's order), frees its blocks and waits at the queue head; on re-admission it
recomputes the KV it lost (prompt and output so far, less the prefix blocks still cached) on
this instance, as vLLM's recompute preemption does (the prefill side has released its copy):
a prefill that stretches the instance's next step (`PerfModel.recompute_time`). A request's
chunk times are the ends of the steps it took part in. A P/D request's KV pull follows vLLM's
NIXL decode side (`receive`): started at a step's schedule, found done after a step's forward,
and both seen a step later by a rank with requests, whose async scheduling has planned the next
step before it reads its input or a step's output.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from agentserve.kv.manager import cdiv
from agentserve.sim.cluster import (
    Clock,
    Rank,
    SimRequest,
    _bisect_prefix,
    cache_computed,
    fits,
)
from agentserve.sim.constants import MTP_ACCEPT
from agentserve.sim.perf import PerfModel
from agentserve.sim.pools import Instance, planned_after

_NEVER = 1 << 62  # a step number past any run: "everything pending"


class DecodeInstance(Instance):
    """A DEPn decode instance; `k` counts steps, `ends[j]` is when step j ended."""

    def __init__(self, clock: Clock, perf: PerfModel, ranks: list[Rank], batch_tokens: int,
                 rng: np.random.Generator) -> None:
        """`batch_tokens`: each rank's max_num_batched_tokens (= max_num_seqs); a request
        takes 1 + drafts of them per step, so a rank runs at most batch_tokens // (1 + drafts)
        requests; the rest wait in its queue (vLLM admits a waiting request only while the
        step's token budget lasts)."""
        super().__init__(clock, perf, ranks)
        self.rng = rng
        self.draft = perf.mtp_draft if perf.topo.mtp else 0
        self.q = 1 + self.draft  # query tokens per request per step
        self.max_seqs = max(1, batch_tokens // self.q)
        self.accept = np.array(MTP_ACCEPT[: self.draft])
        self.preemptions = 0
        self.k = 0
        self.ends: list[float] = []
        self.grow_at: dict[int, list[tuple[SimRequest, int]]] = defaultdict(list)
        self.finish_at: dict[int, list[tuple[SimRequest, int]]] = defaultdict(list)
        self.load = {r.idx: [0, 0.0, 0.0] for r in ranks}  # requests, rows, indexer keys
        self.recompute: dict[int, list[tuple[int, int]]] = {}  # rank -> (new, prefix) chunks
        # rank -> (queue head that did not fit, free blocks then). It fits when F = new blocks
        # + free hits - free blocks <= 0. Admission is FIFO, so while the head waits nothing
        # else is admitted or cached on the rank, and every other event lowers F by at most
        # what it adds to the free count (a freed block: -1 and +1; a hit touched by another
        # request: 0 and -1; an allocation, evicting hits or not: >= +k and -k). So the head
        # cannot fit before the free count exceeds its value at the failure: the retry (a
        # prefix match and a scan of the hits, every step) is skipped until then, same outcome.
        self.blocked: dict[int, tuple[SimRequest, int]] = {}
        self.recomputed_tokens = 0
        # prompt tokens of received requests, and those the rank already held (not pulled):
        # the decode-local prefix hit rate the reference reports (vLLM's prefix-cache counters)
        self.queried_tokens = self.local_hit_tokens = 0
        # P->D pulls as vLLM's NIXL decode side runs them: a request that reaches the instance
        # waits for the schedule of the first step that sees it to start its READ (`incoming`:
        # (seen step, request, transfer s, posting s, pulled callback)); the worker finds the
        # READ done after a step's forward (`get_finished`; `pulling`: (done at, request,
        # pulled)) and the request joins its rank's queue at the first step whose plan reads
        # that step's output (`landing`: (seen step, request)). Under async scheduling (vLLM's
        # default) a rank with requests has planned the next step before it reads its input
        # or a step's output (`pools.planned_after`).
        self.incoming: list[tuple[int, SimRequest, float, float, Callable[[], None]]] = []
        self.pulling: list[tuple[float, SimRequest, Callable[[], None]]] = []
        self.landing: list[tuple[int, SimRequest]] = []
        # The worker that pulls posts the READ descriptors on its own thread (transfer.py,
        # `NIXL_POST_S`): rank -> when its posting is done. A step cannot end on a rank before
        # that, and the lockstep instance waits for its slowest rank.
        self.post_until: dict[int, float] = {}
        self.post_stall_s = 0.0  # step time the posting added (diagnostic)

    def local_prefix(self, r: Rank, req: SimRequest) -> int:
        """Prompt tokens this rank already holds (so need not be pulled); by bisection, as the
        router's view (held blocks form a prefix: a request's blocks are freed tail first)."""
        n = req.head_blocks(r.pool.block_size)
        return _bisect_prefix(r.pool.cached, req.hashes, 0, n) * r.pool.block_size

    # -- per-request bookkeeping ---------------------------------------------------------------
    def _out_before(self, req: SimRequest, step: int) -> int:
        """Output tokens the request holds before step `step` of its current segment."""
        j = step - req.seg_start
        return req.seg_out0 + (int(req.cum[j - 1]) if j > 0 else 0)

    def _sync(self, r: Rank, req: SimRequest, ctx: int | None) -> None:
        """Replace the request's contribution to the rank's sums (ctx None: remove it)."""
        ld = self.load[r.idx]
        ld[1] -= req.f_rows
        ld[2] -= req.f_idx
        if ctx is None:
            ld[0] -= 1
            req.f_rows = req.f_idx = 0.0
            return
        req.f_rows, req.f_idx = self.perf.ctx_features(ctx)
        ld[1] += req.f_rows
        ld[2] += req.f_idx

    def _schedule_grow(self, req: SimRequest) -> None:
        """Next step whose `ctx + q` tokens overflow the blocks held, if before the finish."""
        bs = self.ranks[0].pool.block_size
        room = len(req.blocks) * bs - req.n_in - self.q - req.seg_out0  # output tokens that fit
        j = int(np.searchsorted(req.cum, room, side="right")) + 1  # first step over the room
        if j < len(req.cum):
            self.grow_at[req.seg_start + j].append((req, req.gen))

    def _admit(self, r: Rank, req: SimRequest) -> bool:
        """Prefix hits + room for the next step; draw the segment's acceptances; schedule events."""
        bs = r.pool.block_size
        hits = r.pool.match_prefix(req.hashes[: req.head_blocks(bs)])
        need = cdiv(req.n_in + req.out_done + self.q, bs) - len(hits)
        if not fits(r.pool, hits, need):
            return False
        r.pool.touch(hits)
        req.blocks = hits + r.pool.allocate(need)
        req.computed = req.n_in
        if req.preempted:  # lost KV is recomputed here, in the next step
            cached = len(hits) * bs
            lost = req.n_in + req.out_done - cached
            self.recompute.setdefault(r.idx, []).append((lost, cached))
            self.recomputed_tokens += lost
            req.preempted = False
        if req.t_dadmit < 0:
            req.t_dadmit = self.clock.now
        cache_computed(r.pool, req, len(hits), req.n_in // bs)
        rem = req.n_out - req.out_done
        u = self.rng.random(rem)
        acc = 1 + (u[:, None] < self.accept[None, :]).sum(axis=1) if self.draft else np.ones(rem, int)
        # The segment's first step has no drafts to verify: they are proposed from the target
        # model's hidden state of the last token, which this instance computes in that step
        # (vLLM's decode leg recomputes the last prompt token and samples the first token
        # itself; a preempted request re-prefills). So it yields one token, then ~2.95 a step.
        # (The step time still counts 1 + draft query rows for it: one step's overcount.)
        acc[0] = 1
        cum = np.cumsum(acc)
        steps = int(np.searchsorted(cum, rem)) + 1  # first step whose total reaches rem
        cum = cum[:steps]
        cum[-1] = rem  # the last step stops at max_tokens
        req.cum, req.seg_start, req.seg_out0 = cum, self.k, req.out_done
        req.gen += 1
        self.finish_at[self.k + steps - 1].append((req, req.gen))
        self._schedule_grow(req)
        self.load[r.idx][0] += 1
        self._sync(r, req, req.n_in + req.out_done)
        return True

    def _record(self, req: SimRequest, upto: int) -> None:
        """Chunk records for the segment's steps before `upto`; out_done follows them."""
        j = upto - req.seg_start
        if j <= 0:
            return
        rec, t0 = req.rec, req.rec.start
        cum = req.cum[:j].tolist()
        rec.chunk_times.extend(t - t0 for t in self.ends[req.seg_start:upto])
        rec.chunk_tokens.extend([cum[0]] + [b - a for a, b in zip(cum, cum[1:])])
        if rec.ttft is None:
            rec.ttft = rec.chunk_times[0]
        req.out_done = req.seg_out0 + cum[-1]

    def _preempt(self, r: Rank) -> SimRequest:
        """Free the rank's newest request and put it back at the queue head (vLLM's order)."""
        victim = r.running.pop()
        self._record(victim, self.k)
        victim.gen += 1  # its scheduled events are stale now
        self._sync(r, victim, None)
        r.pool.free(list(reversed(victim.blocks)))
        victim.blocks = []  # recomputed on re-admission
        victim.preempted = True
        r.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def _grow(self, req: SimRequest, gen: int) -> None:
        """Take the blocks step `k` needs; preempt newest requests of the rank until they fit."""
        r = req.rank
        if gen != req.gen or r is None:
            return
        bs = r.pool.block_size
        ctx = req.n_in + self._out_before(req, self.k)
        need = cdiv(ctx + self.q, bs) - len(req.blocks)
        while need > r.pool.num_free_blocks:
            if self._preempt(r) is req:
                return
        if need > 0:
            req.blocks += r.pool.allocate(need)
        self._sync(r, req, ctx)
        self._schedule_grow(req)

    # -- P->D pulls --------------------------------------------------------------------------------
    def receive(self, req: SimRequest, transfer_s: float, pulled: Callable[[], None],
                post_s: float = 0.0) -> None:
        """`req` reached the instance, bound for its rank `req.d_rank`; its KV takes
        `transfer_s` to pull, and that rank's worker `post_s` to post the pull. `pulled` runs
        when the worker finds the pull done (the prefill side may free its copy); the request
        then joins its rank's queue. An idle instance starts the pull at once, finds it done
        when it is (its loop polls) and queues it at once; a stepping one starts it at the
        schedule of the first step that sees it, finds it done after a step's forward, and
        queues it for the first step that reads that step's output (`pools.planned_after`)."""
        assert req.d_rank is not None
        seen = self.k + planned_after(req.d_rank) if self.busy else self.k
        self.incoming.append((seen, req, transfer_s, post_s, pulled))
        if not self.busy:
            self._start_pulls(self.k)

    def _start_pulls(self, upto: int) -> None:
        """Start the READs of the requests steps up to `upto` have seen."""
        now, left = self.clock.now, []
        for item in self.incoming:
            seen, req, dt, post, pulled = item
            if seen > upto:
                left.append(item)
                continue
            self.pulling.append((now + dt, req, pulled))
            self.clock.at(now + dt, self._poll)
            if post > 0 and req.d_rank is not None:
                i = req.d_rank.idx
                self.post_until[i] = max(now, self.post_until.get(i, now)) + post
        self.incoming = left

    def _poll(self) -> None:
        """A pull's transfer time is up: an idle instance sees it now; a stepping one with
        its next step's output (`_done`)."""
        if not self.busy:
            self._land_pulls(False)
            self.kick()

    def _land_pulls(self, stepped: bool) -> None:
        """The worker finds the pulls done by now; each request joins its rank's queue at once
        (an idle instance's poll) or, after a step (`stepped`), at the first step that reads
        that step's output (`pools.planned_after`)."""
        now, left = self.clock.now, []
        for done_at, req, pulled in self.pulling:
            if done_at > now:
                left.append((done_at, req, pulled))
                continue
            pulled()
            if stepped:  # the step that ended was k - 1
                assert req.d_rank is not None
                self.landing.append((self.k - 1 + planned_after(req.d_rank), req))
            else:
                self._queue(req)
        self.pulling = left

    @staticmethod
    def _queue(req: SimRequest) -> None:
        """The pulled request joins its decode rank's queue."""
        assert req.d_rank is not None
        req.rank = req.d_rank
        req.d_rank.waiting.append(req)

    def _land_seen(self, upto: int) -> bool:
        """Queue the pulled requests the plans of steps up to `upto` see; True if any."""
        if not self.landing:
            return False
        now = [q for s, q in self.landing if s <= upto]
        self.landing = [(s, q) for s, q in self.landing if s > upto]
        for req in now:
            self._queue(req)
        return bool(now)

    # -- stepping ----------------------------------------------------------------------------------
    def _step(self) -> None:
        self._start_pulls(self.k)
        self._land_seen(self.k)
        for req, gen in self.grow_at.pop(self.k, ()):
            self._grow(req, gen)
        for r in self.ranks:
            while r.waiting and len(r.running) < self.max_seqs:
                req = r.waiting[0]
                blocked = self.blocked.get(r.idx)
                if blocked and blocked[0] is req and r.pool.num_free_blocks <= blocked[1]:
                    break  # no block freed since it last failed to fit (see `blocked`)
                if not self._admit(r, req):
                    self.blocked[r.idx] = (req, r.pool.num_free_blocks)
                    break
                self.blocked.pop(r.idx, None)  # a later failure of the same request is new
                r.waiting.popleft()
                req.rank = r
                r.running.append(req)
        loads = [self.load[r.idx] for r in self.ranks]
        if not any(ld[0] for ld in loads):
            self.busy = False
            # Nothing to run: the engine waits on its input and reads what is pending at once.
            self._start_pulls(_NEVER)
            if self._land_seen(_NEVER):
                self._step()  # once: nothing is left pending
            return
        dt = self.perf.decode_step_agg(loads, self.draft)
        if self.post_until:
            post = max(self.post_until.values()) - self.clock.now
            self.post_until = {}  # what is left runs under this step
            if post > dt:
                self.post_stall_s += post - dt
                dt = post
        if self.recompute:
            dt += self.perf.recompute_time([self.recompute.get(r.idx, []) for r in self.ranks])
            self.recompute = {}
        self._run(dt, self._done)

    def _done(self) -> None:
        now = self.clock.now
        self.ends.append(now)
        for req, gen in self.finish_at.pop(self.k, ()):
            if gen != req.gen:
                continue
            r = req.rank
            self._record(req, self.k + 1)
            r.running.remove(req)
            self._sync(r, req, None)
            r.pool.free(list(reversed(req.blocks)))
            req.blocks = []
            req.rec.e2e, req.rec.output_tokens = now - req.rec.start, req.out_done
            req.on_done(req)
        self.k += 1
        self._land_pulls(True)
        self.busy = False
        self._step()
