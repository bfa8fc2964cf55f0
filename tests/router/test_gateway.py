"""The HTTP gateway against fake engines: pass-through, errors, retries, limits, admin."""

import asyncio
import json
import re
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from agentserve.router import endpoints
from agentserve.router.config import build_config
from agentserve.router.gateway import Gateway

from .fakes import FakeEngine

KEY = "sekret"


@pytest.fixture
async def stack():
    engines = [FakeEngine("a"), FakeEngine("b")]
    urls = [await e.start() for e in engines]
    made = []

    async def make(policy="least-loaded", **over):
        cfg = build_config({"policy": policy, "endpoints": [{"url": u} for u in urls],
                            "options": {"health_interval_s": 0.2, "scrape_interval_s": 0.05,
                                        **over.pop("options", {})}, **over})
        cfg.api_key = over.get("api_key")
        gw = Gateway(cfg)
        srv = TestServer(gw.app(), handler_cancellation=True)
        await srv.start_server()
        s = aiohttp.ClientSession(str(srv.make_url("")))
        made.append((srv, s))
        await asyncio.sleep(0.3)  # first health check + model discovery
        return gw, s

    yield engines, urls, make
    for srv, s in made:
        await s.close()
        await srv.close()
    for e in engines:
        await e.close()


def prompt(n=40, **kw):
    return {"model": "tiny", "prompt": list(range(1, n + 1)), "max_tokens": 4, **kw}


async def test_non_streaming_pass_through_and_metrics(stack):
    engines, urls, make = stack
    gw, s = await make()
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 200
        body = await r.json()
    assert body["choices"][0]["text"] in ("a", "b")
    async with s.get("/metrics") as r:
        text = await r.text()
    assert "agentserve_router_decisions_total" in text
    assert "agentserve_router_prediction_checked_total 1.0" in text


