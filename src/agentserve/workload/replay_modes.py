"""The three load shapes: agent sessions, closed-loop concurrency, fixed schedule.

All three share a `Driver` that admits, builds, sends and records one job. Bounds:
after the stage deadline no new request starts; requests already in flight finish
(each is bounded by --request-timeout), as AIPerf lets in-flight requests drain.
Children run in TaskGroups so that cancelling the run (Ctrl-C) cancels every stream.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import numpy as np

from agentserve.workload.record import RequestRecord, SessionRecord
from agentserve.workload.replay_http import Target
from agentserve.workload.replay_plan import (Job, RequestFactory, idle_gap, recorded_duration,
                                             scope_of, session_jobs, step_end, step_start, steps_of)
from agentserve.workload.schema import Session, Subagent, TraceRequest


class Driver:
    """Sends jobs for one stage and keeps its records."""

    def __init__(self, target: Target, factory: RequestFactory, t0: float, stage: int = 0,
                 duration: float | None = None, gap_scale: float = 1.0, gap_cap: float | None = None,
                 max_turns: int | None = None,
                 on_record: Callable[[RequestRecord], None] | None = None,
                 limit: int | None = None) -> None:
        self.target, self.factory, self.t0, self.stage = target, factory, t0, stage
        self.begin = time.perf_counter()
        self.deadline = self.begin + duration if duration is not None else None
        self.gap_scale, self.gap_cap, self.max_turns = gap_scale, gap_cap, max_turns
        self.on_record = on_record
        self.limit = limit  # --request-count: requests sent per stage, at most
        self.records: list[RequestRecord] = []
        self.sessions: list[SessionRecord] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def full(self) -> bool:
        return self.limit is not None and len(self.records) >= self.limit

    def expired(self) -> bool:
        return self.full() or (self.deadline is not None and time.perf_counter() >= self.deadline)

    async def wait(self, seconds: float) -> bool:
        """Sleep; False (after sleeping to the deadline) when the stage ends first."""
        if self.full():
            return False
        if self.deadline is not None and time.perf_counter() + seconds >= self.deadline:
            await asyncio.sleep(max(0.0, self.deadline - time.perf_counter()))
            return False
        if seconds > 0:
            await asyncio.sleep(seconds)
        return True

    async def send(self, job: Job, sink: list[RequestRecord] | None = None,
                   admitted: bool = False) -> RequestRecord | None:
        """Admit (unless already `admitted`), build and stream one job; None when skipped
        (or when the stage has sent its --request-count)."""
        if self.full() or (not admitted and not self.factory.admit(job)):
            return None
        rec, body = self.factory.build(job, self.stage)
        self.records.append(rec)  # before sending: a cancelled stream is still recorded
        if sink is not None:
            sink.append(rec)
        await self.target.send(rec, body, self.t0)
        if self.on_record is not None:
            self.on_record(rec)
        return rec


async def _replay_sub(d: Driver, session: Session, sub: Subagent, k: int, turn: int,
                      sink: list[RequestRecord]) -> bool:
    """One sub-agent's requests in order with its own gaps; False when the stage ended."""
    prev_end = 0.0  # sub-agent clock: its requests' t are relative to its start
    for r in sub.requests:
        if not await d.wait(idle_gap(r.t - prev_end, d.gap_scale, d.gap_cap)):
            return False
        await d.send(Job(session.id, scope_of(session), session.block_size, r, turn, "sub", k, sub.t), sink)
        prev_end = r.t + (r.api_time or 0.0)
    return True


async def replay_session(d: Driver, session: Session) -> SessionRecord:
    """Main turns in order; sub-agent groups fan out together and the next turn joins them."""
    steps = steps_of(session, d.max_turns)
    mine: list[RequestRecord] = []
    srec = SessionRecord(session.id, d.now(), d.now(), recorded_duration(steps))
    prev_end, turn = (step_start(steps[0]) if steps else 0.0), 0
    try:
        for step in steps:
            if not await d.wait(idle_gap(step_start(step) - prev_end, d.gap_scale, d.gap_cap)):
                srec.complete = False
                break
            if isinstance(step, TraceRequest):
                await d.send(Job(session.id, scope_of(session), session.block_size, step, turn), mine)
                turn += 1
            else:
                async with asyncio.TaskGroup() as tg:
                    subs = [tg.create_task(_replay_sub(d, session, s, k, turn, mine))
                            for k, s in enumerate(step)]
                if not all(t.result() for t in subs):
                    srec.complete = False
                    break
            prev_end = step_end(step)
    except asyncio.CancelledError:
        srec.complete = False
        raise
    finally:
        srec.requests = len(mine)
        srec.failed = sum(1 for r in mine if not r.ok)
        if mine:
            srec.start = min(r.start for r in mine)
        srec.end = max((r.end for r in mine), default=d.now())
        d.sessions.append(srec)
    return srec


async def run_sessions(d: Driver, sessions: list[Session], k: int = 1, rate: float | None = None,
                       seed: int = 0) -> None:
    """Closed loop (K sessions at once, the next starts when one ends) or open loop (Poisson R/s)."""
    if rate:
        rng = np.random.default_rng(seed)
        async with asyncio.TaskGroup() as tg:
            for s in sessions:
                tg.create_task(replay_session(d, s))
                if not await d.wait(float(rng.exponential(1.0 / rate))):
                    break
        return
    pending = iter(sessions)

    async def worker() -> None:
        for s in pending:  # shared iterator: each worker takes the next session
            if d.expired():
                return
            await replay_session(d, s)

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(k, len(sessions))):
            tg.create_task(worker())


async def run_concurrency(d: Driver, sessions: list[Session], c: int, cycle: bool = True) -> None:
    """AIPerf-style closed loop: C clients, each with one request in flight.

    A client takes the next session and sends its requests back to back in trace order
    (turn N+1 only after turn N, as a real agent would), then takes the next session;
    with `cycle` the trace wraps until the stage deadline.
    """
    per_session = [session_jobs(s, d.max_turns) for s in sessions]
    per_session = [[j for j in jobs if d.factory.admit(j)] for jobs in per_session]
    per_session = [jobs for jobs in per_session if jobs]
    if not per_session:
        return
    pool = itertools.cycle(per_session) if cycle else iter(per_session)

    async def client() -> None:
        for jobs in pool:
            for job in jobs:
                if d.expired():
                    return
                await d.send(job, admitted=True)  # admitted once above, not per pass

    async with asyncio.TaskGroup() as tg:
        for _ in range(c):
            tg.create_task(client())


async def run_schedule(d: Driver, jobs: list[Job]) -> None:
    """Each job at its own time (seconds after the stage start), whatever is in flight."""
    async with asyncio.TaskGroup() as tg:
        for job in jobs:
            delay = d.begin + job.at - time.perf_counter()
            if not await d.wait(delay):
                break
            tg.create_task(d.send(job))
