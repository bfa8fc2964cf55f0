"""Pickers on hand-made candidates: sticky until saturated, and its balance rule for moves."""

import pytest

from agentserve.router.picker import MaxScorePicker, StickyPicker, build_picker
from agentserve.router.scorers import Candidate


def cand(url, held=0.0, total=100, wait=0.5, sessions=0, own=False):
    return Candidate(url, weighted_blocks=held, matched_blocks=int(held), total_blocks=total,
                     est_wait_s=wait, active_sessions=sessions, session_match=own)


def test_holder_kept_while_its_wait_is_within_the_penalty():
    p = StickyPicker(penalty_s=2.0)
    cs = [cand("a", 90, wait=2.4, sessions=5, own=True), cand("b", wait=0.5),
          cand("c", wait=0.6)]
    assert p.pick(cs, [3.0, 1.0, 1.0]) == (0, "session")


def test_busy_holder_keeps_its_session_when_a_move_would_not_balance():
    # The holder has a long queue (say a large new-session prefill) but no more sessions
    # than the others: moving would only recompute the prefix and shift the imbalance.
    p = StickyPicker(penalty_s=2.0)
    cs = [cand("a", 90, wait=6.0, sessions=3, own=True), cand("b", wait=0.5, sessions=3),
          cand("c", wait=0.3, sessions=2)]
    i, reason = p.pick(cs, [3.0, 1.5, 1.2])
    assert i == 0 and reason == "session"
    # without the balance rule the same candidates move (the wait-only rule)
    q = StickyPicker(penalty_s=2.0, moves_must_balance=False)
    assert q.pick(cs, [3.0, 1.5, 1.2]) == (1, "saturated")


def test_saturated_holder_sheds_to_an_endpoint_with_two_fewer_sessions():
    p = StickyPicker(penalty_s=2.0)
    cs = [cand("a", 90, wait=6.0, sessions=6, own=True), cand("b", wait=0.5, sessions=4),
          cand("c", wait=4.5, sessions=1), cand("d", wait=0.4, sessions=3)]
    # b: one fewer (a swap, not a gain); c: too slow to beat the penalty; d qualifies
    assert p.pick(cs, [3.0, 2.0, 2.5, 1.0]) == (3, "saturated")


def test_force_move_sheds_a_far_slower_holder_without_a_balance_gain():
    cs = [cand("a", 90, wait=14.0, sessions=3, own=True), cand("b", wait=0.5, sessions=3),
          cand("c", wait=0.3, sessions=3)]
    assert StickyPicker(penalty_s=2.0).pick(cs, [3.0, 1.5, 1.2])[0] == 0  # off by default
    p = StickyPicker(penalty_s=2.0, force_move_s=15.0)
    assert p.pick(cs, [3.0, 1.5, 1.2])[0] == 0  # 13.7 s worse: wait it out
    cs[0].est_wait_s = 20.0  # 19.7 s worse than c: move to the fastest
    assert p.pick(cs, [3.0, 1.5, 1.2]) == (2, "saturated")
    assert StickyPicker(penalty_s=2.0).pick(cs, [3.0, 1.5, 1.2])[0] == 0


def test_own_session_does_not_count_on_the_holder():
    p = StickyPicker(penalty_s=1.0)
    # 3 active there, one of which is this session: 2 others vs 1 -> no gain in moving
    cs = [cand("a", 90, wait=5.0, sessions=3, own=True), cand("b", wait=0.1, sessions=1)]
    assert p.pick(cs, [3.0, 1.0])[0] == 0
    cs[0].session_match = False  # a request of no session: 3 vs 1, move
    assert p.pick(cs, [3.0, 1.0]) == (1, "saturated")


def test_moves_cannot_cascade():
    """Every move lowers the sum of squared session counts, so a run of saturated
    decisions ends (here at most a few moves), however the waits look."""
    p = StickyPicker(penalty_s=0.0, seed=3)
    counts = [6, 0, 0, 0]
    moves = 0
    for step in range(100):
        h = step % 4  # every endpoint in turn claims to be the swamped holder
        cs = [cand(str(i), 90 if i == h else 0, wait=9.0 if i == h else 0.0,
                   sessions=counts[i], own=(i == h and counts[i] > 0)) for i in range(4)]
        i, reason = p.pick(cs, [0.0] * 4)
        if reason == "saturated":
            counts[h] -= 1
            counts[i] += 1
            moves += 1
    # each move lowers sum(c^2) by >= 4 (from 36, to no less than 9): at most 6 moves;
    # it stops once no endpoint has 2 fewer than a holder's other sessions
    assert 0 < moves <= 6 and max(counts) - min(counts) <= 2


