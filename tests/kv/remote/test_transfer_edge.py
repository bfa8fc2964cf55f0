"""The transfer edge of real engines: kv_transfer_params validated (400 naming the field),
acted on only when signed (403), pulled only from allowed peers, never steered by a
client through the router, and the transfer secret never on the wire.

A `Listener` the test owns stands where a client would point ``remote_host``:
``remote_port``; it records every connection and byte, so "the engine never connected"
is something a test can see fail.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from agentserve.api.kv_transfer import AUTH_HEADER, sign
from tests.conftest import ServerThread
from tests.kv.remote.test_pd_engine import KW, TOKEN, prefill_leg, signed, transfer, wait_clean

PATHS = {  # the four generation APIs, one small body each
    "/v1/completions": {"prompt": list(range(20, 80)), "max_tokens": 3, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi " * 30}],
                             "max_tokens": 3, "temperature": 0},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi " * 30}], "max_tokens": 3},
    "/v1/responses": {"input": "hi " * 30, "max_output_tokens": 3},
}


class Listener:
    """A TCP listener that records each connection and what it sent, then closes it (so a
    puller fails fast and recomputes); ``fake_token`` plays an engine's handshake first."""

    def __init__(self, fake_token: str | None = None) -> None:
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.fake_token = fake_token
        self.connections = 0
        self.seen = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from agentserve.kv.remote.auth import server_handshake
        from agentserve.kv.remote.frames import recv_header, send_frame

        while True:
            try:
                conn, _ = self.lst.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    if self.fake_token is not None:
                        server_handshake(conn, self.fake_token, time.monotonic() + 2)
                        req = recv_header(conn)
                        self.seen += json.dumps(req, default=repr).encode()
                        send_frame(conn, {"ok": False, "error": "no pinned KV here"})
                    while data := conn.recv(1 << 16):
                        self.seen += data
                except Exception:  # noqa: BLE001 - whatever the peer did, record and close
                    pass

    def params(self, hashes: int = 2) -> dict[str, Any]:
        """Decode-leg params pointing at this listener (well formed)."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
                "remote_port": self.port, "remote_request_id": "pulled-from-the-listener",
                "remote_block_ids": list(range(hashes)), "remote_block_size": 16,
                "remote_block_hashes": ["ab" * 32] * hashes, "remote_num_tokens": 16 * hashes}

    def quiet(self, seconds: float = 0.5) -> bool:
        """No connection arrived (waiting ``seconds`` for a late one)."""
        time.sleep(seconds)
        return self.connections == 0

    def close(self) -> None:
        self.lst.close()


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[ServerThread, ServerThread]]:
    p = ServerThread(role="prefill", kv_transfer_timeout=30.0, kv_transfer_token=TOKEN, **KW).start()
    d = ServerThread(role="decode", kv_transfer_token=TOKEN, **KW).start()
    yield p, d
    p.close()
    d.close()


def call(url: str, path: str, body: Any, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json",
                                                    **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def message(out: Any) -> str:
    return out["error"]["message"]


def test_d1_repro_a_bad_port_is_a_400_and_the_streams_beside_it_finish(pd) -> None:
    """The issue's D1 body (remote_port "abc"), beside three streams: a 400 naming the
    field, and the streams end normally (before, the engine step raised and failed them all)."""
    _, d = pd
    bad = {"prompt": "x x x x", "max_tokens": 4, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "abc",
        "remote_request_id": "x", "remote_block_hashes": [1]}}
    got: list[str] = []

    def stream() -> None:
        req = urllib.request.Request(d.url + "/v1/completions", json.dumps(
            {"prompt": list(range(5, 60)), "max_tokens": 40, "temperature": 0, "stream": True,
             "ignore_eos": True}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got.append(r.read().decode())

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    status, out = call(d.url, "/v1/completions", bad)
    assert status == 400
    assert "kv_transfer_params.remote_port must be an integer 1-65535, got 'abc'" in message(out)
    for t in threads:
        t.join(60)
    assert len(got) == 3 and all(s.rstrip().endswith("data: [DONE]") for s in got)
    assert all('"error"' not in s for s in got)
    wait_clean(d)


def test_d3_repro_a_bad_hash_is_a_400_not_a_500(pd) -> None:
    _, d = pd
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
              "remote_request_id": "x", "remote_block_hashes": ["zz"]}
    status, out = call(d.url, "/v1/completions", {"prompt": "x x x x", "max_tokens": 4,
                                                  "kv_transfer_params": params}, signed(params))
    assert status == 400 and "kv_transfer_params.remote_block_hashes" in message(out)
    assert "64-digit hex" in message(out)


BAD = [  # (field, value, what the message says)
    ("do_remote_prefill", "yes", "true or false"),
    ("remote_host", "http://10.0.0.1/x", "host name or IP address"),
    ("remote_host", "", "host name or IP address"),
    ("remote_port", 0, "1-65535"),
    ("remote_port", 70000, "1-65535"),
    ("remote_port", True, "1-65535"),
    ("remote_port", "5600", "1-65535"),
    ("remote_request_id", "", "non-empty string"),
    ("remote_request_id", "r" * 300, "at most 256"),
    ("remote_engine_id", 7, "non-empty string"),
    ("remote_block_ids", [0, -1], "non-negative integers"),
    ("remote_block_ids", "0,1", "list of at most"),
    ("remote_block_hashes", ["ab" * 16], "64-digit hex"),  # a 16-byte (fast) hash
    ("remote_block_hashes", [1], "64-digit hex"),
    ("remote_block_size", 8, "block size 16"),
    ("tp_size", -1, "non-negative integer"),
    ("remote_num_tokens", 1.5, "non-negative integer"),
]


@pytest.mark.parametrize("path", list(PATHS))
def test_every_api_answers_malformed_params_with_a_400_naming_the_field(pd, path: str) -> None:
    """Each malformed field, signed (so the shape check is what refuses it), on the four
    generation APIs; nothing reaches the core (no request runs, nothing leaks)."""
    _, d = pd
    ok = Listener().params()
    for field, value, says in BAD if path == "/v1/completions" else BAD[::4]:
        params = {**ok, field: value}
        status, out = call(d.url, path, {**PATHS[path], "kv_transfer_params": params},
                           signed(params))
        assert status == 400, (field, value, out)
        text = json.dumps(out)
        assert f"kv_transfer_params.{field}" in text and says in text, (field, out)
    status, out = call(d.url, path, {**PATHS[path], "kv_transfer_params": "pull please"})
    assert status == 400 and "kv_transfer_params" in json.dumps(out)
    both = {"do_remote_prefill": True, "do_remote_decode": True}
    status, out = call(d.url, path, {**PATHS[path], "kv_transfer_params": both}, signed(both))
    assert status == 400 and "cannot both be true" in json.dumps(out)
    assert call(d.url, path, PATHS[path])[0] == 200  # and the engine serves on
    wait_clean(d)


@pytest.mark.parametrize("how", ["unsigned", "other_token", "stale", "malformed", "for_other_params"])
def test_unsigned_params_never_make_the_engine_connect(pd, how: str) -> None:
    """A body naming a listener the test owns, without the router's valid signature: a 403
    naming kv_transfer_params, and no connection ever arrives; with it, one does (so this
    test would see a connection)."""
    _, d = pd
    lst = Listener()
    params = lst.params()
    headers = {"unsigned": {}, "other_token": {AUTH_HEADER: sign("guessed", params)},
               "stale": {AUTH_HEADER: sign(TOKEN, params, now=time.time() - 3600)},
               "malformed": {AUTH_HEADER: "yesterday.deadbeef"},
               "for_other_params": {AUTH_HEADER: sign(TOKEN, {**params, "remote_port": 1})}}[how]
    body = {"prompt": list(range(30, 90)), "max_tokens": 2, "temperature": 0,
            "kv_transfer_params": params}
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, out = call(d.url, path, {**PATHS[path], "kv_transfer_params": params}, headers)
        assert status == 403 and out["error"]["param"] == "kv_transfer_params", out
        assert "kv_transfer_params refused" in message(out)
    assert lst.quiet()
    status, _ = call(d.url, "/v1/completions", body, signed(params))
    assert status == 200  # the router's signature: the engine connects (and recomputes)
    deadline = time.monotonic() + 5
    while lst.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lst.connections >= 1
    lst.close()
    wait_clean(d)


def test_a_prefill_leg_and_a_release_need_the_signature_too(pd) -> None:
    """Pinning KV (a prefill leg) and dropping pins (release) are internal paths as well."""
    p, _ = pd
    leg = {"prompt": list(range(40, 140)), "max_tokens": 1, "temperature": 0,
           "kv_transfer_params": {"do_remote_decode": True}}
    status, out = call(p.url, "/v1/completions", leg)
    assert status == 403 and p.engine.core.remote.num_pinned == 0
    params = prefill_leg(p, {"prompt": list(range(40, 140)), "temperature": 0})
    rid = {"remote_request_id": params["remote_request_id"]}
    status, out = call(p.url, "/v1/kv_transfer/release", rid)
    assert status == 403 and "kv transfer release refused" in message(out)
    assert p.engine.core.remote.num_pinned == 1
    status, out = call(p.url, "/v1/kv_transfer/release", rid, signed(rid, "release"))
    assert status == 200 and out == {"released": rid["remote_request_id"]}
    wait_clean(p, timeout=3)


def test_the_secret_never_crosses_the_wire_from_a_decode_engine(pd) -> None:
    """A decode leg (signed, as the router sends it) pointing at a fake transfer server
    that plays the handshake and records all the decode engine sends: the pull request
    arrives, the token's bytes do not; the engine then recomputes."""
    _, d = pd
    fake = Listener(fake_token=TOKEN)
    params = fake.params()
    fails = transfer(d)["pull_failures"]
    body = {"prompt": list(range(200, 300)), "max_tokens": 2, "temperature": 0,
            "kv_transfer_params": params}
    hashes: list[bytes] = []
    d.engine.core.kv.hasher.extend(hashes, body["prompt"])
    params["remote_block_hashes"] = [h.hex() for h in hashes[:2]]  # a pull worth making
    status, _ = call(d.url, "/v1/completions", body, signed(params))
    assert status == 200 and fake.connections == 1
    seen = bytes(fake.seen)
    assert b"pulled-from-the-listener" in seen  # the request itself was captured
    assert TOKEN.encode() not in seen and TOKEN.encode().hex().encode() not in seen
    assert transfer(d)["pull_failures"] == fails + 1
    fake.close()
    wait_clean(d)


