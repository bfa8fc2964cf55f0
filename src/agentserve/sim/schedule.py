"""A fixed schedule: every request of a trace at its recorded time, whatever is in flight.

The open-loop load of `agentserve bench --mode schedule` (and of AIPerf's `--fixed-schedule`
for a mooncake trace), by the bench's own code (`replay_plan.schedule_jobs`): a session starts
at its recorded start (a mooncake trace's `timestamp`s, relative to the earliest) or, with a
session rate, at i / rate; its requests, sub-agents' included, at their recorded offsets from
it. Nothing waits for an answer: a slow cluster builds queues, as a real one would. The
window closes at `until`: no request is sent from then on (those in flight still finish).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from agentserve.sim.sessions import GLOBAL_NS
from agentserve.workload.replay_plan import Job, session_jobs, session_starts
from agentserve.workload.schema import Session, TraceRequest

# send(namespace, session id, turn, agent, request, block size, then)
Send = Callable[[int, str, int, str, TraceRequest, int, Callable[[bool], None]], None]


def scheduled(sessions: list[Session], spacing: float = 0.0) -> list[tuple[float, int, Job]]:
    """(time s, hash namespace, job) for every request, by time; ties keep trace order.
    Sessions of `global`-scope traces share one namespace (`GLOBAL_NS`), the others each
    their own (their index)."""
    out = []
    for i, (s, start) in enumerate(zip(sessions, session_starts(sessions, spacing))):
        ns = GLOBAL_NS if s.hash_id_scope == "global" else i
        out += [(start + j.offset + j.req.t, ns, j) for j in session_jobs(s)]
    out.sort(key=lambda x: x[0])
    return out


class Schedule:
    """Sends the scheduled requests on the simulated clock, one event per distinct time."""

    def __init__(self, clock, send: Send, sessions: Iterable[Session], until: float,
                 spacing: float = 0.0) -> None:
        self.clock, self.send, self.until = clock, send, until
        self.jobs = scheduled(list(sessions), spacing)
        self.sent = 0

    @property
    def cut(self) -> bool:
        """Did the window close before the schedule's last request was due?"""
        return bool(self.jobs) and self.jobs[-1][0] >= self.until

    def start(self) -> None:
        """Put the first request on the clock (time 0 is the schedule's start)."""
        if self.jobs and self.jobs[0][0] < self.until:
            self.clock.at(self.jobs[0][0], self._fire)

    def _fire(self) -> None:
        jobs, now = self.jobs, self.clock.now
        while self.sent < len(jobs) and jobs[self.sent][0] <= now:
            _, ns, j = jobs[self.sent]
            self.sent += 1
            self.send(ns, j.session_id, j.turn, j.agent, j.req, j.block_size, _ignore)
        if self.sent < len(jobs) and jobs[self.sent][0] < self.until:
            self.clock.at(jobs[self.sent][0], self._fire)


def _ignore(ok: bool) -> None:
    """An open loop does not wait for answers."""