def test_no_holder_or_small_share_falls_back_to_max_score():
    p = StickyPicker(min_share=0.5, seed=1)
    cs = [cand("a", 40, wait=0.1), cand("b", wait=0.2)]  # 40% held: below min_share
    assert p.pick(cs, [0.5, 0.9]) == (1, "load")
    cs = [cand("a"), cand("b")]
    assert p.pick(cs, [0.2, 0.9]) == (1, "load")


def test_cpu_tier_prefix_keeps_the_session_sticky():
    # A prefix held only in the CPU tier (weight 0.8) is still the holder's.
    p = StickyPicker(penalty_s=2.0)
    cs = [cand("a", 80.0, wait=0.4, sessions=2, own=True), cand("b", wait=0.3, sessions=0)]
    assert p.pick(cs, [1.6, 1.5])[0] == 0


def test_build_picker_options():
    assert isinstance(build_picker({"type": "max"}), MaxScorePicker)
    p = build_picker({"type": "sticky", "penalty_s": 3.0, "moves_must_balance": False})
    assert p.penalty_s == 3.0 and not p.moves_must_balance
    with pytest.raises(TypeError):
        build_picker({"type": "sticky", "nope": 1})


def test_wait_scorer_is_relative_to_the_soonest():
    from agentserve.router.scorers import SCORERS
    w = SCORERS["wait"]()
    s = w.score([Candidate("a", est_wait_s=11.0), Candidate("b", est_wait_s=23.0),
                 Candidate("c", est_wait_s=0.0)])
    assert s == pytest.approx([1 / 12, 1 / 24, 1.0])
    # the same ratio of (1 + wait) scores the same at any scale
    assert w.score([Candidate("a", est_wait_s=1.0), Candidate("b", est_wait_s=3.0)]) == \
        pytest.approx(w.score([Candidate("a", est_wait_s=9.0), Candidate("b", est_wait_s=19.0)]))


def test_place_by_requests_takes_the_fewest_recent_requests_within_the_guards():
    """A new session (no holder) goes to the endpoint sent the fewest requests recently,
    unless it has more than `place_slack` live sessions above the fewest or its wait
    exceeds the shortest by more than `penalty_s`."""
    p = StickyPicker(penalty_s=2.0, place_by="requests", place_slack=1)

    def c(url, rr, sessions, wait):
        x = cand(url, wait=wait, sessions=sessions)
        x.recent_requests = rr
        return x
    cs = [c("a", 40.0, 5, 0.2), c("b", 12.0, 8, 0.2), c("c", 20.0, 6, 4.0),
          c("d", 25.0, 6, 1.5), c("e", 30.0, 5, 0.1)]
    # b: fewest requests but 3 sessions above the fewest; c: its queue is 3.9 s longer
    assert p.pick(cs, [5.0, 5.0, 5.0, 1.0, 4.0]) == (3, "load")
    # by score (the default) the highest score wins instead
    assert StickyPicker(penalty_s=2.0).pick(cs, [5.0, 1.0, 1.0, 1.0, 4.0])[0] == 0
    with pytest.raises(ValueError, match="place_by"):
        StickyPicker(place_by="tokens")


def test_place_by_requests_keeps_a_partial_prefix():
    """A prefix under `min_share` (not sticky) still outweighs the request count when it
    is more than 10% of the prompt longer than the others'."""
    p = StickyPicker(penalty_s=2.0, place_by="requests")
    a, b = cand("a", 40, sessions=3), cand("b", 5, sessions=3)
    a.recent_requests, b.recent_requests = 30.0, 10.0
    assert p.pick([a, b], [1.0, 1.0])[0] == 0
    a.weighted_blocks = 12  # within 10 blocks of 100: the fewer requests win
    assert p.pick([a, b], [1.0, 1.0])[0] == 1


