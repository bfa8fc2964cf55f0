"""The reference's load generator: AIPerf's agentic replay (`aiperf profile --scenario
inferencex-agentx-mvp`), which llm-d's GLM-5.2 guide ran for every published figure.

What it does, read from AIPerf's source (`timing/strategies/agentic_replay.py`,
`timing/trajectory_source.py`, `timing/session_tree.py`, `dataset/loader/weka_trace.py`,
`timing/strategies/cache_bust.py`):

- `--concurrency C` is C lanes. A lane holds one session tree (the main agent and its
  sub-agents) from its first request until every stream of it is done, think time included;
  sub-agent requests ride on their parent's lane ("children skip session-slot acquisition"),
  so a fan-out puts more than C requests in flight.
- A stream's next request waits its recorded end-to-start gap after the previous one finishes:
  `max(0, t_next - (t_prev + api_time_prev))`, not scaled and (scenario: `forbid_inter_turn_
  delay_cap`) not capped. A request that joins sub-agents waits for all of them, and then for
  the gap recorded after each (`ReplayBarrierCoordinator`, `SPAWN_JOIN`). Sub-agents start at
  their recorded offset after the request that spawned them.
- A lane starts inside its trace: an instant t* drawn uniformly over the trace's wall-clock
  span (scenario ratios 0-1); each stream resumes at its first request at or after t*. A
  warm-up sends, for every stream with requests before t*, the last of them with
  `max_tokens=1` (excluded from the figures), so the profiling phase starts on a warm cache;
  then the lane's earliest pending request fires at profiling time 0 and the rest keep their
  recorded spacing.
- When a tree is done the lane takes the next trace at once, from its first request.
- Every play of a trace is cache-busted (a marker in its first user message, salted by lane
  and pass): traces never share a prefix with another play, the first request of a fresh play
  is computed in full.
- Output lengths are the recorded ones (`ignore_eos`, `max_tokens = out`).
- A prompt the server rejects as too long ends its trajectory (AIPerf's terminal overflow).

Idle-gap caps, by AIPerf version: the first scenario versions capped each trace's idle gaps at
60 s, some docs state 10 s, both as `--trace-idle-gap-cap-seconds` (`compress_idle_gaps`,
`SimConfig.idle_gap_cap_s`; 10 s by default since stop 30, `config.IDLE_GAP_CAP_S`); the
versions that load the dated corpora forbid that cap and keep a system-wide one instead (when
no request is in flight anywhere, pending gaps are cut to 10 s), not modelled: at the
reference's concurrencies the cluster is never idle.

Not modelled either: AIPerf's flattened-agent detection (`weka_trace.md`, "Flattened-Agent
Detection"), which splits a recorded stream whose requests do not extend one another's hash
ids into child streams dispatched at their recorded offsets. A synthesized session has no such
streams: each of its agents extends its own context.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from agentserve.sim.sessions import GLOBAL_NS
from agentserve.workload.schema import Session, Subagent, TraceRequest


@dataclass(slots=True)
class Call:
    """One recorded request: its start and end on the session clock (s)."""

    t: float
    end: float
    turn: int
    agent: str  # "main" | "sub"
    req: TraceRequest


@dataclass(slots=True)
class Child:
    """A sub-agent stream: spawned when main call `spawn` completes (-1: at the tree's
    start), joined by main call `join` (None: nothing waits for it)."""

    calls: list[Call]
    spawn: int
    join: int | None


class Tree:
    """A session as the replay sees it: the main stream and its sub-agent streams.
    `idle_cap` (s): AIPerf's per-trace idle-gap cap (`--trace-idle-gap-cap-seconds`), see
    `compress_idle_gaps`; None leaves the recorded timeline as it is."""

    def __init__(self, s: Session, idle_cap: float | None = None) -> None:
        self.id, self.block_size = s.id, s.block_size
        self.shared = s.hash_id_scope == "global"  # its ids live in GLOBAL_NS, not a play's own
        self.main: list[Call] = []
        self.children: list[Child] = []
        for it in s.items:
            if isinstance(it, TraceRequest):
                self.main.append(_call(it.t, it, len(self.main), "main"))
            elif isinstance(it, Subagent) and it.requests:
                calls = [_call(it.t + r.t, r, len(self.main) - 1, "sub") for r in it.requests]
                self.children.append(Child(calls, len(self.main) - 1, None))
        for c in self.children:  # the next main call waits for the sub-agents before it
            c.join = c.spawn + 1 if c.spawn + 1 < len(self.main) else None
        if idle_cap is not None:
            compress_idle_gaps(self.main + [x for c in self.children for x in c.calls], idle_cap)
        ts = [c.t for c in self.main] + [x.t for c in self.children for x in c.calls]
        self.span = (min(ts), max(ts)) if ts else (0.0, 0.0)


def trees(sessions: Iterable[Session], idle_cap: float | None = None) -> Iterator[Tree]:
    """The sessions as trees, those without a request left out."""
    return (t for t in (Tree(s, idle_cap) for s in sessions) if t.main or t.children)


def compress_idle_gaps(calls: list[Call], cap: float) -> None:
    """AIPerf's per-trace idle-gap cap, in place: on the trace's request-start timeline (main
    and sub-agent calls together), every gap between consecutive starts above `cap` shrinks
    to `cap` and everything after it moves earlier by the excess; each call keeps its
    recorded duration, and end-to-start delays are then taken on the new timeline
    (`weka_trace._build_trace_idle_timing`: "compress any gap between consecutive starts
    above cap_seconds, then derive parent and child conversation delays from that adjusted
    timeline"). A main call can so start before a sub-agent it joins has ended: it waits for
    the join, as AIPerf's does."""
    if cap < 0:
        raise ValueError(f"an idle-gap cap must be >= 0 s, got {cap}")
    shift, prev = 0.0, None
    for c in sorted(calls, key=lambda c: c.t):
        if prev is not None:
            shift += max(0.0, c.t - prev - cap)
        prev = c.t
        c.t, c.end = c.t - shift, c.end - shift


def _call(t: float, r: TraceRequest, turn: int, agent: str) -> Call:
    return Call(t, t + (r.api_time or 0.0), turn, agent, r)


def _first_at(calls: list[Call], t: float) -> int | None:
    return next((i for i, c in enumerate(calls) if c.t >= t), None)


MAX_BARREN = 100  # plays in a row without an answered call before a lane retires (`Lane.start`)

# send(call, namespace, tree, max_tokens or None, then): issue one request now; `then(ok)`
# runs when it is done (ok False: rejected as longer than the server's context).
Send = Callable[[Call, int, Tree, "int | None", Callable[[bool], None]], None]


class Lane:
    """One concurrency slot replaying session trees one after another."""

    def __init__(self, clock, send: Send, trees: Iterator[Tree], namespaces: Iterator[int],
                 rng: np.random.Generator, gap_cap: float | None = None) -> None:
        self.clock, self.send, self.trees, self.ns_ids = clock, send, trees, namespaces
        self.rng, self.gap_cap = rng, gap_cap
        self.tree: Tree | None = None
        self.answered = False  # the current play had a call answered
        self.barren = 0  # plays in a row that ended with none answered

    # -- a play of one tree ---------------------------------------------------------------
    def _begin(self, tree: Tree) -> None:
        self.tree, self.ns = tree, GLOBAL_NS if tree.shared else next(self.ns_ids)
        self.outstanding = 0  # requests in flight or scheduled
        self.stopped = False
        self.answered = False
        # per main call: joined children still running, and the earliest start they allow
        self.wait = [0] * len(tree.main)
        self.ready = [0.0] * len(tree.main)
        self.issued: set[int] = set()  # main calls sent (or, in a snapshot, before t*)

    def _gap(self, prev_end: float, nxt: Call) -> float:
        g = max(0.0, nxt.t - prev_end)
        return g if self.gap_cap is None else min(g, self.gap_cap)

    def _issue(self, call: Call, then: Callable[[bool], None], at: float | None = None) -> None:
        self.outstanding += 1

        def go() -> None:
            if self.stopped:  # the trajectory ended while this call waited
                self._settle()
                return
            self.send(call, self.ns, self.tree, None, lambda ok: self._after(ok, then))
        if at is None or at <= self.clock.now:
            go()
        else:
            self.clock.at(at, go)

    def _after(self, ok: bool, then: Callable[[bool], None]) -> None:
        if not ok:
            self.stopped = True  # AIPerf: a context overflow ends the trajectory
        self.answered |= ok
        if not self.stopped:
            then(ok)
        self._settle()

    def _settle(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:  # the tree drained: the next trace, from its start, at once
            self.start()

    def _main(self, i: int, at: float) -> None:
        """Main call i may start at `at` once the sub-agents it joins are done."""
        self.ready[i] = max(self.ready[i], at)
        if self.wait[i] == 0 and i not in self.issued:
            self.issued.add(i)
            self._issue(self.tree.main[i], lambda ok: self._main_done(i), self.ready[i])

    def _main_done(self, i: int) -> None:
        tree, now = self.tree, self.clock.now
        call = tree.main[i]
        for c in tree.children:
            if c.spawn == i:
                self._child(c, 0, now + self._gap(call.end, c.calls[0]))
        if i + 1 < len(tree.main):
            self._main(i + 1, now + self._gap(call.end, tree.main[i + 1]))

    def _child(self, c: Child, k: int, at: float) -> None:
        if c.join is not None and k == 0:
            self.wait[c.join] += 1
        self._issue(c.calls[k], lambda ok: self._child_done(c, k), at)

    def _child_done(self, c: Child, k: int) -> None:
        now = self.clock.now
        if k + 1 < len(c.calls):  # `_after` settles this call only after the next is issued
            self._issue(c.calls[k + 1], lambda ok: self._child_done(c, k + 1),
                        now + self._gap(c.calls[k].end, c.calls[k + 1]))
            return
        if c.join is not None:
            j = c.join
            self.wait[j] -= 1
            self._main(j, now + self._gap(c.calls[-1].end, self.tree.main[j]))

    # -- entry points -------------------------------------------------------------------------
    def start(self) -> None:
        """Play the next tree from its first request (a recycled lane). A lane whose last
        `MAX_BARREN` plays were all rejected at their first call retires: a corpus of prompts
        no rank can hold would otherwise be replayed forever at one simulated instant."""
        self.barren = 0 if self.answered or self.tree is None else self.barren + 1
        tree = next(self.trees, None) if self.barren < MAX_BARREN else None
        if tree is None:
            self.tree = None
            return
        self._begin(tree)
        self.outstanding += 1  # hold the tree open while its first calls are issued
        for c in tree.children:
            if c.spawn < 0:
                self._child(c, 0, self.clock.now + max(0.0, c.calls[0].t - tree.span[0]))
        if tree.main:
            self._main(0, self.clock.now)
        self._settle()

    def snapshot(self, tree: Tree) -> tuple[list[Call], list[tuple[float, Callable[[], None]]]]:
        """Join `tree` at a uniform instant t* of its span, as AIPerf's trajectory start: the
        warm-up primers (each resumed stream's last call before t*) and the pending calls,
        as (offset from the lane's earliest, issue). `issue()` sends a call on the clock."""
        self._begin(tree)
        lo, hi = tree.span
        t_star = float(self.rng.uniform(lo, hi)) if hi > lo else lo
        m = _first_at(tree.main, t_star)
        primers, pending = [], []
        if m is not None and m > 0:
            primers.append(tree.main[m - 1])
        self.issued.update(range(len(tree.main) if m is None else m))  # before t*: done
        for c in tree.children:
            if m is not None and c.spawn >= m:
                continue  # spawned later in the replay, when its main call completes
            k = _first_at(c.calls, t_star)
            if k is None:
                continue  # finished before t*
            if k > 0:
                primers.append(c.calls[k - 1])
            if c.join is not None:  # the main call it joins waits from the start
                self.wait[c.join] += 1
            pending.append((c.calls[k].t - t_star, self._resume_child(c, k)))
        if m is not None:
            pending.append((tree.main[m].t - t_star, self._resume_main(m)))
        if pending:
            t0 = min(off for off, _ in pending)
            pending = [(off - t0, fn) for off, fn in pending]
        return primers, pending

    def _resume_child(self, c: Child, k: int) -> Callable[[], None]:
        return lambda: self._issue(c.calls[k], lambda ok: self._child_done(c, k))

    def _resume_main(self, m: int) -> Callable[[], None]:
        return lambda: self._main(m, self.clock.now)

    def begin(self, pending: list[tuple[float, Callable[[], None]]]) -> None:
        """Start the profiling phase of a snapshot: each pending call at its offset."""
        if not pending:
            self.start()
            return
        self.outstanding += 1  # hold the tree open while its calls are issued
        for off, fn in sorted(pending, key=lambda p: p[0]):
            if off <= 0:
                fn()
            else:
                self.outstanding += 1

                def later(fn=fn) -> None:
                    fn()
                    self._settle()
                self.clock.at(self.clock.now + off, later)
        self._settle()


class Replay:
    """`lanes` lanes of the replay: the warm-up, then the profiling phase, which starts when
    the last primer is answered (AIPerf's warm-up barrier) with `on_profile()`."""

    def __init__(self, clock, send: Send, trees: Iterator[Tree], namespaces: Iterator[int],
                 rng: np.random.Generator, lanes: int, gap_cap: float | None,
                 on_profile: Callable[[], None]) -> None:
        if gap_cap is not None and gap_cap < 0:
            raise ValueError(f"a gap cap must be >= 0 s, got {gap_cap}")
        self.lanes = [Lane(clock, send, trees, namespaces, rng, gap_cap) for _ in range(lanes)]
        self.send, self.trees, self.on_profile = send, trees, on_profile
        self.plans: list[tuple[Lane, list]] = []
        self.left = 0
        self.dropped: set[Lane] = set()  # lanes whose trace a primer overflowed

    def start(self) -> None:
        """Join a trace per lane and send the primers (`max_tokens` 1)."""
        for lane in self.lanes:
            tree = next(self.trees, None)
            if tree is None:
                break
            primers, pending = lane.snapshot(tree)
            self.plans.append((lane, pending))
            self.left += len(primers)
            for call in primers:
                self.send(call, lane.ns, tree, 1, lambda ok, lane=lane: self._primed(lane, ok))
        if self.left == 0:
            self._profile()

    def _primed(self, lane: Lane, ok: bool) -> None:
        if not ok:  # AIPerf drops a trace whose primer overflows the context
            self.dropped.add(lane)
        self.left -= 1
        if self.left == 0:
            self._profile()

    def _profile(self) -> None:
        self.on_profile()
        for lane, pending in self.plans:
            lane.begin([] if lane in self.dropped else pending)


def recorded_stage(sessions: Iterable[Session], lanes: int, duration: float,
                   seed: int = 0) -> list[tuple[Call, float]]:
    """The requests (call, send time) the replay sends in `duration` s of profiling when every
    call takes its recorded `api_time` (1 s without one) and primers 0.5 s: the stage a
    corpus gives with no cluster in the loop (the sweep profile's turn count is set on it)."""
    from agentserve.sim.cluster import Clock

    clock, out, t0 = Clock(), [], []

    def send(call: Call, ns: int, tree: Tree, cap: int | None, then: Callable[[bool], None]) -> None:
        sent = clock.now
        if cap is None:
            out.append((call, sent))
        clock.at(sent + (0.5 if cap is not None else (call.req.api_time or 1.0)), lambda: then(True))

    replay = Replay(clock, send, trees(sessions), itertools.count(1 << 20),
                    np.random.default_rng(seed), lanes, None, lambda: t0.append(clock.now))
    replay.start()
    clock.run(clock.now + 1.0)  # primers answered: the profiling phase has begun
    clock.run(t0[0] + duration)
    return [(c, t) for c, t in out if t < t0[0] + duration]
