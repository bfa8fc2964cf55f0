"""Router P/D orchestration against fake aiohttp engines (vLLM's kv_transfer_params names).

Decision (threshold), prefill choice, fallback on prefill failure, pass-through of the
prefill's params to the decode leg, and pins released when the client leaves between legs.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentserve.api.kv_transfer import AUTH_HEADER, sign, verify
from agentserve.router.config import build_config
from agentserve.router.pd import PREFILL_PARAMS
from agentserve.router.gateway import Gateway
from tests.router.fakes import FakeEngine

TOKEN = "cluster-secret"


class FakePD(FakeEngine):
    """A fake engine that plays vLLM's P/D roles: the prefill leg returns params (with an
    extra field the router must pass through untouched); /v1/kv_transfer/release records."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.released: list[str] = []
        self.auth: list[str | None] = []  # x-agentserve-transfer-auth of each generate call
        self.release_auth: list[str | None] = []
        self.n = 0

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/kv_transfer/release", self.release)
        return app

    async def release(self, request: web.Request) -> web.Response:
        self.released.append((await request.json())["remote_request_id"])
        self.release_auth.append(request.headers.get(AUTH_HEADER))
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.auth.append(request.headers.get(AUTH_HEADER))
        p = body.get("kv_transfer_params") or {}
        if not p.get("do_remote_decode") or self.status != 200:
            return await super().generate(_Replay(request, body))
        self.calls.append(body)
        self.n += 1
        await asyncio.sleep(self.delay_s)
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": f"engine-{self.name}", "remote_block_ids": [1, 2, 3],
                  "remote_host": "10.0.0.7", "remote_port": 5600,
                  "remote_request_id": f"{self.name}-{self.n}", "tp_size": 1,
                  "vendor_extra": {"kept": True}}
        return web.json_response({"id": "p", "object": "text_completion", "model": self.model,
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 10, "completion_tokens": 1},
                                  "kv_transfer_params": params})


class _Replay:
    """The parsed body handed back to FakeEngine.generate (it reads request.json())."""

    def __init__(self, request: web.Request, body: dict) -> None:
        self._r, self._body = request, body

    async def json(self) -> dict:
        return self._body

    def __getattr__(self, name: str):
        return getattr(self._r, name)


@pytest.fixture
async def pd_stack():
    made: list = []

    async def make(roles: list[str], threshold: int = 64, max_model_len: int | None = None,
                   **top: str):
        engines = [FakePD(f"{r}{i}") for i, r in enumerate(roles)]
        for e in engines:
            e.max_model_len = max_model_len
        urls = [await e.start() for e in engines]
        cfg = build_config({"policy": "default",
                            "endpoints": [{"url": u, "role": r} for u, r in zip(urls, roles)],
                            "options": {"health_interval_s": 0.2, "scrape_interval_s": 0.05,
                                        "pd_threshold": threshold}, **top})
        gw = Gateway(cfg)
        srv = TestServer(gw.app(), handler_cancellation=True)
        await srv.start_server()
        s = aiohttp.ClientSession(str(srv.make_url("")))
        made.append((srv, s, engines))
        await asyncio.sleep(0.3)  # first health check + model discovery
        return gw, s, engines

    yield make
    for srv, s, engines in made:
        await s.close()
        await srv.close()
        for e in engines:
            await e.close()


def body(n: int, **kw) -> dict:
    return {"model": "tiny", "prompt": list(range(1, n + 1)), "max_tokens": 4, **kw}


async def metrics(s: aiohttp.ClientSession) -> str:
    async with s.get("/metrics") as r:
        return await r.text()