def test_place_by_requests_with_no_endpoint_inside_both_guards_takes_the_best_score():
    p = StickyPicker(penalty_s=2.0, place_by="requests", place_slack=1)
    a, b = cand("a", sessions=2, wait=9.0), cand("b", sessions=6, wait=0.1)
    assert p.pick([a, b], [1.0, 2.0]) == (1, "load")
    assert p.pick([a, b], [2.0, 1.0]) == (0, "load")


def _held(url, rr, rate, own=False, uncached=100, pending=0, wait=0.5, tokens=1000):
    x = cand(url, 90 if own else 0, wait=wait, sessions=3, own=own)
    x.recent_requests, x.active_rate, x.session_rate = rr, rate, 0.2
    x.uncached_tokens, x.pending_prefill = (uncached if own else tokens), pending
    return x


def test_rebalance_moves_a_session_off_an_endpoint_sent_too_many_requests():
    """The holder was sent 1.5x the requests of the least loaded endpoint: the session
    moves there once the reuse budget covers its recompute, and not before."""
    p = StickyPicker(penalty_s=2.0, rebalance_slack=0.2, rebalance_budget=0.02)
    cs = [_held("a", 60.0, 1.0, own=True), _held("b", 40.0, 0.5), _held("c", 50.0, 0.6)]
    # nothing reused yet: a move (900 more tokens to prefill) is not affordable
    assert p.pick(cs, [3.0, 1.0, 1.0]) == (0, "session")
    p.reused = 100_000  # budget 2,000: half of it covers the 900
    assert p.pick(cs, [3.0, 1.0, 1.0]) == (1, "rebalance")
    assert p.spent == 900
    # off by default
    assert StickyPicker(penalty_s=2.0).pick(cs, [3.0, 1.0, 1.0]) == (0, "session")


def test_rebalance_guards_overshoot_queue_and_slack():
    p = StickyPicker(penalty_s=2.0, rebalance_slack=0.2)
    p.reused = 10**9
    # within the slack (60 <= 1.2 * 50 + 1): stays
    cs = [_held("a", 60.0, 1.0, own=True), _held("b", 50.0, 0.5)]
    assert p.pick(cs, [3.0, 1.0]) == (0, "session")
    # the target's live sessions already send more than the holder keeps after the move
    cs = [_held("a", 60.0, 0.6, own=True), _held("b", 40.0, 0.5)]
    assert p.pick(cs, [3.0, 1.0]) == (0, "session")
    # the target's queue is 3 s longer than the holder's (its own prefill not counted)
    cs = [_held("a", 60.0, 1.0, own=True),
          _held("b", 40.0, 0.5, pending=3000, wait=4.0, tokens=1000)]
    assert p.pick(cs, [3.0, 1.0]) == (0, "session")
    cs[1].est_wait_s = 2.0  # queue 1.5 s: within the penalty
    assert p.pick(cs, [3.0, 1.0]) == (1, "rebalance")
    # a prefix held without the session (a sibling's) is not the holder's to shed
    cs = [_held("a", 60.0, 1.0, own=True), _held("b", 40.0, 0.5)]
    cs[0].session_match = False
    assert p.pick(cs, [3.0, 1.0])[0] == 0
    with pytest.raises(ValueError, match="rebalance_slack"):
        StickyPicker(rebalance_slack=-1)
    with pytest.raises(ValueError, match="rebalance_budget"):
        StickyPicker(rebalance_budget=1.5)


def test_active_scorer_counts_requests_not_tokens():
    """llm-d's active-request scorer: (most - mine) / most over request counts; a 900K-token
    request weighs what a 10-token one does, and no requests anywhere scores all alike."""
    from agentserve.router.scorers import SCORERS
    a = SCORERS["active"]()
    s = a.score([Candidate("a", inflight=0, inflight_tokens=900_000),
                 Candidate("b", inflight=2, inflight_tokens=10), Candidate("c", inflight=4)])
    assert s == pytest.approx([1.0, 0.5, 0.0])
    assert a.score([Candidate("a"), Candidate("b")]) == [1.0, 1.0]


def test_gpu_prefix_scorer_gives_the_cpu_tier_no_credit():
    from agentserve.router.scorers import SCORERS
    c = Candidate("a", matched_blocks=2, weighted_blocks=3.6, total_blocks=4)
    assert SCORERS["gpu_prefix"]().score([c, Candidate("b")]) == pytest.approx([0.5, 0.0])
    assert SCORERS["prefix"]().score([c]) == pytest.approx([0.9])
