"""Router.decide without HTTP: prefix routing, predictions, speculation, affinity, modes."""

import random

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
    d = r.decide(RouteInput(t + [2] * 20))
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
