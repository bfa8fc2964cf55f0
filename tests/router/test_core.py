"""Router.decide without HTTP: prefix routing, predictions, speculation, affinity, modes."""

import random
import time

import pytest

from agentserve.kv.hashing import BlockHasher
from agentserve.router.config import build_config
from agentserve.router.core import NoEndpoint, RouteInput, Router
from agentserve.router.index import block_key

BS = 16
URLS = [f"http://e{i}" for i in range(4)]


def make(policy="default", **over):
    eps = [{"url": u, "kv_events": f"tcp://127.0.0.1:{5000 + i}", "block_size": BS}
           for i, u in enumerate(URLS)]
    raw = {"policy": policy, "endpoints": eps, **over}
    return Router(build_config(raw))


def toks(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(30000) for _ in range(n)]


def hold(r, url, tokens):
    keys = [block_key(h) for h in BlockHasher("sha256_cbor", BS).hash_blocks(tokens)]
    r.index.store((url, 0), keys)


def busy(r, url, n):
    """Give `url` n more active sessions (as if their latest turns went there now)."""
    ep = r.endpoints[url]
    for i in range(n):
        ep.active[f"other-{url}-{len(ep.active)}-{i}"] = time.monotonic()


def test_routes_to_prefix_holder_and_predicts_cached():
    r = make("precise-prefix")
    t = toks(1000)
    hold(r, URLS[2], t[:640])
    d = r.decide(RouteInput(t + toks(50, 1)))
    assert d.url == URLS[2] and d.reason == "prefix"
    assert d.predicted_cached == 640


def test_prediction_caps_at_prompt_minus_one():
    r = make("precise-prefix")
    t = toks(64)  # exactly 4 blocks, all cached: the engine recomputes the last block
    hold(r, URLS[1], t)
    d = r.decide(RouteInput(t))
    assert d.url == URLS[1] and d.predicted_cached == 48
    t2 = toks(65)
    hold(r, URLS[1], t2)
    assert r.decide(RouteInput(t2)).predicted_cached == 64


def test_speculation_groups_a_burst():
    r = make("default")
    shared = toks(2000, 7)
    first = r.decide(RouteInput(shared + toks(30, 1)))
    sib = [r.decide(RouteInput(shared + toks(30, 10 + i))) for i in range(3)]
    assert {d.url for d in sib} == {first.url}


def test_without_speculation_a_burst_spreads_by_load():
    r = make("precise-prefix")
    shared = toks(2000, 7)
    urls = {r.decide(RouteInput(shared + toks(30, 10 + i))).url for i in range(4)}
    assert len(urls) == 4  # in-flight tokens steer them apart


def test_sticky_until_saturated():
    r = make("default", picker={"type": "sticky", "penalty_s": 0.5},
             options={"prefill_tok_per_s": 1000.0, "speculative_ttl_s": 0.0})
    t = toks(800)
    hold(r, URLS[0], t)
    assert r.decide(RouteInput(t + [1] * 20)).url == URLS[0]
    r.endpoints[URLS[0]].pending_prefill = 5000  # 5 s of queued prefill there
    # ... but no more sessions there than elsewhere: a move would not balance, stay
    d = r.decide(RouteInput(t + [2] * 20))
    assert d.url == URLS[0] and d.reason == "prefix"
    busy(r, URLS[0], 3)  # it also has the most sessions: saturated, shed this one
    d = r.decide(RouteInput(t + [3] * 20))
    assert d.url != URLS[0] and d.reason == "saturated"


def test_session_affinity_breaks_ties():
    r = make("default")
    d1 = r.decide(RouteInput(toks(100, 1), session="s1"))
    r.finish(d1)
    d2 = r.decide(RouteInput(toks(100, 2), session="s1"))
    assert d2.url == d1.url


