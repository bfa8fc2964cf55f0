"""llm-d's approximate prefix records (sim/cluster.py `ApproxRouter`, each record the router's
own `ApproxTracker` over a `PrefixIndex`): head-only, LRU by routing, blind to evictions; and
the simulator run with them."""

from __future__ import annotations

import pytest

from agentserve.sim.cluster import ApproxRecord, ApproxRouter, Rank, SimRequest
from agentserve.sim.run import SimConfig, Simulation
from agentserve.workload.record import RequestRecord
from agentserve.workload.schema import Session, TraceRequest


def test_index_matches_the_leading_run_of_the_head_only() -> None:
    idx = ApproxRecord(ranks=2, capacity=100, head=4)
    idx.add(0, [1, 2, 3, 4, 5, 6])  # only the head (4 hashes) is recorded
    assert idx.match(0, [1, 2, 3, 4, 5, 6]) == 4
    assert idx.match(0, [1, 2, 9, 4]) == 2  # a hole ends the run
    assert idx.match(1, [1, 2, 3, 4]) == 0
    assert idx.match(0, [5, 6]) == 0  # beyond the head: never recorded
    assert idx.runs([1, 2, 3]) == [3, 0]  # every rank's run in one lookup


def test_a_record_that_is_not_a_prefix_run_still_matches_exactly() -> None:
    """An LRU may hold a later block of a head without an earlier one (the earlier one routed
    long ago and aged out): the match is the leading run, the later block alone counts nothing."""
    idx = ApproxRecord(ranks=1, capacity=3, head=3)
    idx.add(0, [1, 2, 3])
    idx.add(0, [2, 3])  # refreshed: 1 is now the oldest
    idx.add(0, [7])  # over capacity: 1 leaves, 2 and 3 stay
    assert idx.match(0, [1, 2, 3]) == 0 and idx.match(0, [2, 3]) == 2
    assert idx.match(0, [7, 2]) == 2 and idx.match(0, [2, 9, 3]) == 1


def test_index_forgets_the_least_recently_routed_heads_first() -> None:
    idx = ApproxRecord(ranks=1, capacity=4, head=2)
    idx.add(0, [1, 2])
    idx.add(0, [3, 4])
    idx.add(0, [1, 2])  # routed again: most recent
    idx.add(0, [5, 6])  # over capacity: [3, 4] leaves
    assert idx.match(0, [1, 2]) == 2 and idx.match(0, [5, 6]) == 2
    assert idx.match(0, [3, 4]) == 0
    with pytest.raises(ValueError):
        ApproxRecord(ranks=1, capacity=0, head=2)


def _req(hashes: list[int]) -> SimRequest:
    rec = RequestRecord(request_id="r", session_id="s", turn=0, input_tokens=64 * len(hashes) + 1)
    return SimRequest(rec, hashes, 64 * len(hashes) + 1, 8, lambda r: None)


def test_router_follows_its_records_not_the_pools() -> None:
    """A head routed to a rank draws the next request there, though no pool holds a block of it
    (the records see no KV events), where the precise picker would see nothing anywhere."""
    ranks = [Rank(i, 1000, 0, 64) for i in range(4)]
    router = ApproxRouter(0, ranks, 64)
    first = router.pick(ranks, _req(list(range(100, 140))), decode=False)
    for _ in range(5):
        assert router.pick(ranks, _req(list(range(100, 150))), decode=False) is first
    assert all(r.pool.num_free_blocks == 1000 for r in ranks)  # nothing was ever cached


def test_blind_pick_goes_by_load_and_still_records_the_head() -> None:
    """A pick on load alone (`SimConfig.route_miss`) ignores the records: it takes the rank with
    the fewest requests in flight though another holds the head; and, as llm-d's picker records
    every head it routes, the next turn then scores the rank it landed on."""
    ranks = [Rank(i, 1000, 0, 64) for i in range(3)]
    router = ApproxRouter(0, ranks, 64)
    home = router.pick(ranks, _req(list(range(100, 140))), decode=False)
    idle = next(r for r in ranks if r is not home)
    for r in ranks:
        r.active = 0 if r is idle else 5
    assert router.pick_blind(ranks, _req(list(range(100, 150)))) is idle
    assert router.gpu.match(router.pos[id(idle)], list(range(100, 150))) == 50


def test_simulation_runs_with_approximate_records() -> None:
    """With room for every head, the records send each session back to the rank holding its
    prefix, as the pools' contents would."""
    sessions = [Session(id=f"s{i}", block_size=64, items=[
        TraceRequest(t=float(t), input_tokens=(40 + 4 * t) * 64, output_tokens=20,
                     hash_ids=[1000 * i + k for k in range(40 + 4 * t)]) for t in range(4)])
        for i in range(4)]
    base = dict(model="tiny", gpu="cpu-local", prefill=1, decode=1, prefill_width=2,
                decode_width=2, concurrency=2, duration=600.0, mtp=False, cpu_offload_gib=0.01,
                warmup=0.0, clients="closed")
    hit = {p: Simulation(SimConfig(prefix_index=p, **base), sessions).run()["prefill_gpu_hit_rate"]
           for p in ("approx", "precise")}
    assert hit["approx"] > 0.5 and hit["approx"] == pytest.approx(hit["precise"], abs=0.05)
    with pytest.raises(ValueError, match="prefix-index"):
        Simulation(SimConfig(prefix_index="exact", **base), sessions)
    with pytest.raises(ValueError, match="aggregated"):
        Simulation(SimConfig(prefix_index="approx", **{**base, "prefill": 0, "aggregated": 2}),
                   sessions)
