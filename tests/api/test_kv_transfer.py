"""`engine.transfer_params` alone: signatures, peers, host syntax, and any JSON value as
kv_transfer_params giving a 400/403 or passing, never another exception."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.api.openai import APIError
from agentserve.api.kv_transfer import (
    AUTH_HEADER,
    TransferPolicy,
    admit,
    check_shape,
    host_ok,
    parse_peers,
    sign,
    verify,
)

POLICY = TransferPolicy(enabled=True, token="tok", block_size=16, hash_bytes=32, max_blocks=64)
GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "10.0.0.7",
        "remote_port": 5600, "remote_request_id": "cmpl-1", "remote_engine_id": "agentserve-x",
        "remote_block_ids": [1, 2], "remote_block_hashes": ["0f" * 32, "A0" * 32],
        "remote_num_tokens": 40, "remote_block_size": 16, "tp_size": 1, "transfer_mode": "pull",
        "vendor_extra": {"kept": [1.5, None]}}


def test_a_signature_survives_the_json_round_trip_and_binds_params_time_and_purpose() -> None:
    header = sign("tok", GOOD)
    again = msgspec.json.decode(msgspec.json.encode(GOOD))  # what the engine decodes
    assert verify("tok", header, again) is None
    assert verify("tok", header, json.loads(json.dumps(GOOD, indent=2))) is None
    assert "bad signature" in verify("tok", header, {**GOOD, "remote_port": 5601})
    assert "bad signature" in verify("other", header, GOOD)
    assert "bad signature" in verify("tok", header, GOOD, purpose="release")
    assert "s old" in verify("tok", sign("tok", GOOD, now=time.time() - 120), GOOD)
    assert "s old" in verify("tok", sign("tok", GOOD, now=time.time() + 120), GOOD)
    for bad in (None, "", "abc", "12.", ".ff", "1e3.ff", "１２.ff", "1.ÿ"):
        assert verify("tok", bad, GOOD) is not None


def test_admit_checks_shape_then_signature_then_peers() -> None:
    admit(GOOD, {AUTH_HEADER: sign("tok", GOOD)}, POLICY)
    with pytest.raises(APIError) as e:
        admit(GOOD, {}, POLICY)
    assert e.value.status == 403 and e.value.param == "kv_transfer_params"
    with pytest.raises(APIError) as e:
        admit({**GOOD, "remote_port": "x"}, {}, POLICY)  # shape first: a 400, signed or not
    assert e.value.status == 400 and e.value.param == "kv_transfer_params.remote_port"
    admit({**GOOD, "do_remote_prefill": False}, {}, POLICY)  # asks nothing: not acted on
    admit(GOOD, {}, TransferPolicy(enabled=True, insecure=True))
    admit(GOOD, {}, TransferPolicy())  # no transfer on this engine: shape only
    peers = TransferPolicy(enabled=True, token="tok", peers=parse_peers("10.0.0.7:5601"))
    with pytest.raises(APIError, match="--kv-transfer-peers") as e:
        admit(GOOD, {AUTH_HEADER: sign("tok", GOOD)}, peers)
    assert e.value.status == 403
    ok = TransferPolicy(enabled=True, token="tok", peers=parse_peers("[::1]:1, 10.0.0.7:5600"))
    admit(GOOD, {AUTH_HEADER: sign("tok", GOOD)}, ok)


def test_peers_and_hosts() -> None:
    assert parse_peers(" a.example:1,[::1]:65535 ,10.0.0.1:80") == frozenset(
        {("a.example", 1), ("::1", 65535), ("10.0.0.1", 80)})
    assert parse_peers("") is None and parse_peers(None) is None
    for bad in ("host", "host:0", "host:x", "http://h:1", "h/p:1", ":5"):
        with pytest.raises(ValueError, match="kv-transfer-peers"):
            parse_peers(bad)
    for good in ("localhost", "prefill-0.svc.cluster.local", "10.0.0.1", "::1", "fe80::1", "a_b"):
        assert host_ok(good), good
    for bad in ("", "http://x", "x/y", "x:1", "[::1]", "-x", "a..b", "x" * 254, "a b"):
        assert not host_ok(bad), bad


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=70),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                        max_size=4), max_leaves=12)
FIELDS = st.sampled_from(list(GOOD) + ["other"])


@settings(max_examples=400, deadline=None)
@given(st.one_of(JSON, st.dictionaries(FIELDS, JSON, max_size=6),
                 st.builds(lambda k, v: {**GOOD, k: v}, FIELDS, JSON)))
def test_any_value_is_a_4xx_or_passes(params) -> None:
    for headers in ({}, {AUTH_HEADER: sign("tok", params) if _jsonable(params) else "1.x"}):
        try:
            admit(params, headers, POLICY)
        except APIError as e:
            assert e.status in (400, 403) and "kv_transfer_params" in e.message


def _jsonable(x) -> bool:
    try:
        json.dumps(x, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def test_shape_errors_name_the_field_and_show_the_value() -> None:
    with pytest.raises(APIError) as e:
        check_shape({"remote_port": "abc"}, POLICY)
    assert e.value.message == "kv_transfer_params.remote_port must be an integer 1-65535, got 'abc'"
    with pytest.raises(APIError, match="got 'x{76}\\.\\.\\.$"):  # a long value is cut
        check_shape({"remote_host": "x" * 300}, POLICY)
