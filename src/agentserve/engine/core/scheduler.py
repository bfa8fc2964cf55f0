"""Continuous batching with chunked prefill under a per-step token budget.

Each step (vLLM v1 style, no separate prefill/decode phases):
1. running sequences first, in arrival order: each gets the tokens it still needs
   (1 for a decode, a chunk for an unfinished prefill) within the budget; when
   the pool is full the newest running sequence is preempted (recompute) until
   the older one fits — never a crash;
2. then waiting sequences, strictly FCFS (the head blocks the queue, so nothing
   starves): prefix-cache hit first, then a chunk of the rest.

How a waiting head gets KV from elsewhere instead of computing it (restored from the CPU
and disk tiers, pulled from a P/D prefill engine, or brought in by another request in
flight) is ``engine/core/kvwait.py``: ``Scheduler.kv_waits``, a ``KVWaits`` sharing its queues.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from agentserve.engine.core.kvwait import KVWaits
from agentserve.engine.core.request import RequestStatus
from agentserve.engine.core.sequence import Sequence
from agentserve.kv.inflight import InflightPrefill
from agentserve.kv.remote.client import RemoteKV
from agentserve.kv.offload.connector import TierConnector
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
    # flight that was computing the same prefix (``kv/inflight.py``)
    prefix_joined_tokens: int = 0


class Scheduler:
    """Decides, per step, which sequences run and how many tokens each computes."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 tiers: TierConnector | None = None, remote: RemoteKV | None = None,
                 long_prefill_token_threshold: int = 0) -> None:
        self.kv = kv
        self.tiers = tiers
        self.remote = remote
        self.inflight: InflightPrefill[Sequence] = InflightPrefill(
            kv.block_size, computing=lambda s: s.status == RequestStatus.RUNNING)
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
        self._failed: list[tuple[Sequence, str]] = []  # ended in _fail (e.g. from kv_waits)
        # restores, pulls and heads parked behind another request's KV (``kvwait.py``)
        self.kv_waits = KVWaits(kv, self.waiting, self.running, self.stats, self.inflight,
                                self._fail, tiers, remote)

    # What waits in ``kv_waits`` (WAITING_FOR_KV), read here, by the engine loop and tests.
    @property
    def loading(self) -> dict[str, Sequence]:
        """Restores in flight, by request id."""
        return self.kv_waits.loading

    @property
    def pulling(self) -> dict[str, Sequence]:
        """Remote pulls in flight, by request id."""
        return self.kv_waits.pulling

    @property
    def joined(self) -> dict[str, list[Sequence]]:
        """Heads parked behind another request (the key) restoring, pulling or computing
        the prefix they share."""
        return self.kv_waits.joined

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
        return len(self.waiting) + len(self.loading) + len(self.pulling) + self.kv_waits.num_parked

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.pulling or self._failed
                    or self.joined or (self.tiers is not None and self.tiers.busy))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.tiers is not None:
            self.kv_waits.finish_loads(self.tiers.poll())
        if self.remote is not None:
            self.kv_waits.finish_pulls(self.remote.poll())
        if self.inflight:
            self.inflight.prune()
        self.kv_waits.release_computed()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # a full pool admits nobody new this step
            self._schedule_waiting(out, budget)
        out.num_tokens = sum(s.num_tokens for s in out.scheduled)
        if self.tiers is not None:
            for s in out.scheduled:
                if s.completes_prompt:
                    self.tiers.audit.on_first_token(s.seq)
        out.failed, self._failed = self._failed, []  # last: nothing after it may raise
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk_cap)
            room = self._allocate_or_fail(seq, n)
            while room is False:
                victim = self.running.pop()  # newest first
                self._preempt_or_fail(victim, out)
                if victim is seq:
                    return budget
                room = self._allocate_or_fail(seq, n)
            if room is None:
                continue  # it failed and left `running`: the next one is at slot i now
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _allocate_or_fail(self, seq: Sequence, n: int) -> bool | None:
        """``allocate_slots`` for a running sequence; None when it raised (``seq`` failed)."""
        try:
            return self.kv.allocate_slots(seq, n)
        except Exception as exc:  # noqa: BLE001 - one request's bug must not fail the step
            self._fail(seq, "could not allocate KV for the request", exc)
            return None

    def _preempt_or_fail(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Preempt ``victim`` (popped from running); if that raises it ends, not vanishes."""
        try:
            self._preempt(victim)
            out.preempted.append(victim)
        except Exception as exc:  # noqa: BLE001 - one request's bug must not fail the step
            self._fail(victim, "could not preempt the request", exc)

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
        # A request scoring its prompt (prompt logprobs) computes every position itself: no
        # cache hit, restore, pull or join (as vLLM's skip_reading_prefix_cache)
        reads = not seq.wants_prompt_logprobs
        computed = self.kv.get_computed_blocks(seq) if reads else []
        num_cached = len(computed) * self.kv.block_size
        if reads and self.kv.enable_caching and (join := self.inflight.joins(seq, len(computed))):
            self.kv_waits.park_behind_computation(seq, join[0], join[1], num_cached)
            return 0
        self.kv_waits.count_joined(seq, num_cached)  # counted as it is realized
        started: bool | None = False  # True: parked while its KV arrives; None: must wait
        # The local tiers go first, also for a P/D decode leg: what its own CPU tier holds
        # comes back over PCIe instead of the network (when the measured bandwidths say that
        # is faster than pulling it), and the pull then starts past it.
        if reads and self.tiers is not None and not seq.kv_restore_failed:
            started = self.kv_waits.try_restore(seq, computed)
        if reads and started is False and self.kv_waits.pull_pending(seq):
            started = self.kv_waits.try_pull(seq, computed)
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
            by = KVWaits.by_tier(seq, num_cached)
            self.stats.device_hits_tokens += by["gpu"]
            seq.cached_by_tier = by
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n))
        return n

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
        """Remove a sequence (finished or aborted) and free its blocks. Never raises for a
        hook's sake: a request whose release or tier hook breaks still leaves every queue
        and frees its blocks (else its caller would never get its last output)."""
        seq.status = status
        if self.remote is not None and seq.kv_transfer and seq.kv_transfer.get("do_remote_prefill"):
            self._hook(seq, self.remote.release_remote, seq)  # a decode leg that never pulled
        if self.tiers is not None:
            self._hook(seq, self.tiers.on_finish, seq)
            if seq.request_id in self.loading:
                return  # a load is writing its blocks: freed when the load completes
        self.inflight.drop(seq.request_id)
        self.kv_waits.forget(seq)
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

    @staticmethod
    def _hook(seq: Sequence, fn, *args) -> None:
        """Run one of ``finish``'s bookkeeping hooks; a bug in it is logged, not raised."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - the blocks must still be freed below
            log.exception("request %s: finishing hook %s failed", seq.request_id,
                          getattr(fn, "__name__", fn))

    def drop(self, seq: Sequence) -> None:
        """Last resort when ``finish`` raised: ``seq`` leaves every queue; its blocks are
        freed unless a restore or pull is writing them (then that one's end frees them)."""
        for q in (self.waiting, self.running):
            if seq in q:
                q.remove(seq)
        self.kv_waits.unpark(seq)
        if seq.request_id not in self.loading and seq.request_id not in self.pulling:
            self.kv.free(seq)