async def test_threshold_decides_and_params_pass_through(pd_stack) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=64)
    async with s.post("/v1/completions", json=body(20)) as r:  # below the threshold
        assert r.status == 200 and "x-agentserve-pd" not in r.headers
        # computed on the decode engine alone: its cached tokens are predicted (0: nothing
        # stored there yet); a pulled prompt's are not (pulled tokens count as cached)
        assert r.headers["x-agentserve-predicted-cached"] == "0"
    assert p.calls == [] and "kv_transfer_params" not in d.calls[-1]

    async with s.post("/v1/completions", json=body(200, stream=True,
                                                  stream_options={"include_usage": True})) as r:
        assert r.status == 200
        text = await r.text()
        pd_header = r.headers["x-agentserve-pd"]
        assert "x-agentserve-predicted-cached" not in r.headers
    assert "[DONE]" in text and "prefill_ms=" in pd_header
    leg = p.calls[-1]  # the prefill leg: vLLM's request shape
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None,
                                         "remote_host": None, "remote_port": None}
    assert leg["prompt"] == list(range(1, 201))
    dec = d.calls[-1]  # the decode leg: the original body + the prefill's params, untouched
    assert dec["stream"] is True and dec["max_tokens"] == 4 and dec["stream_options"]
    assert dec["kv_transfer_params"]["remote_engine_id"] == "engine-prefill0"
    assert dec["kv_transfer_params"]["remote_block_ids"] == [1, 2, 3]
    assert dec["kv_transfer_params"]["vendor_extra"] == {"kept": True}
    m = await metrics(s)
    assert 'agentserve_router_pd_requests_total{path="aggregated"} 1.0' in m
    assert 'agentserve_router_pd_requests_total{path="disaggregated"} 1.0' in m


async def test_prompt_over_the_context_limit_is_a_400_on_the_pd_path(pd_stack) -> None:
    """On the P/D path too, a prompt no decode endpoint's `max_model_len` leaves room under
    gets vLLM's 400 from the router: no prefill leg, no decode leg, no decision."""
    _, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=64, max_model_len=256)
    async with s.post("/v1/completions", json=body(200)) as r:
        assert r.status == 200 and "x-agentserve-pd" in r.headers
    async with s.post("/v1/completions", json=body(300)) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert "maximum context length is 256 tokens" in err["message"]
    assert len(p.calls) == 1 and len(d.calls) == 1


async def test_client_params_are_removed_and_the_request_split_as_any(pd_stack) -> None:
    """A client's kv_transfer_params (an internal control path) never reach an engine, nor
    does a client-sent signature header, however the key is spelled in JSON."""
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16, kv_transfer_token=TOKEN)
    own = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1,
           "remote_request_id": "theirs"}
    forged = {AUTH_HEADER: sign(TOKEN, own)}  # (even a valid signature: the router's to add)
    async with s.post("/v1/completions", json=body(200, kv_transfer_params=own),
                      headers=forged) as r:
        assert r.status == 200 and "prefill_ms=" in r.headers["x-agentserve-pd"]
    assert p.calls[-1]["kv_transfer_params"] == PREFILL_PARAMS
    assert d.calls[-1]["kv_transfer_params"]["remote_request_id"] == "prefill0-1"
    escaped = json.dumps(body(200, prompt=list(range(500, 700)))).replace(
        '"max_tokens"', '"kv\\u005ftransfer_params": %s, "max_tokens"' % json.dumps(own))
    async with s.post("/v1/completions", data=escaped,
                      headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200
    assert d.calls[-1]["kv_transfer_params"]["remote_request_id"] == "prefill0-2"
    aggregated = body(3, kv_transfer_params=own)  # below the threshold: not split, still removed
    async with s.post("/v1/completions", json=aggregated) as r:
        assert r.status == 200
    assert "kv_transfer_params" not in d.calls[-1] and d.auth[-1] is None
    assert ('agentserve_router_internal_fields_stripped_total{field="kv_transfer_params"} 3.0'
            in await metrics(s))


async def test_an_operators_params_are_kept_signed_and_not_split(pd_stack) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16, kv_transfer_token=TOKEN,
                                   operator_key="op-key")
    own = {"do_remote_prefill": True, "remote_request_id": "theirs"}
    async with s.post("/v1/completions", json=body(200, kv_transfer_params=own),
                      headers={"x-agentserve-operator-key": "op-key"}) as r:
        assert r.status == 200
    assert p.calls == [] and d.calls[-1]["kv_transfer_params"] == own
    assert verify(TOKEN, d.auth[-1], own) is None
    other = body(200, prompt=list(range(500, 700)), kv_transfer_params=own)
    async with s.post("/v1/completions", json=other,
                      headers={"x-agentserve-operator-key": "wrong"}) as r:
        assert r.status == 200  # not the operator: removed, and split as any request
    assert d.calls[-1]["kv_transfer_params"]["remote_request_id"] == "prefill0-1"


