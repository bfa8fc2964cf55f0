"""Continuous batching with chunked prefill under a per-step token budget.

Each step (vLLM v1 style, no separate prefill/decode phases):
1. running sequences first, in arrival order: each gets the tokens it still needs
   (1 for a decode, a chunk for an unfinished prefill) within the budget; when
   the pool is full the newest running sequence is preempted (recompute) until
   the older one fits — never a crash;
2. then waiting sequences, strictly FCFS (the head blocks the queue, so nothing
   starves): prefix-cache hit first, then a chunk of the rest.

With offload tiers (``tiers``), a waiting head whose prefix continues in CPU/disk and
for which restoring beats recomputing takes its device blocks, starts an asynchronous
load and parks in ``loading`` (WAITING_FOR_KV) so the queue moves on; finished loads
join ``running`` with their restored tokens computed. A failed load recomputes.

With P/D transfer (``remote``), a decode leg (``kv_transfer_params.do_remote_prefill``)
does the same with blocks pulled from a prefill engine: it parks in ``pulling`` while
the ``kv-pull`` thread copies the blocks it lacks; a failed pull recomputes. With both, a
decode leg restores its own tiers' hit first, then pulls only what lies past it.

A head whose next uncached blocks another request is bringing in right now (computing
them: ``engine/inflight.py``; restoring or pulling them: ``TierConnector.joins``,
``RemoteKV.joins``) parks in ``joined`` until that is done, then hits them in the prefix
cache instead of computing, restoring or pulling the same blocks a second time.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from agentserve.engine.inflight import InflightPrefill
from agentserve.engine.request import RequestStatus
from agentserve.engine.sequence import Sequence
from agentserve.engine.transfer import PullDone, RemoteKV
from agentserve.kv.connector import TierConnector
from agentserve.kv.manager import KVCacheManager

log = logging.getLogger("agentserve.engine")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the end of the known tokens (logits needed)."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # waiting requests that failed to schedule (a bug or a broken tier): they end alone
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerStats:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0  # every cached prompt token, all tiers: what usage reports
    device_hits_tokens: int = 0  # of which found in the device tier
    num_preemptions: int = 0
    restored_tokens: int = 0
    # prompt tokens a request did not compute because it waited for another request in
    # flight that was computing the same prefix (``engine/inflight.py``)
    prefix_joined_tokens: int = 0


class Scheduler:
    """Decides, per step, which sequences run and how many tokens each computes."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 tiers: TierConnector | None = None, remote: RemoteKV | None = None,
                 long_prefill_token_threshold: int = 0) -> None:
        self.kv = kv
        self.tiers = tiers
        self.remote = remote
        self.pulling: dict[str, Sequence] = {}  # WAITING_FOR_KV: remote pulls in flight
        self.loading: dict[str, Sequence] = {}  # WAITING_FOR_KV: restores in flight
        # WAITING_FOR_KV: heads parked until another request (the key) has restored, pulled
        # or computed the prefix they share; then they return to the queue head
        self.joined: dict[str, list[Sequence]] = {}
        self._join_need: dict[str, int] = {}  # parked behind a computation: tokens it needs
        self.inflight = InflightPrefill(kv.block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # vLLM's long_prefill_token_threshold: a prefill chunk is at most this many tokens,
        # so a 24K-token cold prompt does not take every step's whole budget while the
        # requests behind it (short turns over cached prefixes) wait (0: off)
        self.chunk_cap = long_prefill_token_threshold if long_prefill_token_threshold > 0 \
            else max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._failed: list[tuple[Sequence, str]] = []  # ended in _finish_loads/_pulls

    def add(self, seq: Sequence) -> None:
        """Queue a new request; if the tier hooks raise, it is not queued at all."""
        if self.tiers is not None:
            self.kv.update_hashes(seq)
            self.tiers.on_add(seq)
        self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        """Requests admitted to no step yet, as vLLM counts them in
        ``vllm:num_requests_waiting``: the queue, and those waiting for their KV (restores,
        pulls, parked behind another request's). Read from the scrape thread too."""
        parked = sum(len(v) for v in list(self.joined.values()))  # list(): one atomic copy
        return len(self.waiting) + len(self.loading) + len(self.pulling) + parked

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.pulling or self._failed
                    or self.joined or (self.tiers is not None and self.tiers.busy))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.tiers is not None:
            self._finish_loads(self.tiers.poll())
        if self.remote is not None:
            self._finish_pulls(self.remote.poll())
        if self.inflight:
            self.inflight.prune()
        if self._join_need:
            self._release_computed()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # a full pool admits nobody new this step
            self._schedule_waiting(out, budget)
        out.failed, self._failed = self._failed, []
        out.num_tokens = sum(s.num_tokens for s in out.scheduled)
        if self.tiers is not None:
            for s in out.scheduled:
                if s.completes_prompt:
                    self.tiers.audit.on_first_token(s.seq)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk_cap)
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) + len(self.loading) + len(self.pulling) < self.max_num_seqs):
            seq = self.waiting[0]
            try:
                used = self._admit_head(seq, out, budget)
            except Exception as exc:  # noqa: BLE001 - the head alone fails, the queue moves on
                # Left at the head it would fail the same way every step, for ever.
                self._fail(seq, "could not schedule the request", exc)
                continue
            if used is None:
                break  # FCFS: the head waits (memory, backpressure); nobody overtakes it
            budget -= used

    def _fail(self, seq: Sequence, what: str, exc: Exception) -> None:
        """``seq`` hit a bug: it leaves the queues and ends alone, with an error, in this
        schedule's output (or the next one's, when this runs between schedules); ``finish``
        then frees its blocks (at once, or when a load or pull writing into them ends)."""
        log.exception("request %s: %s", seq.request_id, what)
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        self._failed.append((seq, f"{what}: {exc!r}"))

    def _admit_head(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Admit the queue head: the tokens it takes from ``budget`` (0 when it went to
        load its KV), or None when it has to wait."""
        fresh = seq.num_cached_tokens < 0
        computed = self.kv.get_computed_blocks(seq)
        num_cached = len(computed) * self.kv.block_size
        if self.kv.enable_caching and (join := self.inflight.joins(seq, len(computed))):
            self.stats.prefix_joined_tokens += join[1] - num_cached
            self._join_need[seq.request_id] = join[1]
            self._park(seq, join[0])
            return 0
        started: bool | None = False  # True: parked while its KV arrives; None: must wait
        # The local tiers go first, also for a P/D decode leg: what its own CPU tier holds
        # comes back over PCIe instead of the network (when the measured bandwidths say that
        # is faster than pulling it), and the pull then starts past it.
        if self.tiers is not None and not seq.kv_restore_failed:
            started = self._try_restore(seq, computed)
        if started is False and self._pull_pending(seq):
            started = self._try_pull(seq, computed)
        if started is None:
            return None  # backpressure or no room: the head waits
        if started:
            return 0
        n = min(seq.num_tokens - num_cached, budget, self.chunk_cap)
        if not self.kv.allocate_slots(seq, n, computed):
            return None
        self.waiting.popleft()
        if self.tiers is not None:
            self.tiers.audit.trace_admit(seq, len(computed), 0)
        seq.num_computed_tokens = num_cached
        if self.kv.enable_caching:
            self.inflight.add(seq, len(computed))
        if fresh:  # count a prompt once, as the client sees it in usage.cached_tokens
            seq.num_cached_tokens = num_cached
            self.stats.prefix_queries_tokens += seq.num_prompt_tokens
            self.stats.prefix_hits_tokens += num_cached
            by = self._by_tier(seq, num_cached)
            self.stats.device_hits_tokens += by["gpu"]
            seq.cached_by_tier = by
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n))
        return n

    def _try_restore(self, seq: Sequence, computed: list) -> bool | None:
        """Start restoring the head's tier hit: True started (or parked behind a restore
        in flight that brings back the same prefix), False not worth it, None wait."""
        assert self.tiers is not None
        join = self.tiers.joins(seq, len(computed))
        if join is not None and join[0] in self.loading:
            self.tiers.stats.restore_joined_blocks += join[1] * self.tiers.k
            return self._park(seq, join[0])
        pull_s = self.remote.pull_s if self._pull_pending(seq) else None
        plan = self.tiers.plan(seq, len(computed), pull_s)
        if plan is None:
            return False
        if len(self.tiers.loads) >= self.tiers.cfg.max_loads:
            return None
        self.tiers.pin(plan)
        room = False
        try:
            room = self.kv.allocate_slots(seq, plan.num_blocks * self.kv.block_size, computed)
        finally:
            if not room:
                self.tiers.unpin(plan)
        if not room:
            return None
        self.waiting.popleft()
        seq.status = RequestStatus.WAITING_FOR_KV
        seq.device_hit_tokens = len(computed) * self.kv.block_size
        ids = self.kv.block_ids(seq.request_id)
        self.tiers.audit.trace_admit(seq, len(computed), plan.num_blocks)
        self.tiers.start_load(seq, plan, ids[plan.first_block:plan.first_block + plan.num_blocks])
        self.loading[seq.request_id] = seq
        return True

    def _park(self, seq: Sequence, leader: str) -> bool:
        """The head waits, out of the queue, for ``leader``'s restore, pull or computation
        of the prefix they share (``_release_joined`` requeues it when a restore or pull
        ends; ``_release_computed`` once the computation has covered its blocks)."""
        self.waiting.popleft()
        seq.status = RequestStatus.WAITING_FOR_KV
        self.joined.setdefault(leader, []).append(seq)
        return True

    def _release_computed(self) -> None:
        """Requeue the heads parked behind a computation that has now covered their shared
        blocks (or whose leader left ``running``), keeping their order."""
        back: list[Sequence] = []
        for leader in [r for r in self.joined if r not in self.loading and r not in self.pulling]:
            parked = self.joined[leader]
            for s in [s for s in parked
                      if self.inflight.ready(leader, self._join_need.get(s.request_id, 0))]:
                parked.remove(s)
                self._join_need.pop(s.request_id, None)
                back.append(s)
            if not parked:
                del self.joined[leader]
        for s in reversed(back):
            s.status = RequestStatus.WAITING
            self.waiting.appendleft(s)

    def _release_joined(self, leader: str) -> None:
        """Those parked behind ``leader``'s restore or pull go back to the head, in their
        order: its blocks are device-cached now (or, if it failed, they plan their own)."""
        for s in reversed(self.joined.pop(leader, [])):
            self._join_need.pop(s.request_id, None)
            s.status = RequestStatus.WAITING
            self.waiting.appendleft(s)

    def _finish_loads(self, done: list) -> None:
        """Restored requests join ``running``; failed ones recompute from the queue head."""
        for d in done:
            seq = self.loading.pop(d.request_id, None)
            if seq is not None:
                self._guarded(seq, self._finish_load, seq, d)
            self._release_joined(d.request_id)

    def _finish_load(self, seq: Sequence, d) -> None:
        first = seq.num_cached_tokens < 0
        admitted = self._admit_loaded(seq, d.ok, d.plan.num_blocks if d.ok else 0)
        self.tiers.audit.account(seq, d.plan, d.ok, admitted)
        if admitted:
            if first:
                seq.cached_by_tier = {"gpu": seq.device_hit_tokens, **d.plan.tokens_by_tier}
            self.stats.restored_tokens += d.plan.num_blocks * self.kv.block_size
        elif not d.ok and not seq.status.finished:
            seq.kv_restore_failed = True

    def _pull_pending(self, seq: Sequence) -> bool:
        """A P/D decode leg that may still pull its prompt's KV from the prefill engine."""
        return (seq.kv_transfer is not None and self.remote is not None
                and not seq.kv_pull_failed and bool(seq.kv_transfer.get("do_remote_prefill")))

    @staticmethod
    def _by_tier(seq: Sequence, cached: int, pulled: int = 0) -> dict[str, int]:
        """Split of a first admission's ``cached`` tokens by where they came from: a
        decode leg that restored from its local tiers before pulling carries that restore's
        split (``cached_by_tier``, set when the restore ended); the device holds the rest."""
        by = {t: n for t, n in (seq.cached_by_tier or {}).items() if t != "gpu"}
        by["gpu"] = max(0, cached - pulled - sum(by.values()))
        if pulled:
            by["remote"] = pulled
        return by

    def _guarded(self, seq: Sequence, fn, *args) -> None:
        """Run ``fn``; if it raises, ``seq`` ends alone with an error (``_fail``) rather
        than wait in ``loading``/``pulling`` for an output that never comes."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - one request's bug must not strand it
            self._fail(seq, "could not admit the request after its KV arrived", exc)

    def _admit_loaded(self, seq: Sequence, ok: bool, num_blocks: int) -> bool:
        """A request whose KV arrived (restore or pull) joins ``running``, its loaded blocks
        counted as computed and cached; on failure it goes back to the queue head to
        recompute. Returns True when admitted."""
        if seq.status.finished:  # aborted while loading: its blocks were busy until now
            self.kv.free(seq)
            return False
        if not ok:
            self.kv.free(seq)
            seq.status = RequestStatus.WAITING
            self.waiting.appendleft(seq)
            return False
        seq.num_computed_tokens = seq.device_hit_tokens + num_blocks * self.kv.block_size
        self.kv.cache_blocks(seq)  # loaded blocks are device-cached again
        if self._pull_pending(seq):  # (a pull clears kv_transfer when it starts)
            # A decode leg restored its local tier hit: back to the head, its restored blocks
            # device-cached (freed tails last, so nothing evicts them first), to pull the rest
            # past them; usage is counted once it is admitted for good.
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = RequestStatus.WAITING
            self.waiting.appendleft(seq)
            return True
        if seq.num_cached_tokens < 0:  # as vLLM: externally loaded tokens count as cached
            seq.num_cached_tokens = seq.num_computed_tokens
            self.stats.prefix_queries_tokens += seq.num_prompt_tokens
            # Restored / pulled tokens are reported as cached, so they count as hits too:
            # hits / queries then equals the clients' cached-token ratio.
            self.stats.prefix_hits_tokens += seq.num_cached_tokens
            self.stats.device_hits_tokens += seq.cached_by_tier["gpu"] if seq.cached_by_tier \
                else seq.device_hit_tokens
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        return True

    def _try_pull(self, seq: Sequence, computed: list) -> bool | None:
        """Start pulling the head's missing blocks (``_pull_pending``): True started, False
        none, None wait."""
        assert self.remote is not None
        join = self.remote.joins(seq, len(computed))
        if join is not None and join[0] in self.pulling:
            self.remote.stats.blocks_joined += join[1]
            return self._park(seq, join[0])
        spec = self.remote.plan(seq, len(computed))
        if spec is None:
            return False
        if len(self.pulling) >= self.remote.cfg.max_pulls:
            return None
        if not self.kv.allocate_slots(seq, len(spec.idx) * self.kv.block_size, computed):
            return None
        self.waiting.popleft()
        seq.status = RequestStatus.WAITING_FOR_KV
        seq.device_hit_tokens = len(computed) * self.kv.block_size
        ids = self.kv.block_ids(seq.request_id)[len(computed):len(computed) + len(spec.idx)]
        self.remote.start_pull(seq, spec, ids)
        self.pulling[seq.request_id] = seq
        return True

    def _finish_pulls(self, done: list[PullDone]) -> None:
        """Pulled requests join ``running`` (blocks registered as cached); failures recompute."""
        for d in done:
            seq = self.pulling.pop(d.request_id, None)
            if seq is not None:
                self._guarded(seq, self._finish_pull, seq, d)
            self._release_joined(d.request_id)

    def _finish_pull(self, seq: Sequence, d: PullDone) -> None:
        first = seq.num_cached_tokens < 0
        if self._admit_loaded(seq, d.ok, d.num_blocks if d.ok else 0):
            if first:
                seq.cached_by_tier = self._by_tier(seq, seq.num_cached_tokens,
                                                   d.num_blocks * self.kv.block_size)
        elif not d.ok and not seq.status.finished:
            seq.kv_pull_failed = True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.inflight.drop(seq.request_id)
        self.kv.free(seq)
        if self.tiers is not None:
            self.tiers.audit.on_preempt(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        seq.status = status
        if self.remote is not None and seq.kv_transfer and seq.kv_transfer.get("do_remote_prefill"):
            self.remote.release_remote(seq)  # a decode leg that never pulled its blocks
        if self.tiers is not None:
            self.tiers.on_finish(seq)
            if seq.request_id in self.loading:
                return  # a load is writing its blocks: freed when the load completes
        self.inflight.drop(seq.request_id)
        self._join_need.pop(seq.request_id, None)
        for leader, parked in list(self.joined.items()):
            if seq in parked:
                parked.remove(seq)  # it holds no blocks yet
                if not parked:  # (else has_work would stay true for it)
                    del self.joined[leader]
        if seq.request_id in self.pulling:
            return  # a pull is writing its blocks: freed when the pull completes
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq)
