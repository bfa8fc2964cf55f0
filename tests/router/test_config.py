"""Config loading: presets, overrides, validation."""

import pytest

from agentserve.router.config import PRESETS, build_config, load_config
from agentserve.router.picker import build_picker
from agentserve.router.scorers import build_scorers


def test_yaml_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("policy: precise-prefix\nendpoints:\n  - url: http://a:1/\n"
                 "    kv_events: tcp://a:5557\n    role: both\n    hash_seed: 0\n"
                 "scorers: {queue: 3}\noptions: {speculative_ttl_s: 0.5}\n")
    c = load_config(p)
    assert c.endpoints[0].url == "http://a:1" and c.endpoints[0].hash_seed == "0"
    assert c.scorers["queue"] == 3 and c.scorers["prefix"] == 2.0
    assert c.options.speculative_ttl_s == 0.5 and c.index == "precise"


@pytest.mark.parametrize("policy", sorted(PRESETS))
def test_every_preset_builds(policy):
    c = build_config({"policy": policy})
    build_scorers(c.scorers)
    build_picker(c.picker)


@pytest.mark.parametrize("raw,msg", [
    ({"policy": "nope"}, "unknown policy"),
    ({"bogus": 1}, "unknown router config keys"),
    ({"options": {"nope": 1}}, "unknown router options"),
    ({"endpoints": [{"url": "http://a", "role": "x"}]}, "role must be"),
    ({"endpoints": [{"url": "localhost:8000"}]}, "url must be http"),
    ({"endpoints": [{"url": 8000}]}, "url must be http"),
    ({"endpoints": [{"url": "http://a", "kv_events": "localhost:5557"}]}, "ZMQ endpoint"),
    ({"endpoints": [{"url": "http://a", "block_size": 0}]}, "block_size must be a positive"),
    ({"endpoints": [{"url": "http://a", "dp_ranks": "2"}]}, "dp_ranks must be a positive"),
])
def test_errors_say_what_is_wrong(raw, msg):
    with pytest.raises(ValueError, match=msg):
        build_config(raw)


def test_unknown_scorer_and_picker():
    with pytest.raises(ValueError, match="unknown scorer"):
        build_scorers({"nope": 1})
    with pytest.raises(ValueError, match="unknown picker"):
        build_picker({"type": "nope"})


def test_default_preset_moves_sessions_only_to_balance():
    p = build_picker(build_config({}).picker)
    assert p.moves_must_balance and p.force_move_s is None and p.penalty_s == 2.0
    c = build_config({"scorers": {"session_tokens": 0.5}})
    assert c.scorers["session_tokens"] == 0.5 and c.scorers["balance"] == 0.5
    assert any(type(s).__name__ == "SessionTokensScorer" for _, s in build_scorers(c.scorers))


@pytest.mark.parametrize("name,value", [("header_timeout_s", 0), ("body_timeout_s", -1),
                                        ("max_connections", "many"), ("drain_timeout_s", True)])
def test_http_bounds_must_be_positive_numbers(name, value):
    with pytest.raises(ValueError, match=f"router option {name} must be a number > 0"):
        build_config({"options": {name: value}})
    o = build_config({}).options
    assert (o.header_timeout_s, o.body_timeout_s, o.max_connections, o.drain_timeout_s) == \
        (30.0, 60.0, 2048, 30.0)
