"""Faults inside the engine core: one request that cannot be queued fails alone; a core
thread that stops fails what it held, answers new requests and /health with 503, and no
caller waits forever."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import API_KEY, ServerThread, post

KW = dict(model=None, kv_cache_tokens=4096, block_size=16, max_model_len=1024, max_num_seqs=8,
          max_num_batched_tokens=256, seed=0, check_invariants=True)


@pytest.fixture
def server():
    s = ServerThread(api_key=API_KEY, **KW).start()
    yield s
    s.close()


def test_a_request_that_cannot_be_queued_fails_alone(server: ServerThread, monkeypatch) -> None:
    sched = server.engine.core.scheduler
    real_add = sched.add

    def add(seq):
        if seq.prompt_token_ids[:2] == [13, 13]:
            raise RuntimeError("boom")
        real_add(seq)

    monkeypatch.setattr(sched, "add", add)
    status, body = post(server, "/v1/completions", {"prompt": [13, 13, 14], "max_tokens": 2})
    assert status == 500 and "could not queue the request" in body["error"]["message"]
    status, body = post(server, "/v1/completions", {"prompt": [20, 21, 22], "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert not sched.waiting and not server.engine.core.seqs


class _Crash(BaseException):
    """Something no step handler catches (as a SystemExit raised deep inside a library)."""


def test_a_stopped_core_fails_in_flight_requests_and_health(server: ServerThread,
                                                            monkeypatch) -> None:
    core = server.engine.core
    results: dict[str, tuple] = {}

    def long_request() -> None:
        results["r"] = post(server, "/v1/completions",
                            {"prompt": list(range(30, 90)), "max_tokens": 400, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while not core.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    real_step = core.step

    def step():
        raise _Crash()

    monkeypatch.setattr(core, "step", step)
    t.join(30)
    assert not t.is_alive(), "the in-flight request waited on a dead core"
    status, body = results["r"]
    assert status == 500 and "engine core stopped" in body["error"]["message"]
    status, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and "engine core stopped" in body["error"]["message"]
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(server.url + "/health", timeout=10)
    assert exc.value.code == 503
    monkeypatch.setattr(core, "step", real_step)


def test_a_request_queued_as_the_core_stops_does_not_wait_forever(server: ServerThread,
                                                                   monkeypatch) -> None:
    """The window between generate()'s check and the core's end: the wait is bounded."""
    from agentserve.engine import engine as engine_mod

    core = server.engine.core
    monkeypatch.setattr(core, "step", lambda: (_ for _ in ()).throw(_Crash()))
    post(server, "/v1/completions", {"prompt": [40, 41], "max_tokens": 2})  # stops the core
    assert core.dead is not None
    monkeypatch.setattr(engine_mod, "_DEAD_CHECK_S", 0.2)
    dead, core.dead = core.dead, None  # as if generate() checked just before the core stopped
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, "/v1/completions",
                                                              {"prompt": [42], "max_tokens": 2})))
    t.start()
    time.sleep(0.3)
    core.dead = dead
    t.join(10)
    assert not t.is_alive() and result["r"][0] == 503
