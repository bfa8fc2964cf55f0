"""Failures and recovery in the gateway against fake engines: which errors eject an
endpoint, panic routing (the last endpoint of a role is never ejected), and the retry of
a request whose engine failed before its first byte (aggregated and P/D decode legs)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from agentserve.router.config import build_config
from agentserve.router.gateway import Gateway
from tests.router.test_pd import FakePD

from .fakes import FakeEngine

QUEUE_FAILED = "engine error: could not queue the request: ValueError('bad hash')"


@pytest.fixture
async def gateway():
    made: list = []

    async def make(engines: list[FakeEngine], roles: list[str] | None = None,
                   policy: str = "round-robin", **options):
        urls = [await e.start() for e in engines]
        roles = roles or ["both"] * len(engines)
        cfg = build_config({"policy": policy, "endpoints": [
            {"url": u, "role": r} for u, r in zip(urls, roles)],
            "options": {"health_interval_s": 30, "scrape_interval_s": 0.05, **options}})
        gw = Gateway(cfg)
        srv = TestServer(gw.app(), handler_cancellation=True)
        await srv.start_server()
        s = aiohttp.ClientSession(str(srv.make_url("")))
        made.append((srv, s, engines))
        await asyncio.sleep(0.3)  # first health check + model discovery
        return gw, s, urls

    yield make
    for srv, s, engines in made:
        await s.close()
        await srv.close()
        for e in engines:
            await e.close()


def prompt(n: int = 40, **kw) -> dict:
    return {"model": "tiny", "prompt": list(range(1, n + 1)), "max_tokens": 4, **kw}


async def metric(s: aiohttp.ClientSession, name: str) -> float:
    async with s.get("/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_a_5xx_the_request_caused_neither_ejects_nor_is_retried(gateway) -> None:
    engines = [FakeEngine("a"), FakeEngine("b")]
    for e in engines:
        e.status, e.error_message = 500, QUEUE_FAILED
    gw, s, urls = await gateway(engines, eject_after_failures=1)
    for _ in range(4):
        async with s.post("/v1/completions", json=prompt()) as r:
            assert r.status == 500
            assert "could not queue the request" in (await r.json())["error"]["message"]
    assert [len(e.calls) for e in engines] == [2, 2]  # one engine per request: no retry
    assert all(ep.available() and ep.ejections == 0 for ep in gw.router.endpoints.values())
    assert await metric(s, "agentserve_router_retries_total") == 0


async def test_errors_never_eject_the_last_endpoint_of_a_role(gateway) -> None:
    """Both engines fail every request (the engine's fault): both are ejected, and the
    router routes to them anyway (panic) rather than answer 503 for want of an endpoint;
    once they serve again, requests succeed without waiting out the ejection."""
    engines = [FakeEngine("a"), FakeEngine("b")]
    for e in engines:
        e.status = 500
    gw, s, urls = await gateway(engines, eject_after_failures=1, eject_for_s=600)
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 500  # a failed, then b: the last error comes back
    assert all(ep.ejected for ep in gw.router.endpoints.values())
    calls = sum(len(e.calls) for e in engines)
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 500
    assert sum(len(e.calls) for e in engines) > calls, "panic: the ejected engines still get traffic"
    async with s.get("/health") as r:
        assert r.status == 200  # the router can still route
    for e in engines:
        e.status = 200
    async with s.post("/v1/completions", json=prompt()) as r:
        assert r.status == 200
    assert await metric(s, "agentserve_router_panic_routing") >= 2


async def test_panic_threshold_share_and_failed_health_checks() -> None:
    from agentserve.router.core import Router

    urls = [f"http://e{i}" for i in range(4)]
    cfg = build_config({"policy": "round-robin", "endpoints": urls,
                        "options": {"panic_threshold": 0.5}})
    r = Router(cfg)
    eps = [r.endpoints[u] for u in urls]
    eps[0].ejected = eps[1].ejected = True
    assert {ep.url for ep in r.live()} == set(urls[2:]) and r.panics == 0  # 2 of 4 left
    eps[2].ejected = True
    assert {ep.url for ep in r.live()} == set(urls) and r.panics == 1  # 1 of 4 < 50%
    eps[0].healthy = False  # its /health fails: never routed to, panic or not
    assert {ep.url for ep in r.live()} == set(urls[1:])
    with pytest.raises(ValueError, match="panic_threshold"):
        build_config({"options": {"panic_threshold": 2}})


async def test_an_endpoint_back_from_failed_checks_is_rebuilt_before_it_takes_traffic() -> None:
    from agentserve.router.config import EndpointConfig, Options
    from agentserve.router.endpoints import Endpoint, check_health

    engine = FakeEngine("a")
    url = await engine.start()
    ep, opts, seen = Endpoint(EndpointConfig(url=url)), Options(), []

    async def on_recover() -> None:
        seen.append(ep.available())

    try:
        async with aiohttp.ClientSession() as session:
            assert await check_health(ep, session, opts, on_recover) and seen == []
            await engine.close()  # killed: nothing listens, so the first check says so
            assert not await check_health(ep, session, opts, on_recover)
            assert not ep.available() and ep.check_fails == 1
            url2 = await engine.start()  # restarted (a new port here; the same in `up`)
            ep.cfg.url = url2
            assert await check_health(ep, session, opts, on_recover)
            assert seen == [False] and ep.available() and ep.recoveries == 1
    finally:
        await engine.close()


@pytest.mark.parametrize("failure", ["refused", "stream_cut"])
async def test_a_request_whose_engine_fails_before_the_first_byte_is_retried(
        gateway, failure: str) -> None:
    engines = [FakeEngine("a"), FakeEngine("b")]
    gw, s, urls = await gateway(engines)
    if failure == "refused":
        await engines[0].close()  # killed; the router's health checks have not seen it yet
    else:
        engines[0].die_after = 0  # answers 200 headers, then the connection drops
    texts = []
    for _ in range(4):
        async with s.post("/v1/completions", json=prompt(stream=True)) as r:
            assert r.status == 200
            body = await r.text()
            assert "data: [DONE]" in body and '"error"' not in body
            texts.append(body)
    assert all("b0" in t for t in texts)  # every answer came from the live engine
    assert await metric(s, "agentserve_router_retries_total") >= 1
    assert all(ep.inflight == 0 for ep in gw.router.endpoints.values())


async def test_a_decode_leg_whose_engine_is_gone_is_retried_and_its_pins_released(
        gateway) -> None:
    prefill, decode = FakePD("prefill0"), FakePD("decode1")
    gw, s, urls = await gateway([prefill, decode], ["prefill", "decode"], policy="default",
                                pd_threshold=16)
    await decode.close()  # killed after the router last saw it healthy
    async with s.post("/v1/completions", json=prompt(200)) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == "prefill0"  # served whole, elsewhere
    assert "kv_transfer_params" not in prefill.calls[-1]  # the original body, not the leg's
    for _ in range(50):
        if prefill.released:
            break
        await asyncio.sleep(0.05)
    assert prefill.released == ["prefill0-1"]
    assert await metric(s, "agentserve_router_retries_total") == 1
    assert all(ep.inflight == 0 for ep in gw.router.endpoints.values())
