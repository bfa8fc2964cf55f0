"""Session liveness: which sessions count as active on their endpoint (router/liveness.py)."""

import random
import time

import pytest

from agentserve.router.config import build_config
from agentserve.router.core import RouteInput, Router
from agentserve.router.liveness import SessionLiveness

URLS = [f"http://e{i}" for i in range(4)]


def make(**options):
    eps = [{"url": u, "kv_events": f"tcp://127.0.0.1:{6000 + i}", "block_size": 16}
           for i, u in enumerate(URLS)]
    return Router(build_config({"policy": "default", "endpoints": eps,
                                "options": {"speculative_ttl_s": 0.0, **options}}))


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(30000) for _ in range(n)]


def pauses(live, values, t=0.0, session="p"):
    """Feed one session's pauses: end a request, wait, start the next."""
    session = f"{session}{len(live.pauses)}-{t}"
    live.start(session, t)
    for v in values:
        t += 1.0
        live.end(session, t)
        t += v
        live.start(session, t)
    live.end(session, t + 1.0)
    return t


def test_limit_is_the_quantile_of_observed_pauses_within_bounds():
    live = SessionLiveness(max_s=60.0, quantile=0.9, max_sessions=100)
    assert live.limit_s() == 60.0  # nothing seen yet: the upper bound
    pauses(live, [2.0] * 80 + [30.0] * 16)  # refreshed every 16 pauses
    assert live.limit_s() == pytest.approx(30.0)
    pauses(live, [0.01] * 512)  # back-to-back turns: the floor, not zero
    assert live.limit_s() == 1.0
    pauses(live, [500.0] * 512)  # paused for longer than the cap
    assert live.limit_s() == 60.0


def test_fixed_window_without_quantile_and_concurrent_requests_are_not_pauses():
    live = SessionLiveness(max_s=60.0, quantile=None, max_sessions=100)
    pauses(live, [2.0] * 100)
    assert live.limit_s() == 60.0 and not live.pauses
    live = SessionLiveness(max_s=60.0, quantile=0.9, max_sessions=100)
    for i in range(40):  # sub-agents in flight together: no pause between them
        live.start("s", float(i))
    assert live.busy("s") and not live.pauses
    for i in range(40):
        live.end("s", 50.0)
    assert not live.busy("s")


def test_ended_sessions_stop_counting_and_new_sessions_go_where_they_ended():
    """Sessions whose pause outlasts the learned limit no longer count on their endpoint,
    so a new session goes there, not to an endpoint whose sessions are still live."""
    r = make()
    live = r.liveness
    pauses(live, [0.5] * 40)  # this deployment's agents come back within a second
    assert live.limit_s() == 1.0
    placed = {}
    for s in range(8):  # two sessions per endpoint
        d = r.decide(RouteInput(toks(300, s), session=f"s{s}"))
        placed[f"s{s}"] = d
    done = r.sessions["s0"]
    for s, d in placed.items():
        if r.sessions[s] == done:
            r.finish(d)  # both sessions of one endpoint end their turns...
            r.endpoints[done].active[s] -= 5.0  # ...five seconds ago
    cands = {c.url: c for c in r.candidates(RouteInput(toks(300, 99), session="new"),
                                             time.monotonic())[0]}
    assert cands[done].active_sessions == 0
    assert all(cands[u].active_sessions == 2 for u in URLS if u != done)  # still in flight
    assert r.decide(RouteInput(toks(300, 99), session="new")).url == done


def test_in_flight_sessions_count_however_long_their_request_runs():
    r = make(session_active_s=2.0, session_pause_quantile=None)
    d = r.decide(RouteInput(toks(300, 1), session="long"))
    ep = r.endpoints[d.url]
    ep.active["long"] -= 100.0  # booked 100 s ago, still streaming
    assert ep.active_sessions(time.monotonic(), 2.0, r.liveness.busy) == 1
    r.finish(d)
    r.finish(d)  # a second finish is a no-op
    assert not r.liveness.busy("long") and ep.inflight == 0


def test_bad_quantile_is_refused():
    with pytest.raises(ValueError, match="session_pause_quantile"):
        build_config({"options": {"session_pause_quantile": 1.5}})


def test_session_rates_feed_the_rebalancing_candidates():
    """A session's rate is one over its recent interval between requests (EWMA, at least
    1 s), or over the time since its last request when longer; seen once, 1 / max(age,
    10 s). With rebalancing on, each candidate carries its live sessions' summed rate,
    the request's own apart."""
    live = SessionLiveness(60.0, 0.9, 100)
    for t in (0.0, 5.0, 10.0, 15.0, 20.0):
        live.start("steady", t)
        live.end("steady", t + 1.0)
    live.start("new", 20.0)
    assert live.rate("steady", 20.0) == pytest.approx(1 / 5)
    assert live.rate("steady", 30.0) == pytest.approx(1 / 10)  # quiet for 10 s
    assert live.rate("new", 20.0) == pytest.approx(1 / 10)
    assert live.rate("new", 35.0) == pytest.approx(1 / 15)
    assert live.rate("never", 20.0) == 0.0
    live.start("steady", 40.0)  # one 20 s interval: the estimate moves half way
    assert live.rate("steady", 40.0) == pytest.approx(1 / 12.5)
    for t in (0.0, 0.01, 0.02):  # a burst counts as one request a second
        live.start("burst", t)
    assert live.rate("burst", 0.02) == pytest.approx(1.0)

    eps = [{"url": u, "kv_events": f"tcp://127.0.0.1:{6000 + i}", "block_size": 16}
           for i, u in enumerate(URLS)]
    r = make()  # the default: rebalancing on, `rate` scorer
    for turn in range(3):
        for s in range(4):
            r.finish(r.decide(RouteInput(toks(300 + 50 * turn, s), session=f"s{s}")))
    cands = r.candidates(RouteInput(toks(400, 0), session="s0"), time.monotonic())[0]
    home = r.sessions["s0"]
    by = {c.url: c for c in cands}
    # three turns each within milliseconds: a burst, one request a second
    assert all(c.session_rate == pytest.approx(1.0) for c in cands)
    assert sum(c.active_rate for c in cands) == pytest.approx(3 * 1.0)  # s1..s3
    assert by[home].active_rate == pytest.approx(
        sum(1.0 for s in ("s1", "s2", "s3") if r.sessions[s] == home))
    # with neither rebalancing nor the `rate` scorer the router does not spend the time
    r = Router(build_config({"policy": "default", "endpoints": eps,
                             "picker": {"rebalance_slack": None}, "scorers": {"rate": 0.0},
                             "options": {"speculative_ttl_s": 0.0}}))
    r.finish(r.decide(RouteInput(toks(300, 1), session="s1")))
    assert all(c.active_rate == 0.0 for c in
               r.candidates(RouteInput(toks(400, 0), session="s0"), time.monotonic())[0])
