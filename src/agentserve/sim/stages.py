"""How a stage runs on the simulated clock: its load generator, its window and its drain.

Three load generators drive a `run.Simulation` (`SimConfig.clients`): AIPerf's agentic replay
(`agentx`, the xPyD default: lanes.py, a warm-up of primers, then `duration` s and AIPerf's
grace), closed clients (`closed`: `concurrency` of them from time 0, the stage after the
warm-up) and a trace's fixed schedule (`schedule`: open loop, schedule.py). Each samples the
queues over the window (queues.py), reads the pools' counters at its two ends (summary.py)
and returns the stage's summary.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from agentserve.sim.lanes import Replay, trees
from agentserve.sim.queues import sample_queues
from agentserve.sim.schedule import Schedule
from agentserve.sim.summary import pool_counters
from agentserve.sim.sessions import SYNTH

if TYPE_CHECKING:  # run.py imports this module
    from agentserve.sim.run import Simulation

GRACE_S = 30.0  # AIPerf's --benchmark-grace-period default: answers counted after the window
SCHEDULE_DRAIN_S = 600.0  # a schedule's drain: `bench --mode schedule`'s --request-timeout
WARMUP_LIMIT_S = 4 * 3600.0  # a warm-up still unanswered then is a bug, not a slow cluster


def run_stage(sim: Simulation) -> dict:
    """Run `sim`'s stage with its load generator and return its summary."""
    if sim.agentx:
        return run_agentx(sim)
    if sim.cfg.clients == "schedule":
        return run_schedule(sim)
    return run_closed(sim)


def run_schedule(sim: Simulation) -> dict:
    """A trace's requests at their recorded times (schedule.py), from simulated time 0: the
    window opens at `t0` (the warm-up, 0 by default) and sends nothing from `t0 + duration`
    on; what it sent counts when answered within `SCHEDULE_DRAIN_S` after it closes."""
    cfg = sim.cfg
    if cfg.workload in SYNTH and not isinstance(sim.source, (list, tuple)):
        raise ValueError(f"--clients schedule replays a trace file's recorded times; "
                         f"{cfg.workload} is synthesized without them: pass --workload FILE")
    t1 = sim._send_until = sim.t0 + cfg.duration
    sched = Schedule(sim.clock, sim._send, sim.source, t1,
                     1.0 / cfg.session_rate if cfg.session_rate else 0.0)
    sched.start()
    sample_queues(sim, sim.t0)
    sim.clock.run(sim.t0)
    sim._c0 = pool_counters(sim)
    sim.clock.run(t1)
    sim._c1 = pool_counters(sim)
    sim.window_full = sched.cut
    sim.clock.run(t1 + sim.grace)
    return sim.summary()


def run_closed(sim: Simulation) -> dict:
    """Closed clients: `concurrency` of them from time 0, the stage after the warm-up."""
    sim._closed_clients()
    for _ in range(sim.cfg.concurrency):
        sim._client()
    sample_queues(sim, sim.t0)
    if sim.t0 > 0:
        sim.clock.run(sim.t0)
    sim._c0 = pool_counters(sim)
    t1 = sim._send_until = sim.t0 + sim.cfg.duration  # nothing new from the deadline on
    sim.clock.run(t1)
    sim._c1 = pool_counters(sim)
    if sim.drains:
        sim.clock.run(t1 + GRACE_S)
    return sim.summary()


def run_agentx(sim: Simulation) -> dict:
    """Warm-up (the lanes' primers), then `duration` s of profiling and AIPerf's grace."""
    cfg = sim.cfg
    source = trees(sim.source, cfg.idle_gap_cap_s)
    if cfg.workload not in SYNTH or isinstance(sim.source, (list, tuple)):
        source = itertools.cycle(source)  # a finite corpus is replayed round-robin (AIPerf)

    def profile() -> None:
        sim._t0, sim._c0 = sim.clock.now, pool_counters(sim)
        sample_queues(sim, sim._t0)
    replay = Replay(sim.clock, lambda call, ns, tree, cap, then: sim._send(
        ns, tree.id, call.turn, call.agent, call.req, tree.block_size, then, cap),
        source, itertools.count(1 << 20), sim.rng, cfg.concurrency, cfg.gap_cap_s, profile)
    replay.start()
    while sim._t0 is None:  # bounded: every primer is one finite request
        if sim.clock.idle or sim.clock.now > WARMUP_LIMIT_S:
            raise RuntimeError(f"the replay's warm-up did not finish ({replay.left} primers "
                               f"unanswered at {sim.clock.now:.0f} s)")
        sim.clock.run(sim.clock.now + 10.0)
    t1 = sim._t0 + cfg.duration
    sim.clock.run(t1)
    sim._c1 = pool_counters(sim)
    sim.clock.run(t1 + GRACE_S)
    return sim.summary()