async def test_every_leg_and_release_is_signed_with_the_token(pd_stack) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16, kv_transfer_token=TOKEN)
    async with s.post("/v1/completions", json=body(200)) as r:
        assert r.status == 200
    assert verify(TOKEN, p.auth[-1], p.calls[-1]["kv_transfer_params"]) is None
    assert verify(TOKEN, d.auth[-1], d.calls[-1]["kv_transfer_params"]) is None
    assert verify("other", d.auth[-1], d.calls[-1]["kv_transfer_params"]) is not None
    d.status = 503  # the decode leg fails: the router releases the pins, signed
    async with s.post("/v1/completions", json=body(200, prompt=list(range(900, 1100)))) as r:
        assert r.status >= 500
    for _ in range(50):
        if p.released:
            break
        await asyncio.sleep(0.05)
    assert verify(TOKEN, p.release_auth[-1], {"remote_request_id": p.released[-1]},
                  "release") is None


async def test_a_prefill_engine_refusing_the_signature_is_a_403_not_a_fallback(pd_stack) -> None:
    """A router without the cluster's token (or with another) in front of agentserve
    engines: the prefill engine answers 403 and so does the router, naming the fix."""
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    p.status, p.error_message = 403, "kv_transfer_params refused: not signed"
    async with s.post("/v1/completions", json=body(200)) as r:
        assert r.status == 403
        err = (await r.json())["error"]
    assert "not signed" in err["message"] and "--kv-transfer-token" in err["message"]
    assert err["param"] == "kv_transfer_params" and len(d.calls) == 0


async def test_parallel_sampling_is_not_split(pd_stack) -> None:
    """n > 1 goes whole to the decode endpoint (a P/D leg is one sample; the engine computes
    the prompt once for its n samples), and its n outputs are charged to it."""
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    async with s.post("/v1/completions", json={**body(200), "n": 3}) as r:
        assert r.status == 200 and "x-agentserve-pd" not in r.headers
    assert p.calls == [] and d.calls[-1]["n"] == 3 and "kv_transfer_params" not in d.calls[-1]
    assert 'agentserve_router_pd_requests_total{path="aggregated"} 1.0' in await metrics(s)
    other = {**body(200), "prompt": list(range(1000, 1200)), "n": 1}  # (the first is cached now)
    async with s.post("/v1/completions", json=other) as r:
        assert r.status == 200 and "x-agentserve-pd" in r.headers  # n = 1 still splits
    assert len(p.calls) == 1


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 0}, {"echo": True, "logprobs": 1}])
async def test_prompt_scoring_is_not_split(pd_stack, extra) -> None:
    """A request asking for its prompt's logprobs goes whole to the decode endpoint: one
    engine computes all of that prompt (the engines refuse such a P/D leg); echo without
    logprobs still splits."""
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    async with s.post("/v1/completions", json={**body(200), **extra}) as r:
        assert r.status == 200 and "x-agentserve-pd" not in r.headers
    assert p.calls == [] and "kv_transfer_params" not in d.calls[-1]
    plain_echo = {**body(200), "prompt": list(range(1000, 1200)), "echo": True}
    async with s.post("/v1/completions", json=plain_echo) as r:
        assert r.status == 200 and "x-agentserve-pd" in r.headers
    assert len(p.calls) == 1


