"""Token-id prompts read incrementally from body bytes: same ids, same block keys, same
errors as a full decode, whatever the bytes look like."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.hashing import BlockHasher
from agentserve.router.config import build_config
from agentserve.router.core import Router
from agentserve.router.index import block_key
from agentserve.prompt.rawprompt import RawPromptCache, common_prefix
from agentserve.router.requests import BadRequest, parse_request

HDR = {"x-session-id": "s1"}


def body(prompt, sep=",", **extra) -> bytes:
    fields = {"model": "m", "prompt": prompt, **extra}
    return json.dumps(fields, separators=(sep, ":")).encode()


def router() -> Router:
    return Router(build_config({"policy": "precise-prefix", "endpoints": [
        {"url": "http://e0", "kv_events": "tcp://127.0.0.1:1", "block_size": 16}]}))


def keys(tokens: list[int]) -> list[int]:
    return [block_key(h) for h in BlockHasher("sha256_cbor", 16).hash_blocks(tokens)]


def test_common_prefix() -> None:
    assert common_prefix(b"", b"abc") == 0
    assert common_prefix(b"abcdefghij", b"abcdefghij") == 10
    assert common_prefix(b"abcdefghijk", b"abcdefghiXk") == 9
    assert common_prefix(b"0123456789abcdef0", b"0123456789abcdeX0") == 15


def test_next_turn_is_incremental_and_exact() -> None:
    rng = random.Random(0)
    cache, r = RawPromptCache(), router()
    toks = [rng.randrange(50000) for _ in range(3000)]
    for turn in range(6):
        route = parse_request("/v1/completions", body(toks, max_tokens=5), HDR, None, cache)
        assert list(route.token_ids) == toks
        d = r.decide(route)
        assert list(d.keys) == keys(toks)
        assert route.max_tokens == 5
        toks = toks + [rng.randrange(50000) for _ in range(rng.randrange(1, 700))]
    assert cache.parses == {"full": 1, "incremental": 5}


def test_same_body_twice_and_shorter_prompt() -> None:
    cache = RawPromptCache()
    toks = list(range(100, 600))
    a = parse_request("/v1/completions", body(toks), HDR, None, cache)
    b = parse_request("/v1/completions", body(toks), HDR, None, cache)
    c = parse_request("/v1/completions", body(toks[:250]), HDR, None, cache)
    d = parse_request("/v1/completions", body(toks[:250] + [7, 8]), HDR, None, cache)
    assert list(a.token_ids) == list(b.token_ids) == toks
    assert list(c.token_ids) == toks[:250]
    assert list(d.token_ids) == toks[:250] + [7, 8]
    assert cache.parses["incremental"] == 3


def test_other_fields_and_order_changes_fall_back_or_stay_exact() -> None:
    cache = RawPromptCache()
    toks = list(range(1000, 1400))
    parse_request("/v1/completions", body(toks, max_tokens=1), HDR, None, cache)
    # a field after the prompt changes: still incremental, the new value is read
    r = parse_request("/v1/completions", body(toks + [5], max_tokens=9), HDR, None, cache)
    assert r.max_tokens == 9 and list(r.token_ids) == toks + [5]
    # a field before the prompt changes: full path, same answer
    b = json.dumps({"max_tokens": 3, "model": "m", "prompt": toks + [5, 6]}).encode()
    r = parse_request("/v1/completions", b, HDR, None, cache)
    assert r.max_tokens == 3 and list(r.token_ids) == toks + [5, 6]
    # a token that only extends the digits of a cached one ("12" -> "123") is not shared
    r = parse_request("/v1/completions", body(toks[:-1] + [toks[-1] * 10 + 3]), HDR, None,
                      cache)
    assert list(r.token_ids) == toks[:-1] + [toks[-1] * 10 + 3]


@pytest.mark.parametrize("tail", ['true', '1.5', '"x"', '[1]', 'null', '-'])
def test_bad_tail_is_a_400_not_a_crash(tail: str) -> None:
    cache = RawPromptCache()
    toks = list(range(300))
    good = body(toks)
    parse_request("/v1/completions", good, HDR, None, cache)
    bad = good[:-len(b"]}")] + b"," + tail.encode() + b"]}"
    with pytest.raises(BadRequest):
        parse_request("/v1/completions", bad, HDR, None, cache)


def test_batch_and_text_prompts_take_the_full_path() -> None:
    cache = RawPromptCache()
    r = parse_request("/v1/completions", body([[1, 2, 3]]), HDR, None, cache)
    assert list(r.token_ids) == [1, 2, 3]
    r = parse_request("/v1/completions", body("hello"), HDR, None, cache)
    assert list(r.token_ids) == []  # no tokenizer: routed by load
    with pytest.raises(BadRequest):
        parse_request("/v1/completions", body([]), HDR, None, cache)
    assert len(cache) == 0


def test_cache_is_bounded_by_bytes() -> None:
    cache = RawPromptCache(max_bytes=20_000)
    for s in range(50):
        parse_request("/v1/completions", body(list(range(s, s + 1000))),
                      {"x-session-id": f"s{s}"}, None, cache)
    assert cache.bytes <= 20_000 and 1 <= len(cache) < 50


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40), min_size=1,
                max_size=6),
       st.sampled_from([",", ", ", " ,\n "]), st.booleans())
def test_any_turn_sequence_matches_a_full_decode(growth, sep, session) -> None:
    cache = RawPromptCache()
    hdr = {"x-session-id": "s"} if session else {}
    toks: list[int] = [7] * 20
    for g in growth:
        toks = toks + g
        b = json.dumps({"model": "m", "prompt": toks, "n": 1},
                       separators=(sep, ":")).encode()
        route = parse_request("/v1/completions", b, hdr, None, cache)
        assert list(route.token_ids) == msgspec.json.decode(b)["prompt"]
        assert list(router().decide(route).keys) == keys(toks)
