"""AIPerf's agentic replay (sim/lanes.py): think times, sub-agents, trajectory starts, recycling,
and the stage it sends from the sweep corpus."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from agentserve.sim.cluster import Clock
from agentserve.sim.lanes import Lane, Replay, Tree, recorded_stage
from agentserve.sim.run import SimConfig, Simulation, simulate
from agentserve.workload.schema import Session, Subagent, TraceRequest
from agentserve.workload.synth import synthesize


def _req(t: float, api: float, n: int = 640, out: int = 20) -> TraceRequest:
    return TraceRequest(t=t, input_tokens=n, output_tokens=out, hash_ids=list(range(n // 64)),
                        api_time=api)


class _Server:
    """Answers every request `took` s after it is sent; logs (time, agent, turn, cap, ns)."""

    def __init__(self, clock: Clock, took: float = 1.0, reject: set[float] | None = None) -> None:
        self.clock, self.took, self.reject, self.log = clock, took, reject or set(), []
        self.inflight = self.peak = 0

    def send(self, call, ns, tree, cap, then) -> None:
        self.log.append((self.clock.now, call.agent, call.t, cap, ns))
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)

        def done() -> None:
            self.inflight -= 1
            then(call.t not in self.reject)
        self.clock.at(self.clock.now + self.took, done)


def _lane(sessions: list[Session], server: _Server, clock: Clock, seed: int = 0) -> Lane:
    return Lane(clock, server.send, (Tree(s) for s in sessions), itertools.count(1),
                np.random.default_rng(seed))


def test_think_time_is_replayed_end_to_start() -> None:
    """The next call waits t_next - (t_prev + api_prev) after the previous one is answered,
    whatever the server took: 1 s answers, gaps 8 s and 19 s."""
    clock = Clock()
    srv = _Server(clock)
    s = Session("a", 64, [_req(0.0, 2.0), _req(10.0, 1.0), _req(30.0, 1.0)])
    _lane([s], srv, clock).start()
    clock.run(100.0)
    assert [t for t, *_ in srv.log] == pytest.approx([0.0, 9.0, 29.0])


def test_subagents_run_in_parallel_and_the_next_turn_joins_them() -> None:
    """Two sub-agents start 1 s after their parent's call is answered (recorded: 1 s after it
    ended) and run at once; the next main call waits for both, then for the gap recorded
    after the later one (t 20 - its recorded end 12 = 8 s)."""
    clock = Clock()
    srv = _Server(clock, took=3.0)
    subs = [Subagent(t=2.0, requests=[_req(0.0, 10.0)]), Subagent(t=2.0, requests=[_req(0.0, 1.0)])]
    s = Session("a", 64, [_req(0.0, 1.0), *subs, _req(20.0, 1.0)])
    _lane([s], srv, clock).start()
    clock.run(100.0)
    times = [(t, agent) for t, agent, *_ in srv.log]
    assert times[:3] == [(0.0, "main"), (4.0, "sub"), (4.0, "sub")]
    assert srv.peak == 2  # the lane has two requests in flight: sub-agents ride on it
    # both answered at 7; main: max(7 + (20 - 12), 7 + (20 - 3)) = 24
    assert times[3] == (pytest.approx(24.0), "main")


def test_idle_gap_cap_compresses_the_trace_start_timeline() -> None:
    """AIPerf's per-trace idle-gap cap, its own example (cap 60): main at 0, a sub-agent call
    at 20 taking 80 s, the next main at 220. Starts are 200 s apart, so the next main moves to
    80, before the sub-agent's recorded end (100). Durations are kept. Replayed with 1 s
    answers, the next main waits its end-to-start gap after the main call before it (80 - 5 =
    75 s, uncapped 215 s) and for the sub-agent it joins (then 80 - 100 < 0: none)."""
    def session() -> Session:
        return Session("a", 64, [_req(0.0, 5.0), Subagent(t=20.0, requests=[_req(0.0, 80.0)]),
                                 _req(220.0, 1.0)])
    tree = Tree(session(), idle_cap=60.0)
    assert [c.t for c in tree.main] == pytest.approx([0.0, 80.0])
    assert [(x.t, x.end) for x in tree.children[0].calls] == [pytest.approx((20.0, 100.0))]
    assert tree.span == pytest.approx((0.0, 80.0))
    sent = {}
    for cap in (None, 60.0):
        clock = Clock()
        srv = _Server(clock)
        Lane(clock, srv.send, iter([Tree(session(), cap)]), itertools.count(1),
             np.random.default_rng(0)).start()
        clock.run(500.0)
        sent[cap] = [t for t, *_ in srv.log]
    # main answered at 1; the sub-agent sent 15 s later (20 - 5) and answered at 17
    assert sent[60.0] == pytest.approx([0.0, 16.0, 76.0])
    assert sent[None] == pytest.approx([0.0, 16.0, 216.0])
    with pytest.raises(ValueError, match="idle-gap cap"):
        Tree(session(), idle_cap=-1.0)


def test_replay_caps_idle_gaps_at_10_s_unless_told_off() -> None:
    """The replay's default is AIPerf's 10 s per-trace cap (stop 30); `off` is no cap. Two
    calls recorded 300 s apart, the first taking 2 s: capped, their starts are 10 s apart, so
    the second waits 8 s after the first is answered (at 1 s here); uncapped, 298 s."""
    from agentserve.sim.config import IDLE_GAP_CAP_S, parse_idle_gap_cap

    assert SimConfig().idle_gap_cap_s == IDLE_GAP_CAP_S == 10.0
    assert parse_idle_gap_cap("off") is None and parse_idle_gap_cap("60") == 60.0
    sent = {}
    for cap in (SimConfig().idle_gap_cap_s, parse_idle_gap_cap("off")):
        clock = Clock()
        srv = _Server(clock)
        session = Session("a", 64, [_req(0.0, 2.0), _req(300.0, 2.0)])
        Lane(clock, srv.send, iter([Tree(session, cap)]), itertools.count(1),
             np.random.default_rng(0)).start()
        clock.run(1000.0)
        sent[cap] = [t for t, *_ in srv.log]
    assert sent[10.0] == pytest.approx([0.0, 9.0])  # answered at 1, then 10 - 2 = 8 s
    assert sent[None] == pytest.approx([0.0, 299.0])


def test_lane_joins_a_trace_at_a_uniform_instant_after_its_primers() -> None:
    """A lane joins at t* uniform over the trace's span: its warm-up primer is the last call
    before t*, its first pending call (t* -> first call at or after it) fires at once and the
    rest keep their recorded spacing."""
    calls = [_req(float(t), 1.0) for t in range(0, 100, 10)]
    s = Session("a", 64, calls)
    seen = set()
    for seed in range(40):
        clock = Clock()
        srv = _Server(clock)
        lane = _lane([], srv, clock, seed)
        primers, pending = lane.snapshot(Tree(s))
        assert len(pending) == 1 and pending[0][0] == 0.0
        first = next(i for i, c in enumerate(calls) if c.t >= primers[0].t + 1) if primers else 0
        seen.add(first)
        if primers:
            assert primers[0].req is calls[first - 1]
        lane.begin(pending)
        clock.run(1000.0)
        assert [t for _, _, t, *_ in srv.log] == [c.t for c in calls[first:]]
        assert srv.log[0][0] == 0.0
    assert len(seen) >= 6  # the start instant varies with the draw


def test_a_drained_lane_takes_the_next_trace_from_its_start_in_a_new_namespace() -> None:
    clock = Clock()
    srv = _Server(clock)
    a = Session("a", 64, [_req(0.0, 1.0), _req(5.0, 1.0)])
    b = Session("b", 64, [_req(0.0, 1.0), _req(3.0, 1.0)])
    _lane([a, b, a], srv, clock).start()
    clock.run(100.0)
    assert [(round(t, 6), ns) for t, _, _, _, ns in srv.log] == [
        (0.0, 1), (5.0, 1), (6.0, 2), (9.0, 2), (10.0, 3), (15.0, 3)]


def test_a_rejected_request_ends_its_trajectory() -> None:
    """AIPerf ends a trajectory on a context overflow: the rest of that trace is skipped."""
    clock = Clock()
    srv = _Server(clock, reject={5.0})
    a = Session("a", 64, [_req(0.0, 1.0), _req(5.0, 1.0), _req(9.0, 1.0)])
    b = Session("b", 64, [_req(0.0, 1.0)])
    _lane([a, b], srv, clock).start()
    clock.run(100.0)
    assert [(tr_t, ns) for _, _, tr_t, _, ns in srv.log] == [(0.0, 1), (5.0, 1), (0.0, 2)]


def test_replay_profiles_once_every_primer_is_answered() -> None:
    clock = Clock()
    srv = _Server(clock, took=2.0)
    s = Session("a", 64, [_req(float(t), 1.0) for t in range(0, 100, 10)])
    began = []
    Replay(clock, srv.send, itertools.cycle([Tree(s)]), itertools.count(1),
           np.random.default_rng(3), 4, None, lambda: began.append(clock.now)).start()
    clock.run(50.0)
    primers = [x for x in srv.log if x[3] == 1]
    assert began == [2.0] and all(t == 0.0 for t, *_ in primers)
    assert all(t >= 2.0 for t, _, _, cap, _ in srv.log if cap is None)
    with pytest.raises(ValueError, match="gap cap"):
        Replay(clock, srv.send, iter([]), itertools.count(), np.random.default_rng(0), 1, -1.0,
               lambda: None)


def test_simulated_stage_starts_after_the_warm_up_and_counts_as_aiperf() -> None:
    """xPyD stages default to the replay: primers (one output token) all answered before the
    profiled window, which counts what was sent in it and answered within 30 s after it."""
    subs = [Subagent(t=2.0, requests=[_req(0.0, 2.0, 1280, 30) for _ in range(3)])]
    sessions = [Session(f"s{i}", 64, [_req(0.0, 1.0), *subs, *[_req(10.0 * k, 1.0, 640 * k)
                                                              for k in range(2, 12)]])
                for i in range(6)]
    cfg = SimConfig(model="tiny", gpu="cpu-local", prefill=1, decode=1, prefill_width=2,
                    decode_width=2, concurrency=3, duration=60.0, mtp=False,
                    cpu_offload_gib=0.01, chunk=2048)
    sim = Simulation(cfg, sessions)
    s = sim.run()
    t0 = sim.t0
    assert t0 > 0 and s["warmup_s"] == t0
    primers = [r for r in sim.records if r.max_tokens == 1]
    assert primers and all(r.end <= t0 for r in primers)
    assert s["requests_ok"] == sum(1 for r in sim.records
                                   if t0 <= r.start < t0 + 60 and r.end <= t0 + 90)
    assert s["requests_ok"] > 10 and s["requests_failed"] == 0
    closed = simulate(replace(cfg, clients="closed", warmup=0.0), sessions)
    assert closed["warmup_s"] == 0.0
    with pytest.raises(ValueError, match="--clients"):
        Simulation(SimConfig(clients="open"), sessions)


def test_the_sweep_corpus_replayed_sends_the_reference_stage() -> None:
    """SPEC: the calibration stage's inputs, over every request it sent, have median 47-57K
    and p99 above 347K; AIPerf's replay of the sweep corpus (128 lanes, 900 s, recorded call
    times) sends that, sub-agents included."""
    stage = recorded_stage(synthesize("sweep", 400, 0), 128, 900.0, 0)
    ins = np.array([c.req.input_tokens for c, _ in stage])
    assert 47_000 <= np.median(ins) <= 57_000 and np.percentile(ins, 99) > 347_000
    assert 0.3 < np.mean([c.agent == "sub" for c, _ in stage]) < 0.6


def test_a_corpus_no_rank_can_hold_ends_the_stage_instead_of_looping() -> None:
    """Every prompt longer than a rank's KV, and no request path time: each lane retires after
    MAX_BARREN plays rejected at once, the stage ends, every counted request is a rejection;
    sessions without a request are skipped."""
    sim = Simulation(SimConfig(model="tiny", gpu="cpu-local", prefill=1, decode=1,
                               prefill_width=2, decode_width=2, concurrency=2, duration=30.0,
                               mtp=False, cpu_offload_gib=0.01, request_overhead_s=0.0,
                               request_overhead_per_token_s=0.0), [])
    cap = sim.p_ranks[0].pool.num_blocks
    huge = [Session(f"h{i}", 64, [_req(0.0, 1.0, (cap + 1) * 64)]) for i in range(3)]
    s = simulate(replace(sim.cfg), [Session("empty", 64, []), *huge])
    assert s["requests_ok"] == 0 and s["rejected_requests"] > 0
    assert s["rejected_share"] == 1.0
