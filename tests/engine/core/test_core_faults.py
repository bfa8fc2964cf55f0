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


def test_a_request_that_cannot_be_scheduled_fails_alone(server: ServerThread,
                                                        monkeypatch) -> None:
    """Scheduling the queue head raises (a bug, a broken tier): that request ends with an
    error at once, instead of failing the same way every step for ever, and the requests
    behind it and beside it are served."""
    sched = server.engine.core.scheduler
    real = sched.kv.get_computed_blocks

    def get_computed_blocks(seq):
        if seq.prompt_token_ids[:2] == [13, 13]:
            raise RuntimeError("boom")
        return real(seq)

    monkeypatch.setattr(sched.kv, "get_computed_blocks", get_computed_blocks)
    results: dict[str, tuple] = {}
    long = threading.Thread(target=lambda: results.update(r=post(
        server, "/v1/completions", {"prompt": list(range(30, 90)), "max_tokens": 60,
                                    "ignore_eos": True})))
    long.start()
    deadline = time.monotonic() + 20
    while not sched.running and time.monotonic() < deadline:
        time.sleep(0.01)
    status, body = post(server, "/v1/completions", {"prompt": [13, 13, 14], "max_tokens": 2})
    assert status == 500 and "could not schedule the request" in body["error"]["message"]
    status, body = post(server, "/v1/completions", {"prompt": [20, 21, 22], "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    long.join(60)
    assert results["r"][0] == 200 and results["r"][1]["usage"]["completion_tokens"] == 60
    assert not sched.waiting and not server.engine.core.seqs
    assert sched.kv.pool.num_used_blocks == 0


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

    def step(failed):
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
    from agentserve.engine.core import engine as engine_mod

    core = server.engine.core
    monkeypatch.setattr(core, "step", lambda failed: (_ for _ in ()).throw(_Crash()))
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


class _BrokenGrammar:
    """A constraint that breaks at its ``after``-th token, in ``apply`` or in ``accept``."""

    def __init__(self, after: int, where: str) -> None:
        self.after, self.where, self.n = after, where, 0

    def apply(self, logits) -> None:
        if self.where == "apply" and self.n >= self.after:
            raise RuntimeError("grammar broke in apply")

    def accept(self, token_id: int) -> None:
        self.n += 1
        if self.where == "accept" and self.n > self.after:
            raise RuntimeError("grammar broke in accept")

    def done(self) -> bool:
        return False


@pytest.mark.parametrize("where", ["apply", "accept", "draw"])
def test_a_request_whose_sampling_fails_ends_alone(where: str) -> None:
    """A broken grammar or a row that is no distribution fails its own request; the other
    requests of the same steps go on unchanged, and no block leaks."""
    import asyncio

    from agentserve.engine.core.engine import AsyncEngine
    from agentserve.engine.core.request import SamplingParams

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    if where == "draw":  # a NaN logit: the row's probabilities are not a distribution
        bad = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True,
                             logit_bias={7: float("nan")})
    else:
        bad = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             constraint=_BrokenGrammar(3, where))

    async def collect(eng, rid, prompt, params):
        toks, last = [], None
        async for out in eng.generate(rid, prompt, params):
            toks += out.new_token_ids
            last = out
        return toks, last

    async def go():
        eng = AsyncEngine.from_args(**{**KW, "max_num_batched_tokens": 512})
        await eng.start()
        try:
            alone, _ = await collect(eng, "alone", list(range(40, 80)), greedy)
            (ok, ok_last), (toks, bad_last) = await asyncio.gather(
                collect(eng, "ok", list(range(40, 80)), greedy),
                collect(eng, "bad", list(range(100, 130)), bad))
            return alone, ok, ok_last, toks, bad_last, eng
        finally:
            await eng.shutdown(5)

    alone, ok, ok_last, toks, bad_last, eng = asyncio.run(go())
    assert ok == alone and len(ok) == 24 and ok_last.error is None
    assert bad_last.finished and bad_last.error and "failed" in bad_last.error
    assert len(toks) <= 3  # what it had before the break
    assert eng.core.kv.pool.num_used_blocks == 0 and not eng.core.seqs
    eng.core.kv.pool.check_invariants()
