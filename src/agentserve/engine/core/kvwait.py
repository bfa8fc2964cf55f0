"""How a waiting head gets its KV from elsewhere instead of computing it (``KVWaits``, a
collaborator the ``Scheduler`` holds as ``kv_waits``; engine-core thread only).

With offload tiers (``tiers``), a waiting head whose prefix continues in CPU/disk and
for which restoring beats recomputing takes its device blocks, starts an asynchronous
load and parks in ``loading`` (WAITING_FOR_KV) so the queue moves on; finished loads
join ``running`` with their restored tokens computed. A failed load recomputes.

With P/D transfer (``remote``), a decode leg (``kv_transfer_params.do_remote_prefill``)
does the same with blocks pulled from a prefill engine: it parks in ``pulling`` while
the ``kv-pull`` thread copies the blocks it lacks; a failed pull recomputes. With both, a
decode leg restores its own tiers' hit first, then pulls only what lies past it.

A head whose next uncached blocks another request is bringing in right now (computing
them: ``kv/inflight.py``; restoring or pulling them: ``TierConnector.joins``,
``RemoteKV.joins``) parks in ``joined`` until that is done, then hits them in the prefix
cache instead of computing, restoring or pulling the same blocks a second time.

``KVWaits`` shares the scheduler's queue (``waiting``), ``running`` list, counters and
in-flight table (the same objects, never rebound): it takes heads off the queue and puts
admitted requests into ``running``; the scheduler reads ``loading``, ``pulling`` and
``joined`` to count and free what waits here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from agentserve.engine.core.request import RequestStatus
from agentserve.engine.core.sequence import Sequence
from agentserve.kv.inflight import InflightPrefill
from agentserve.kv.remote.client import PullDone, RemoteKV
from agentserve.kv.offload.connector import TierConnector
from agentserve.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from agentserve.engine.core.scheduler import SchedulerStats


class KVWaits:
    """Restores, pulls and parked heads of one scheduler's queue."""

    def __init__(self, kv: KVCacheManager, waiting: deque[Sequence], running: list[Sequence],
                 stats: SchedulerStats, inflight: InflightPrefill[Sequence],
                 fail: Callable[[Sequence, str, Exception], None],
                 tiers: TierConnector | None = None, remote: RemoteKV | None = None) -> None:
        self.kv, self.tiers, self.remote = kv, tiers, remote
        self.waiting, self.running, self.stats, self.inflight = waiting, running, stats, inflight
        self._fail = fail  # the scheduler's: ends one request alone
        self.pulling: dict[str, Sequence] = {}  # WAITING_FOR_KV: remote pulls in flight
        self.loading: dict[str, Sequence] = {}  # WAITING_FOR_KV: restores in flight
        # WAITING_FOR_KV: heads parked until another request (the key) has restored, pulled
        # or computed the prefix they share; then they return to the queue head
        self.joined: dict[str, list[Sequence]] = {}
        self._join_need: dict[str, int] = {}  # parked behind a computation: tokens it needs
        self._join_base: dict[str, int] = {}  # parked so: its device hit when it first parked

    @property
    def num_parked(self) -> int:
        """Heads parked behind another request's restore, pull or computation (read from
        the scrape thread too: ``list()`` takes one atomic copy)."""
        return sum(len(v) for v in list(self.joined.values()))

    def park_behind_computation(self, seq: Sequence, leader: str, need: int,
                                hit_tokens: int) -> None:
        """The head waits for ``leader``, in flight, to compute the ``need`` tokens of the
        prefix they share (``hit_tokens``: its device hit now; a re-park keeps the first)."""
        self._join_base.setdefault(seq.request_id, hit_tokens)
        self._join_need[seq.request_id] = need
        self.park(seq, leader)

    def count_joined(self, seq: Sequence, hit_tokens: int) -> None:
        """A head admitted after parking behind computations: what the waits added to its
        hit (``hit_tokens`` now) is counted once, however often it parked (a leader
        preempted or aborted hands over to a follower)."""
        if (base := self._join_base.pop(seq.request_id, None)) is not None:
            self.stats.prefix_joined_tokens += max(hit_tokens - base, 0)

    def unpark(self, seq: Sequence) -> None:
        """``seq`` leaves the heads parked behind another request (it holds no blocks yet)."""
        for leader, parked in list(self.joined.items()):
            if seq in parked:
                parked.remove(seq)
                if not parked:  # (else the scheduler's has_work would stay true for it)
                    del self.joined[leader]

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: no parking, and no wait for a computation, is left for it."""
        self._join_need.pop(seq.request_id, None)
        self._join_base.pop(seq.request_id, None)
        self.unpark(seq)

    def try_restore(self, seq: Sequence, computed: list) -> bool | None:
        """Start restoring the head's tier hit: True started (or parked behind a restore
        in flight that brings back the same prefix), False not worth it, None wait."""
        assert self.tiers is not None
        join = self.tiers.joins(seq, len(computed))
        if join is not None and join[0] in self.loading:
            self.tiers.stats.restore_joined_blocks += join[1] * self.tiers.k
            return self.park(seq, join[0])
        pull_s = self.remote.pull_s if self.pull_pending(seq) else None
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
        try:
            self.tiers.start_load(seq, plan, ids[plan.first_block:plan.first_block + plan.num_blocks])
        except Exception as exc:
            self._abandon_load(seq, plan, exc)
            raise  # the caller ends this request alone (``_fail``), which frees its blocks
        self.loading[seq.request_id] = seq
        return True

    def _abandon_load(self, seq: Sequence, plan, exc: Exception) -> None:
        """A restore that could not start leaves no pinned source and no claim on its keys
        (later requests would otherwise park behind a load that never ends)."""
        assert self.tiers is not None
        if self.tiers.loads.get(seq.request_id) is plan:
            self.tiers.abandon_load(seq.request_id, exc)  # unpins, unclaims
        elif plan.sources:
            self.tiers.unpin(plan)

    def park(self, seq: Sequence, leader: str) -> bool:
        """The head waits, out of the queue, for ``leader``'s restore, pull or computation
        of the prefix they share (``_release_joined`` requeues it when a restore or pull
        ends; ``release_computed`` once the computation has covered its blocks)."""
        self.waiting.popleft()
        seq.status = RequestStatus.WAITING_FOR_KV
        self.joined.setdefault(leader, []).append(seq)
        return True

    def release_computed(self) -> None:
        """Requeue the heads parked behind a computation that has now covered their shared
        blocks (or whose leader left ``running``), keeping their order (nothing to do
        while no head waits for a computation)."""
        if not self._join_need:
            return
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

    def finish_loads(self, done: list) -> None:
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

    def pull_pending(self, seq: Sequence) -> bool:
        """A P/D decode leg that may still pull its prompt's KV from the prefill engine."""
        return (seq.kv_transfer is not None and self.remote is not None
                and not seq.kv_pull_failed and bool(seq.kv_transfer.get("do_remote_prefill")))

    @staticmethod
    def by_tier(seq: Sequence, cached: int, pulled: int = 0) -> dict[str, int]:
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
        if self.pull_pending(seq):  # (a pull clears kv_transfer when it starts)
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

    def try_pull(self, seq: Sequence, computed: list) -> bool | None:
        """Start pulling the head's missing blocks (``pull_pending``): True started, False
        none, None wait."""
        assert self.remote is not None
        join = self.remote.joins(seq, len(computed))
        if join is not None and join[0] in self.pulling:
            self.remote.stats.blocks_joined += join[1]
            return self.park(seq, join[0])
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

    def finish_pulls(self, done: list[PullDone]) -> None:
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
                seq.cached_by_tier = self.by_tier(seq, seq.num_cached_tokens,
                                                   d.num_blocks * self.kv.block_size)
        elif not d.ok and not seq.status.finished:
            seq.kv_pull_failed = True
