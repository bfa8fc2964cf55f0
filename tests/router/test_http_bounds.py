"""The router's HTTP bounds, served as `agentserve route` serves (router/serve.py): half-sent
heads and stalled bodies closed in time while others are served, connections over the cap
answered 503, every non-probe route behind the API key, non-UTF-8 bodies refused, and a
SIGTERM drain that ends in time."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from agentserve.api.httpbounds import listen_socket
from agentserve.router.config import build_config
from agentserve.router.gateway import Gateway
from agentserve.router.serve import serve

from .fakes import FakeEngine

KEY = "sekret"
HEADER_S, BODY_S = 1.0, 1.0
SLACK_S = 2.0 + 4.0  # the lingering read after a 408 (httpbounds.LINGER_S), a loaded box


@pytest.fixture
async def routed():
    """(router URL, the fake engine); the router served by `serve`, as in production."""
    engine = FakeEngine("a")
    url = await engine.start()
    started = []

    async def make(**options):
        cfg = build_config({"policy": "least-loaded", "endpoints": [{"url": url}],
                            "options": {"health_interval_s": 0.2, "header_timeout_s": HEADER_S,
                                        "body_timeout_s": BODY_S, **options}})
        cfg.api_key = KEY
        sock = listen_socket("127.0.0.1", 0)
        stop = asyncio.Event()
        task = asyncio.create_task(serve(Gateway(cfg), sock, stop))
        started.append((stop, task))
        base = "http://127.0.0.1:%d" % sock.getsockname()[1]
        async with aiohttp.ClientSession() as s:
            for _ in range(100):  # healthy: the first health check passed
                try:
                    async with s.get(base + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        return base, sock.getsockname()[1]

    yield make, engine
    for stop, task in started:
        stop.set()
        await asyncio.wait_for(task, 30)
    await engine.close()


async def _closed(reader: asyncio.StreamReader, within: float) -> bytes | None:
    """What the server sent before closing, or None if it was still open after ``within``."""
    try:
        return await asyncio.wait_for(reader.read(), within)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""


async def test_slowloris_and_stalled_bodies_closed_while_others_are_served(routed) -> None:
    make, _ = routed
    base, port = await make()
    heads = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
    for _, w in heads:
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthoriz")
    bodies = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]
    for _, w in bodies:
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
    try:
        t0 = time.monotonic()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async with s.post(base + "/v1/completions",
                              json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}) as r:
                assert r.status == 200
        assert time.monotonic() - t0 < HEADER_S  # served beside them
        within = max(HEADER_S, BODY_S) + SLACK_S
        got = await asyncio.gather(*(_closed(r, within) for r, _ in heads + bodies))
        assert sum(g is None for g in got) == 0, "connections still open past the timeouts"
        assert all(g == b"" for g in got[:300])
        assert all(g.startswith(b"HTTP/1.1 408") for g in got[300:]), got[300]
        assert b"request body stalled" in got[300]
    finally:
        for _, w in heads + bodies:
            w.close()


async def test_connections_over_the_cap_get_503(routed) -> None:
    make, _ = routed
    base, port = await make(max_connections=20)
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
    try:
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await _closed(reader, 5)
        writer.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert "--max-connections" in body["error"]["message"]
    finally:
        for _, w in idle:
            w.close()
    await asyncio.sleep(0.2)
    async with aiohttp.ClientSession() as s, s.get(base + "/health") as r:
        assert r.status == 200  # room again once they closed


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize", "/detokenize",
                                  "/v1/messages/count_tokens", "/v1/completions"])
async def test_every_non_probe_route_needs_the_key(routed, path: str) -> None:
    make, _ = routed
    base, _ = await make()
    async with aiohttp.ClientSession() as s:
        method = s.get if path == "/v1/models" else s.post
        async with method(base + path, json={"model": "tiny", "prompt": [1]}) as r:
            assert r.status == 401 and "API key" in (await r.json())["error"]["message"]
        async with method(base + path, json={"model": "tiny", "prompt": [1]},
                          headers={"x-api-key": KEY}) as r:
            assert r.status != 401
        for probe in ("/health", "/metrics"):
            async with s.get(base + probe) as r:
                assert r.status == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages",
                                  "/v1/responses"])
async def test_a_body_that_is_not_utf8_is_a_400(routed, path: str) -> None:
    """A mangled key (invalid UTF-8 bytes) must not pass as 'max_tokens unset'."""
    make, engine = routed
    base, _ = await make()
    body = {"/v1/completions": b'{"model": "tiny", "prompt": [1, 2], "max_\xff_tokens": 3}',
            "/v1/chat/completions": b'{"model": "tiny", "messages": [{"role": "user", '
                                    b'"content": "hi"}], "max_\xff_tokens": 3}',
            "/v1/messages": b'{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", '
                            b'"content": "hi"}], "x\xff": 1}',
            "/v1/responses": b'{"model": "tiny", "input": "hi", "max_\xffoutput_tokens": 3}'}[path]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(base + path, data=body,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, await r.text()
            assert "UTF-8" in json.dumps(await r.json())
    assert engine.calls == []  # refused before any engine saw it


async def test_sigterm_drain_ends_in_time(tmp_path) -> None:
    """`agentserve route --drain-timeout 1` with a stream in flight that would run for a
    minute: on SIGTERM the router exits within the drain and its grace, and the client's
    stream ends (closed) instead of hanging."""
    engine = FakeEngine("a")
    engine.chunks, engine.chunk_gap_s = 600, 0.1
    url = await engine.start()
    port = listen_socket("127.0.0.1", 0)
    router_port = port.getsockname()[1]
    port.close()
    log = open(tmp_path / "router.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "agentserve.cli", "route", "--endpoint", url,
                             "--port", str(router_port), "--policy", "least-loaded",
                             "--drain-timeout", "1"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{router_port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                try:
                    async with s.get(base + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            async with s.post(base + "/v1/completions", json={
                    "model": "tiny", "prompt": [1, 2], "max_tokens": 4, "stream": True}) as r:
                await r.content.readany()  # the stream runs
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 30)
            for _ in range(300):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()
        await engine.close()
    assert proc.returncode == 0 and took < 1 + 15, (proc.returncode, took,
                                                     (tmp_path / "router.log").read_text()[-2000:])


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_body_is_a_415(routed, encoding: str) -> None:
    """A plain body sent as gzip/deflate: a 500 before (found by benchmarks/harden_fuzz.py)."""
    make, engine = routed
    base, _ = await make()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(base + "/v1/completions", data=b'{"prompt": [1, 2], "max_tokens": 2}',
                          headers={"Content-Type": "application/json",
                                   "Content-Encoding": encoding}) as r:
            assert r.status == 415, await r.text()
            assert f"Content-Encoding '{encoding}'" in (await r.json())["error"]["message"]
    assert engine.calls == []