def test_round_robin_and_least_loaded():
    r = make("round-robin")
    assert [r.decide(RouteInput(toks(10))).url for _ in range(4)] == URLS
    r = make("least-loaded")
    r.endpoints[URLS[0]].inflight_tokens = 10_000
    assert r.decide(RouteInput(toks(10))).url != URLS[0]


def test_approx_mode_remembers_routed_prefixes():
    r = make("approx-prefix")
    t = toks(3000, 3)
    d1 = r.decide(RouteInput(t))
    r.finish(d1)
    d2 = r.decide(RouteInput(t + toks(100, 4)))
    assert d2.url == d1.url and d2.predicted_cached == 3000 // BS * BS


def test_finish_releases_load():
    r = make("least-loaded")
    d = r.decide(RouteInput(toks(100), max_tokens=10))
    ep = r.endpoints[d.url]
    assert ep.inflight == 1 and ep.inflight_tokens == 110 and ep.pending_prefill == 100
    r.finish(d)
    assert (ep.inflight, ep.inflight_tokens, ep.pending_prefill) == (0, 0, 0)
    d = r.decide(RouteInput(toks(100, 2), max_tokens=10, samples=3))  # n = 3: 3 outputs
    assert r.endpoints[d.url].inflight_tokens == 130
    r.finish(d)


def test_n_is_read_from_the_body():
    from agentserve.router.requests import parse_request

    def samples(extra: str) -> int:
        body = ('{"prompt": [1, 2, 3], "max_tokens": 4' + extra + '}').encode()
        return parse_request("/v1/completions", body, {}, None).samples

    assert samples("") == 1 and samples(', "n": 4') == 4
    # out of the engines' range: charged as one; the engine answers it with its 400
    assert samples(', "n": 0') == samples(', "n": 1000') == samples(', "n": "2"') == 1


def test_no_healthy_and_unknown_model():
    r = make()
    r.endpoints[URLS[0]].models = ["tiny"]
    for u in URLS[1:]:
        r.endpoints[u].models = ["tiny"]
    with pytest.raises(NoEndpoint) as e:
        r.decide(RouteInput(toks(10), model="nope"))
    assert e.value.status == 404
    for ep in r.endpoints.values():
        ep.healthy = False
    with pytest.raises(NoEndpoint) as e:
        r.decide(RouteInput(toks(10)))
    assert e.value.status == 503


def test_remove_endpoint_forgets_it():
    r = make("precise-prefix")
    t = toks(500)
    hold(r, URLS[3], t)
    r.remove_endpoint(URLS[3])
    assert r.decide(RouteInput(t)).url != URLS[3] and len(r.index) == 0


def test_default_spreads_new_sessions_by_active_sessions():
    r = make("default")
    for s in range(8):  # no prefix anywhere: balance places them two per endpoint
        r.finish(r.decide(RouteInput(toks(300, 100 + s), session=f"s{s}")))
    counts = [len(r.endpoints[u].active) for u in URLS]
    assert counts == [2, 2, 2, 2]
    # a session's next turn stays where its prefix is, whatever the balance says
    t = toks(900, 5)
    home = r.sessions["s3"]
    hold(r, home, t)
    ep = r.endpoints[home]
    ep.active.update({f"x{i}": ep.active["s3"] for i in range(5)})
    assert r.decide(RouteInput(t + [1] * 40, session="s3")).url == home


def test_a_session_that_moves_is_counted_on_its_new_endpoint():
    r = make("default", options={"prefill_tok_per_s": 1000.0, "speculative_ttl_s": 0.0})
    t = toks(800)
    hold(r, URLS[0], t)
    assert r.decide(RouteInput(t + [1] * 20, session="a")).url == URLS[0]
    r.endpoints[URLS[0]].pending_prefill = 5000
    busy(r, URLS[0], 2)
    d = r.decide(RouteInput(t + [2] * 20, session="a"))
    assert d.url != URLS[0] and d.reason == "saturated"
    assert "a" not in r.endpoints[URLS[0]].active and "a" in r.endpoints[d.url].active