async def test_prefill_choice_is_prefix_aware(pd_stack) -> None:
    gw, s, engines = await pd_stack(["prefill", "prefill", "decode"], threshold=64)
    p0, p1, d = engines
    shared = list(range(1, 301))
    for i in range(3):  # a shared prefix + 100 new tokens: each turn splits (decode lacks
        turn = {**body(1), "prompt": shared + list(range(2000 + 100 * i, 2100 + 100 * i))}
        async with s.post("/v1/completions", json=turn) as r:  # 100 >= 64), and its
            assert r.status == 200  # prefill goes where the shared prefix is cached
            assert "prefill_ms" in r.headers["x-agentserve-pd"]
    assert sorted((len(p0.calls), len(p1.calls))) == [0, 3]
    used = p0 if p0.calls else p1
    other = p1 if used is p0 else p0
    other_prompt = {**body(300), "prompt": list(range(1000, 1300))}
    used.waiting = 50  # a busy prefill engine loses a fresh prompt to the idle one
    await asyncio.sleep(0.3)  # scraped
    async with s.post("/v1/completions", json=other_prompt) as r:
        assert r.status == 200
    assert len(other.calls) == 1


@pytest.mark.parametrize("failure", ["http_500", "down"])
async def test_prefill_failure_falls_back_to_local_prefill(pd_stack, failure: str) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    if failure == "http_500":
        p.status = 500
    else:
        await p.close()  # connection refused from now on
    async with s.post("/v1/completions", json=body(200)) as r:
        assert r.status == 200
        assert r.headers["x-agentserve-pd"].startswith("fallback=")
        assert r.headers["x-agentserve-predicted-cached"] == "0"  # computed there alone
        assert (await r.json())["choices"][0]["text"] == "decode1"
    assert "kv_transfer_params" not in d.calls[-1]  # the decode engine prefills locally
    m = await metrics(s)
    assert 'agentserve_router_pd_requests_total{path="fallback"} 1.0' in m
    assert "agentserve_router_pd_fallbacks_total" in m


async def test_client_gone_between_legs_releases_prefill_pins(pd_stack) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    d.delay_s = 2.0  # the decode leg has not answered when the client leaves
    with pytest.raises(asyncio.TimeoutError):
        async with s.post("/v1/completions", json=body(200, stream=True),
                          timeout=aiohttp.ClientTimeout(total=0.6)) as r:
            await r.read()
    for _ in range(50):
        if p.released:
            break
        await asyncio.sleep(0.05)
    assert p.released == ["prefill0-1"]  # freed now, not after --kv-transfer-timeout
    assert 'agentserve_router_pd_releases_total{reason="client_gone"} 1.0' in await metrics(s)
    for _ in range(50):
        if d.cancelled:
            break
        await asyncio.sleep(0.05)
    assert d.cancelled == 1  # and the decode leg was cancelled too


async def test_failed_decode_leg_releases_prefill_pins(pd_stack) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    d.status = 503
    async with s.post("/v1/completions", json=body(200)) as r:
        assert r.status >= 500
    for _ in range(50):
        if p.released:
            break
        await asyncio.sleep(0.05)
    assert p.released == ["prefill0-1"]
    assert 'agentserve_router_pd_releases_total{reason="decode_failed"} 1.0' in await metrics(s)


async def test_whole_prefill_pool_down_still_counts_as_fallback(pd_stack) -> None:
    gw, s, (p, d) = await pd_stack(["prefill", "decode"], threshold=16)
    for ep in gw.router.endpoints.values():
        if ep.cfg.role == "prefill":
            ep.healthy = False  # as the health loop marks a dead engine
    async with s.post("/v1/completions", json=body(200)) as r:
        assert r.status == 200
        assert r.headers["x-agentserve-pd"] == "fallback=no_prefill_endpoint"
    m = await metrics(s)
    assert 'agentserve_router_pd_fallbacks_total{reason="no_prefill_endpoint"} 1.0' in m
