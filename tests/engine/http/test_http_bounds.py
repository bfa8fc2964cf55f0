"""The engine's bounds on a real `agentserve serve` process: half-sent heads and stalled
bodies are closed within their timeouts while other clients are served, connections over
the cap are answered 503 (agentserve/api/httpbounds.py), and --max-tokens-limit bounds what
any request of the four APIs generates."""

from __future__ import annotations

import json
import selectors
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from agentserve.cluster.procs import ManagedProcess, start_engine

HEADER_S, BODY_S, CAP = 2.0, 2.0, 400
LIMIT = 5  # --max-tokens-limit
# A bound (seconds) past which a stalled connection counts as held: the timeout, the
# lingering read after a 408 (httpbounds.LINGER_S) and slack for a loaded 2-core box.
SLACK_S = 2.0 + 4.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    eng = start_engine(tmp_path_factory.mktemp("bounds"), extra=[
        "--http-header-timeout", str(HEADER_S), "--http-body-timeout", str(BODY_S),
        "--max-connections", str(CAP), "--kv-cache-tokens", "4096", "--max-model-len", "1024",
        "--max-tokens-limit", str(LIMIT)])
    try:
        eng.wait_healthy(180)
        yield eng
    finally:
        eng.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setblocking(False)
    return s


def _complete(url: str) -> tuple[int, float]:
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
        return r.status, time.monotonic() - t0


def _wait_closed(socks: list[socket.socket], deadline: float) -> dict[socket.socket, bytes]:
    """Read every socket until the server closes it or ``deadline`` passes; what each got
    (sockets still open at the deadline are missing)."""
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    closed: dict[socket.socket, bytes] = {}
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                got[s] += data
            else:
                sel.unregister(s)
                closed[s] = got[s]
    sel.close()
    return closed


def test_slowloris_heads_and_stalled_bodies_are_closed_in_time(engine: ManagedProcess) -> None:
    """300 connections each send half a header line and stall, 50 send a head announcing
    1000 body bytes and 10 of them: all are closed within the timeouts (the bodies with a
    408), and a normal request is answered at once while they are open."""
    heads = [_connect(engine.url) for _ in range(300)]
    for s in heads:
        s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    bodies = [_connect(engine.url) for _ in range(50)]
    for s in bodies:
        s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
    t0 = time.monotonic()
    try:
        status, seconds = _complete(engine.url)
        assert status == 200 and seconds < HEADER_S, seconds  # served beside them
        closed = _wait_closed(heads + bodies, t0 + max(HEADER_S, BODY_S) + SLACK_S)
        held = time.monotonic() - t0
        assert len(closed) == 350, f"{350 - len(closed)} connections still open after {held:.1f} s"
        assert all(closed[s] == b"" for s in heads)  # a half head gets no answer, just a close
        answers = [closed[s] for s in bodies]
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0]
        assert b"request body stalled" in answers[0] and b"--http-body-timeout" in answers[0]
    finally:
        for s in heads + bodies:
            s.close()
    assert _complete(engine.url)[0] == 200


def test_connections_over_the_cap_get_503_then_room_again(engine: ManagedProcess) -> None:
    """CAP idle connections fill the server; the next one is answered 503 with Retry-After
    and closed; once the idle ones time out, requests are served again."""
    time.sleep(0.5)  # the previous test's connections and the health probes are gone
    idle = [_connect(engine.url) for _ in range(CAP)]
    try:
        time.sleep(0.3)  # all accepted
        extra = _connect(engine.url)
        closed = _wait_closed([extra], time.monotonic() + 5)
        answer = closed.get(extra, b"")
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"Retry-After: 1" in answer and b"--max-connections" in answer
        extra.close()
        gone = _wait_closed(idle, time.monotonic() + HEADER_S + SLACK_S)
        assert len(gone) == CAP  # idle connections end at the header timeout
    finally:
        for s in idle:
            s.close()
    assert _complete(engine.url)[0] == 200


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": None, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 500, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 500, "ignore_eos": True}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 500}),
    ("/v1/responses", {"input": "hi"}),
], ids=["completions-unset", "completions-over", "chat-unset", "chat-over", "messages",
        "responses"])
def test_max_tokens_limit_bounds_every_api(engine: ManagedProcess, path: str, body: dict) -> None:
    """Unset (the context limit, as vLLM) or larger than the server's limit, a request
    generates at most --max-tokens-limit tokens (exactly so when it ignores EOS)."""
    req = urllib.request.Request(engine.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    usage = answer["usage"]
    made = usage.get("completion_tokens", usage.get("output_tokens"))
    assert made == LIMIT if body.get("ignore_eos") else 1 <= made <= LIMIT, answer