def test_peers_outside_the_allow_list_are_refused_before_any_connection() -> None:
    d = ServerThread(role="decode", kv_transfer_token=TOKEN, kv_transfer_peers="127.0.0.1:1",
                     **KW).start()
    try:
        lst = Listener()
        params = lst.params()
        status, out = call(d.url, "/v1/completions", {**PATHS["/v1/completions"],
                                                      "kv_transfer_params": params},
                           signed(params))
        assert status == 403 and "--kv-transfer-peers" in message(out)
        assert lst.quiet()
        lst.close()
    finally:
        d.close()


def test_a_transfer_role_without_a_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """One clear line, before the model loads; --insecure-transfer starts and acts on
    unsigned params as before (vLLM-style setups)."""
    from agentserve.engine.builder import EngineArgs, EngineConfigError, build_engine

    monkeypatch.delenv("AGENTSERVE_KV_TRANSFER_TOKEN", raising=False)
    for role in ("prefill", "decode"):
        with pytest.raises(EngineConfigError, match="--kv-transfer-token.*--insecure-transfer"):
            build_engine(EngineArgs(role=role, model="/nonexistent"))  # (fails before loading)
    env = {k: v for k, v in __import__("os").environ.items() if k != "AGENTSERVE_KV_TRANSFER_TOKEN"}
    cli = subprocess.run([sys.executable, "-m", "agentserve.cli", "serve", "--role", "prefill",
                          "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert cli.returncode != 0 and "--insecure-transfer" in cli.stderr
    assert "Traceback" not in cli.stderr and len(cli.stderr.strip().splitlines()) <= 3
    p = ServerThread(role="prefill", insecure_transfer=True, **KW).start()
    try:
        leg = {"prompt": list(range(5, 100)), "max_tokens": 1, "temperature": 0,
               "kv_transfer_params": {"do_remote_decode": True}}
        status, out = call(p.url, "/v1/completions", leg)  # unsigned: acted on
        assert status == 200 and out["kv_transfer_params"]["do_remote_prefill"] is True
        p.engine.core.remote.release(out["kv_transfer_params"]["remote_request_id"])
    finally:
        p.close()


async def test_through_the_router_a_clients_params_reach_no_engine(pd) -> None:
    """A real router (with the cluster token) over the real engines: a client's params
    naming the test's listener produce no connection to it, the answer is the normal one,
    and the router's own P/D legs, signed, pull from the prefill engine."""
    import asyncio

    import aiohttp
    from aiohttp.test_utils import TestServer

    from agentserve.router.config import build_config
    from agentserve.router.gateway import Gateway

    p, d = pd
    cfg = build_config({"policy": "default", "kv_transfer_token": TOKEN,
                        "endpoints": [{"url": p.url, "role": "prefill"},
                                      {"url": d.url, "role": "decode"}],
                        "options": {"health_interval_s": 0.2, "pd_threshold": 16}})
    srv = TestServer(Gateway(cfg).app(), handler_cancellation=True)
    await srv.start_server()
    lst = Listener()
    try:
        async with aiohttp.ClientSession(str(srv.make_url(""))) as s:
            for _ in range(50):  # first health checks
                async with s.get("/health") as r:
                    if r.status == 200 and len((await r.json())["healthy"]) == 2:
                        break
                await asyncio.sleep(0.1)
            pulls = transfer(d)["pulls"]
            body = {"prompt": list(range(300, 420)), "max_tokens": 3, "temperature": 0}
            async with s.post("/v1/completions", json={**body, "kv_transfer_params": lst.params()},
                              headers={AUTH_HEADER: sign(TOKEN, lst.params())}) as r:
                assert r.status == 200, await r.text()
                assert "prefill_ms=" in r.headers["x-agentserve-pd"]  # the router's own legs
                got = await r.json()
        assert lst.quiet()
        assert transfer(d)["pulls"] == pulls + 1  # signed legs work end to end
        assert got["choices"][0]["text"] == call(p.url, "/v1/completions", body)[1]["choices"][0]["text"]
    finally:
        lst.close()
        await srv.close()
    wait_clean(p, d)