def test_prefill_speed_is_learned_from_first_byte():
    r = make("default")
    d = r.decide(RouteInput(toks(4000)))
    d.sent_at -= 2.0  # as if the first byte came 2 s after the decision
    r.first_byte(d)
    rate = r.endpoints[d.url].prefill_tok_s
    assert 1500 < rate < 2100
    c = {c.url: c for c in r.candidates(RouteInput(toks(4000, 3)), 0.0)[0]}[d.url]
    assert c.est_wait_s == pytest.approx(4000 / rate)


def test_prefix_in_the_cpu_tier_keeps_the_session_sticky():
    """Evicted to the engine's CPU tier (BlockStored medium CPU, weight 0.8), the prefix
    still holds the session: it is not re-placed by balance or load."""
    r = make("default", options={"speculative_ttl_s": 0.0})
    t = toks(1600, 9)
    keys = [block_key(h) for h in BlockHasher("sha256_cbor", BS).hash_blocks(t)]
    r.index.store((URLS[1], 0), keys, medium="CPU")
    busy(r, URLS[1], 2)  # more sessions there than elsewhere
    r.endpoints[URLS[1]].inflight_tokens = 50_000  # and busier right now
    d = r.decide(RouteInput(t + [7] * 40, session="cpu"))
    assert d.url == URLS[1] and d.predicted_cached == 1600
    r.index.remove((URLS[1], 0), keys, medium="CPU")  # gone from the CPU tier as well
    assert r.decide(RouteInput(t + [8] * 40, session="cpu2")).url != URLS[1]


def test_session_tokens_spread_large_sessions():
    """With the session_tokens scorer, a new session avoids the endpoint whose active
    sessions are largest, though every endpoint has as many sessions."""
    r = make("default", scorers={"session_tokens": 0.5},
             options={"speculative_ttl_s": 0.0})
    for s in range(4):  # one session per endpoint, the first one 20x larger
        d = r.decide(RouteInput(toks(4000 if s == 0 else 200, 200 + s), session=f"s{s}"))
        r.finish(d)
    big = r.sessions["s0"]
    assert sorted(len(r.endpoints[u].active) for u in URLS) == [1, 1, 1, 1]
    c = {c.url: c for c in r.candidates(RouteInput(toks(300, 9), session="new"), 0.0)[0]}
    assert c[big].active_tokens == 4000 and all(
        c[u].active_tokens == 200 for u in URLS if u != big)
    # the request's own session does not count against its endpoint
    own = {c.url: c for c in r.candidates(RouteInput(toks(4100, 200), session="s0"), 0.0)[0]}
    assert own[big].active_tokens == 0
    placed = [r.decide(RouteInput(toks(300, 50 + i), session=f"n{i}")).url for i in range(3)]
    assert big not in placed
    # without the scorer, nothing is kept
    r2 = make("default")
    r2.decide(RouteInput(toks(100), session="x"))
    assert r2.session_tokens == {}


def test_prefill_speed_learning_is_not_fooled_by_work_ahead():
    """A request booked behind partly-done prefills sees a short time to first byte for
    a lot of 'ahead' work: that sample may raise the estimate at most 2x."""
    r = Router(build_config({"policy": "default", "endpoints": [
        {"url": "http://e0", "kv_events": "tcp://127.0.0.1:1", "block_size": 16}]}))
    ep = r.endpoints["http://e0"]
    ep.learn_prefill(2000, 1.0)  # alone in the queue: 2,000 tok/s
    assert ep.prefill_tok_s == pytest.approx(2000)
    ep.learn_prefill(200_000, 1.0)  # "200K tok/s": mostly done before
    assert ep.prefill_tok_s <= 2000 * 1.2 + 1e-6  # EWMA step toward 4,000 at most
    before = ep.prefill_tok_s
    ep.learn_prefill(500, 1.0)  # slower samples always count, unclipped
    assert ep.prefill_tok_s == pytest.approx(0.8 * before + 0.2 * 500)
    # nothing ahead, but the engine had the prompt cached after all: 13K tokens "in
    # 0.1 s" must not make the endpoint look 60x faster (it drew large new sessions)
    before = ep.prefill_tok_s
    ep.learn_prefill(13_000, 0.1)
    assert ep.prefill_tok_s == pytest.approx(0.8 * before + 0.2 * 2 * before)