async def test_request_id_reaches_the_engine_and_comes_back(stack):
    """The client's X-Request-Id, or one the router makes up, goes to the engine and back."""
    engines, urls, make = stack
    gw, s = await make()
    async with s.post("/v1/completions", json=prompt(), headers={"X-Request-Id": "trace-7"}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "trace-7"
    async with s.post("/v1/completions", json=prompt(stream=True)) as r:
        made = r.headers["X-Request-Id"]
        await r.read()
    seen = [rid for e in engines for rid in e.request_ids]
    assert sorted(seen) == sorted(["trace-7", made]) and made != "trace-7"
    async with s.post("/v1/completions", json={"model": "tiny", "prompt": 5}) as r:
        assert r.status == 400 and r.headers["X-Request-Id"]  # the router's own errors too


async def test_streaming_chunk_by_chunk(stack):
    engines, urls, make = stack
    for e in engines:
        e.chunk_gap_s, e.chunks = 0.15, 4
    gw, s = await make()
    arrivals = []
    t0 = time.monotonic()
    async with s.post("/v1/completions", json=prompt(stream=True)) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in r.content.iter_any():
            arrivals.append((time.monotonic() - t0, chunk))
    data = b"".join(c for _, c in arrivals)
    assert data.endswith(b"data: [DONE]\n\n")
    first_text = next(t for t, c in arrivals if b"text" in c)
    assert first_text < 0.3 and arrivals[-1][0] > 0.5  # not buffered until the end


async def test_stream_cut_by_a_dying_engine_ends_in_an_error_event(stack):
    """The openai client ends a stream without [DONE] silently, as if it were whole: the
    router says in-band that it broke, so the client raises."""
    import openai

    engines, urls, make = stack
    for e in engines:
        e.chunks, e.die_after, e.chunk_gap_s = 5, 2, 0.05
    gw, s = await make()
    async with s.post("/v1/completions", json=prompt(stream=True)) as r:
        data = await r.read()
    assert data.endswith(b"data: [DONE]\n\n")
    events = [json.loads(ln[6:]) for ln in data.decode().splitlines()
              if ln.startswith("data: {")]
    assert [e["choices"][0]["text"][1:] for e in events[:-1]] == ["0", "1"]
    assert "broke mid-answer" in events[-1]["error"]["message"]
    client = openai.AsyncOpenAI(base_url=str(s._base_url) + "/v1", api_key="x", max_retries=0)
    texts = []
    with pytest.raises(openai.APIError, match="broke mid-answer"):
        async for chunk in await client.completions.create(stream=True, **prompt()):
            texts.append(chunk.choices[0].text)
    assert len(texts) == 2
    await client.close()


async def test_bad_requests_never_reach_engines(stack):
    engines, urls, make = stack
    gw, s = await make()
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body in (b"not json", b"[1,2]", json.dumps({"prompt": 5}).encode(),
                 json.dumps({"messages": "hi"}).encode(), nested):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        async with s.post(path, data=body) as r:
            assert r.status == 400
            assert "message" in (await r.json())["error"]
    assert not engines[0].calls and not engines[1].calls


async def test_prompt_over_every_context_limit_is_a_400_from_the_router(stack):
    """Endpoints' `max_model_len` (their /v1/models cards) bound the prompt: a prompt that
    fits one endpoint goes there; one that fits none gets vLLM's 400 from the router and
    never reaches an engine or counts as a routing decision."""
    engines, urls, make = stack
    engines[0].max_model_len, engines[1].max_model_len = 64, 32
    gw, s = await make()
    assert [gw.router.endpoints[u].max_model_len for u in urls] == [64, 32]
    for _ in range(3):
        async with s.post("/v1/completions", json=prompt(40)) as r:
            assert r.status == 200 and r.headers["x-agentserve-endpoint"] == urls[0]
    async with s.post("/v1/completions", json=prompt(64)) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error"
    assert "maximum context length is 64 tokens" in err["message"]
    # the engine's error object for the same mistake (api/openai.py check_length)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    assert len(engines[0].calls) == 3 and not engines[1].calls
    async with s.get("/metrics") as r:
        text = await r.text()
    assert sum(float(v) for v in re.findall(
        r"^agentserve_router_decisions_total{[^}]*} (\S+)", text, re.M)) == 3


async def test_context_limit_is_relearned_from_a_restarted_backend(stack, monkeypatch):
    """A backend restarted with another context limit: the router reads /v1/models again
    when the endpoint comes back from an ejection, and every MODELS_REFRESH_S anyway."""
    engines, urls, make = stack
    engines[0].max_model_len = 64
    gw, _ = await make()
    ep = gw.router.endpoints[urls[0]]
    assert ep.max_model_len == 64
    engines[0].max_model_len = 32  # restarted with a smaller limit while it was ejected
    ep.healthy, ep.ejected_until = False, 0.0
    await asyncio.sleep(0.5)  # health checks every 0.2 s
    assert ep.healthy and ep.max_model_len == 32
    engines[0].max_model_len = 128  # restarted between two checks: the periodic re-read
    monkeypatch.setattr(endpoints, "MODELS_REFRESH_S", 0.3)
    await asyncio.sleep(0.8)
    assert ep.max_model_len == 128


async def test_unknown_model_404(stack):
    engines, urls, make = stack
    gw, s = await make()
    async with s.post("/v1/completions", json=prompt(model="other")) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    # as the engine answers it (engine/http/server.py check_model), not an HTTP status as `code`
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error", "model", "model_not_found")


async def test_models_union_and_health(stack):
    engines, urls, make = stack
    engines[1].model = "tiny2"
    gw, s = await make()
    async with s.get("/v1/models") as r:
        assert {m["id"] for m in (await r.json())["data"]} == {"tiny", "tiny2"}
    async with s.get("/health") as r:
        assert r.status == 200


async def test_retry_once_on_next_endpoint_and_eject(stack):
    engines, urls, make = stack
    engines[0].status = 500
    gw, s = await make(policy="round-robin", options={"eject_after_failures": 2,
                                                      "health_interval_s": 30})
    for _ in range(4):
        async with s.post("/v1/completions", json=prompt()) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == "b"
    assert not gw.router.endpoints[urls[0]].available()
    async with s.get("/metrics") as r:
        text = await r.text()
    assert "agentserve_router_retries_total 2.0" in text


async def test_no_healthy_endpoint_503(stack):
    engines, urls, make = stack
    gw, s = await make()
    for e in engines:
        await e.close()
    await asyncio.sleep(0.5)
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status in (502, 503)
        assert "endpoint" in (await r.json())["error"]["message"]


async def test_client_disconnect_cancels_upstream(stack):
    engines, urls, make = stack
    for e in engines:
        e.chunks, e.chunk_gap_s = 50, 0.05
    gw, s = await make()
    async with s.post("/v1/completions", json=prompt(stream=True)) as r:
        await r.content.readany()
    await asyncio.sleep(0.5)
    assert sum(e.cancelled for e in engines) == 1
    assert all(ep.inflight == 0 for ep in gw.router.endpoints.values())


async def test_request_timeout(stack):
    engines, urls, make = stack
    for e in engines:
        e.delay_s = 5
    gw, s = await make(options={"request_timeout_s": 0.3})
    t0 = time.monotonic()
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 502
    assert time.monotonic() - t0 < 2


async def test_admission_queue_full_503_retry_after(stack):
    engines, urls, make = stack
    for e in engines:
        e.delay_s = 0.5
    gw, s = await make(options={"max_inflight": 1, "max_queue": 1, "queue_timeout_s": 5})
    rs = await asyncio.gather(*[s.post("/v1/completions", json=prompt()) for _ in range(3)])
    codes = sorted(r.status for r in rs)
    assert codes == [200, 200, 503]
    bad = next(r for r in rs if r.status == 503)
    assert bad.headers["Retry-After"] == "1"
    for r in rs:
        r.release()


async def test_api_key_and_admin(stack):
    engines, urls, make = stack
    gw, s = await make(api_key=KEY)
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 401
        assert (await r.json())["error"]["code"] == "invalid_api_key"  # the engine's code
    auth = {"Authorization": f"Bearer {KEY}"}
    async with s.delete("/admin/endpoints", params={"url": urls[0]}, headers=auth) as r:
        assert r.status == 200
    for _ in range(3):
        async with s.post("/v1/completions", json=prompt(), headers=auth) as r:
            assert (await r.json())["choices"][0]["text"] == "b"
    async with s.post("/admin/endpoints", json={"url": urls[0]}, headers=auth) as r:
        assert r.status == 200 and (await r.json())["healthy"] is True
    assert urls[0] in gw.router.endpoints
    for bad in ({"url": 5}, {"url": "notaurl"}, {"url": urls[1], "kv_events": "garbage"}, [1]):
        async with s.post("/admin/endpoints", json=bad, headers=auth) as r:
            assert r.status == 400, bad
            assert "bad endpoint config" in (await r.json())["error"]["message"]
    assert set(gw.router.endpoints) == {u.rstrip("/") for u in urls}


async def test_an_endpoint_added_while_serving_gets_traffic_only_once_healthy(stack):
    """Nothing listens at the new URL: the add says so, the router sends it nothing (before,
    it counted as healthy until enough requests had failed on it), and /health names it."""
    import socket

    engines, urls, make = stack
    gw, s = await make(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with s.post("/admin/endpoints", json={"url": dead}, headers=auth) as r:
        assert r.status == 200 and await r.json() == {"added": dead, "healthy": False}
    ep = gw.router.endpoints[dead]
    assert not ep.available() and ep.ejections == 0
    for _ in range(6):
        async with s.post("/v1/completions", json=prompt(), headers=auth) as r:
            assert r.status == 200
    assert ep.inflight == 0 and ep.recent_n == 0, "the unprobed endpoint was sent a request"
    async with s.get("/health") as r:
        assert dead in (await r.json())["unhealthy"]


async def test_reload_of_a_broken_config_is_a_400_and_changes_nothing(stack, tmp_path):
    engines, urls, make = stack
    gw, s = await make(api_key=KEY)
    path = tmp_path / "router.yaml"
    path.write_text("endpoints: [\n")  # not YAML
    gw.config_path = str(path)
    auth = {"Authorization": f"Bearer {KEY}"}
    async with s.post("/admin/reload", headers=auth) as r:
        assert r.status == 400 and "reload failed" in (await r.json())["error"]["message"]
    path.write_text("endpoints:\n  - url: not-a-url\n")
    async with s.post("/admin/reload", headers=auth) as r:
        assert r.status == 400 and "url must be http" in (await r.json())["error"]["message"]
    assert set(gw.router.endpoints) == {u.rstrip("/") for u in urls}


async def test_body_limit_413(stack):
    engines, urls, make = stack
    gw, s = await make(options={"max_body_mb": 0.001})
    async with s.post("/v1/completions", json=prompt(n=2000)) as r:
        assert r.status == 413


async def test_internal_error_is_a_json_500_and_the_router_keeps_serving(stack):
    engines, urls, make = stack
    gw, s = await make()
    pick = gw.router.picker.pick

    def broken(cands, scores):
        raise ValueError("max() arg is an empty sequence")
    gw.router.picker.pick = broken
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 500
        err = (await r.json())["error"]
        assert err["type"] == "internal_error" and "ValueError" in err["message"]
    gw.router.picker.pick = pick
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 200


async def test_tokenize_pass_through_refuses_what_no_engine_could_answer(stack):
    """/tokenize (and /detokenize, count_tokens) go to an engine serving the body's model;
    a model no endpoint serves is a 404 and a body that is not a JSON object a 400, from
    the router itself."""
    engines, urls, make = stack
    gw, s = await make()
    async with s.post("/tokenize", json={"model": "nope", "prompt": "a"}) as r:
        assert r.status == 404 and "nope" in (await r.json())["error"]["message"]
    async with s.post("/tokenize", data=b"[1, 2") as r:
        assert r.status == 400
    async with s.post("/v1/messages/count_tokens", data=b"[" * 100_000) as r:
        assert r.status == 400  # (nested too deeply)
    assert not any(e.calls for e in engines)
