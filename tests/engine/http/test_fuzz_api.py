"""Property: whatever JSON a client sends to an endpoint, the answer is a 200 or a 4xx with a
well-formed error object, never a 500 or a hang, and the engine keeps no blocks after.

Bodies start from a valid one and have random fields set to random JSON values (the
endpoint's own field names, so the values reach the checks behind them); the strategies are
in tests/fuzzing.py, shared with the router's parse fuzz and benchmarks/harden_fuzz.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from tests.conftest import API_KEY, ServerThread, wait_idle
from tests.fuzzing import ENDPOINTS, bodies


def _send(served: ServerThread, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(served.url + path, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_any_body_gets_an_answer_or_a_4xx(served: ServerThread, path: str) -> None:
    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies(path))
    def check(body: dict[str, Any]) -> None:
        status, raw = _send(served, path, body)
        assert status == 200 or 400 <= status < 500, (status, body, raw[:400])
        if status != 200:
            err = json.loads(raw)
            detail = err["error"]
            assert isinstance(detail["message"], str) and detail["message"], err
            if path == "/v1/messages":
                assert err["type"] == "error"

    check()
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0