def test_requests_scorer_places_new_sessions_where_fewest_requests_went():
    """With `requests`, a new session goes to the endpoint that served the fewest recent
    requests, though every endpoint has one session (sessions that turn over faster
    send more requests)."""
    r = make("default", scorers={"balance": 0.0, "requests": 1.0},
             options={"speculative_ttl_s": 0.0})
    for s in range(4):
        r.finish(r.decide(RouteInput(toks(300, 300 + s), session=f"s{s}")))
    assert sorted(len(r.endpoints[u].active) for u in URLS) == [1, 1, 1, 1]
    quiet = r.sessions["s2"]
    for s in (0, 1, 3):  # the other sessions take three more turns each, where they are
        t = toks(300, 300 + s)
        hold(r, r.sessions[f"s{s}"], t)
        for k in range(3):
            d = r.decide(RouteInput(t + [k] * 20, session=f"s{s}"))
            assert d.url == r.sessions[f"s{s}"]
            r.finish(d)
    assert r.decide(RouteInput(toks(300, 99), session="new")).url == quiet


def test_recent_requests_decay():
    from agentserve.router.config import EndpointConfig
    from agentserve.router.endpoints import Endpoint
    ep = Endpoint(EndpointConfig(url="http://x"))
    assert ep.recent_requests(0.0, 60.0) == 0.0
    ep.count_request(100.0, 60.0)
    ep.count_request(100.0, 60.0)
    assert ep.recent_requests(100.0, 60.0) == pytest.approx(2.0)
    assert ep.recent_requests(160.0, 60.0) == pytest.approx(2.0 / 2.718281828, rel=1e-6)
    ep.count_request(160.0, 60.0)
    assert ep.recent_requests(160.0, 60.0) == pytest.approx(1.0 + 2.0 / 2.718281828, rel=1e-6)
    with pytest.raises(ValueError, match="recent_requests_s"):
        make("default", options={"recent_requests_s": 0})


def test_rate_scorer_places_new_sessions_by_the_live_sessions_request_rate():
    """`rate` looks forward: an endpoint that served many requests for a session that has
    since ended has no live rate and draws the new session, where `requests` (the last
    minute's count) sends it to the endpoint that served the fewest."""
    def run(scorers):
        r = make("default", scorers={"balance": 0.0, "requests": 0.0, **scorers},
                 options={"speculative_ttl_s": 0.0, "session_pause_quantile": None,
                          "session_active_s": 2.0})
        for s in range(4):
            r.finish(r.decide(RouteInput(toks(300, 300 + s), session=f"s{s}")))
        assert sorted(len(r.endpoints[u].active) for u in URLS) == [1, 1, 1, 1]
        busy, quiet = r.sessions["s0"], r.sessions["s2"]
        for s, turns in ((0, 5), (1, 1), (3, 1)):
            t = toks(300, 300 + s)
            hold(r, r.sessions[f"s{s}"], t)
            for k in range(turns):
                r.finish(r.decide(RouteInput(t + [k] * 20, session=f"s{s}")))
        r.endpoints[busy].active["s0"] -= 10.0  # s0 ended: paused past the 2 s window
        return r.decide(RouteInput(toks(300, 99), session="new")).url, busy, quiet
    url, busy, _ = run({"rate": 1.0})
    assert url == busy
    url, _, quiet = run({"requests": 1.0})
    assert url == quiet
