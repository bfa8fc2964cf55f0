"""The simulator's aggregated engines route with our router's default policy
(sim/policy_router.py): sessions stay with their prefix holder, new ones are spread."""

from __future__ import annotations

from agentserve.sim.cluster import Rank, SimRequest
from agentserve.sim.policy_router import PolicyRouter
from agentserve.sim.run import SimConfig, Simulation
from agentserve.workload.record import RequestRecord
from tests.sim.test_agg import _hw, _sessions


def _req(session: str, hashes: list[int], n_out: int = 8) -> SimRequest:
    return SimRequest(rec=RequestRecord(request_id=f"{session}-{len(hashes)}", session_id=session,
                                        turn=0), hashes=hashes, n_in=len(hashes) * 4 + 1,
                      n_out=n_out, on_done=lambda r: None)


def test_new_sessions_spread_and_turns_follow_their_prefix() -> None:
    """Four new sessions at once go two to each rank (live sessions and recent requests
    balance them); each one's next turn, over a prefix its rank was just sent, goes back
    there (speculative entries, then the sticky picker), even while that rank is busier."""
    ranks = [Rank(i, 1000, 0, 4) for i in range(2)]
    router = PolicyRouter(ranks, seed=0)
    first = {}
    for k in range(4):
        req = _req(f"s{k}", [1000 * k + j for j in range(50)])
        first[k] = router.route(req, now=0.01 * k)
    assert sorted(r.idx for r in first.values()) == [0, 0, 1, 1]
    for k in range(4):  # the next turn: same head, a few more blocks
        turn = _req(f"s{k}", [1000 * k + j for j in range(56)])
        assert router.route(turn, now=0.5 + 0.01 * k) is first[k]


def test_a_finished_turn_releases_what_it_booked() -> None:
    ranks = [Rank(i, 1000, 0, 4) for i in range(2)]
    router = PolicyRouter(ranks, seed=0)
    req = _req("s", list(range(40)))
    r = router.route(req, now=0.0)
    ep = router.eps[r.idx]
    assert ep.inflight == 1 and ep.pending_prefill == req.n_in and ep.inflight_tokens > 0
    router.first_byte(req, now=0.2)
    assert ep.pending_prefill == 0
    router.finish(req, now=0.5)
    assert ep.inflight == 0 and ep.inflight_tokens == 0 and not router.liveness.busy("s")


def test_closed_loop_keeps_the_engines_equally_loaded(tmp_path, monkeypatch) -> None:
    """Eight clients over two aggregated engines: each engine decodes four at nearly every
    step, as the router's default policy splits them (the older prefix/queue preset, still
    used for the P/D pools, left one engine with 3 and the other with 5 on a third of steps)."""
    _hw(tmp_path, monkeypatch)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=2, concurrency=8, duration=30.0,
                    mtp=False, cpu_offload_gib=0, chunk=256, block_size=16, token_scale=16,
                    kv_tokens=60_000, max_output=40, join_midway=False)
    sim = Simulation(cfg, iter(_sessions(400, turns=6)))
    for a in sim.aggs:
        a.trace = []
    sim.run()
    running = [len(s["dec"]) + len(s["pre"]) for a in sim.aggs for s in a.trace]
    assert sum(n == 4 for n in running) / len(running) > 0.8
