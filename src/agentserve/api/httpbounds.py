"""Bounds on what one HTTP client can hold, shared by the engine's and the router's servers.

aiohttp bounds a request's size (``client_max_size``) and its header lines, but not time
or connections. Without these, 300 connections that each send half a header line, or 50
bodies that stall after 10 bytes, hold sockets (and handler tasks) for as long as the
client likes, and nothing caps how many sockets a client may open.

- **Header timeout**: a connection must deliver a complete request head within
  ``header_timeout_s`` of opening, or of its previous response ending; otherwise it is
  closed. This is aiohttp's keep-alive timer, which already has exactly that shape: armed
  when the connection opens and after each response, not reset by bytes that arrive, it
  closes the connection if no complete head is waiting then. An idle keep-alive
  connection therefore closes after ``header_timeout_s`` too (clients open a new one).
- **Body timeout**: a request body that receives no byte for ``body_timeout_s`` is
  answered 408 and its connection closed (``body_timeout_middleware``); idle time, as
  nginx's ``client_body_timeout``, so a large upload on a slow link is not cut off.
- **Connection cap**: at most ``max_connections`` open connections (``CappedSite``);
  one more is answered 503 with ``Retry-After`` and closed, as uvicorn's
  ``--limit-concurrency`` does, so the sockets and memory a server spends are bounded.
- **Hard exit**: ``hard_exit_after`` is the SIGTERM backstop: the process ends at a
  deadline even if a request, a worker thread or a stop routine is stuck.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("agentserve.http")

# After a response sent before its request body was read in full (401, 408, 413), read
# and drop the rest for at most this long so the client sees the answer rather than a
# reset, then close. (aiohttp's default, 10 s, would hold a stalled body's socket on.)
LINGER_S = 2.0
# A refused connection (over the cap) is closed this long after its 503, at the latest.
REFUSED_CLOSE_S = 0.5
# Descriptors kept free beyond the connection cap (model files, ZMQ sockets, pipes, logs).
FD_RESERVE = 256


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The time and connection bounds of one HTTP server (seconds; see the module doc)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 2048

    def check(self) -> None:
        """ValueError naming the flag when a bound is not positive."""
        for flag, v in (("--http-header-timeout", self.header_timeout_s),
                        ("--http-body-timeout", self.body_timeout_s),
                        ("--max-connections", self.max_connections)):
            if not v > 0:
                raise ValueError(f"{flag} must be > 0, got {v!r}")

    def runner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``web.AppRunner`` (passed on to each connection)."""
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": LINGER_S}


DEFAULT_LIMITS = HttpLimits()


class BodyTimeout(Exception):
    """A request body stalled: no byte arrived for the body timeout."""

    def __init__(self, idle_s: float, received: int) -> None:
        super().__init__(f"request body stalled: no data for {idle_s:g} s after {received} "
                         "bytes (--http-body-timeout); send the whole body promptly")


async def read_body(request: web.Request, idle_s: float) -> bytes:
    """``request.read()`` (so later ``read()`` calls return the same bytes at once) that
    raises ``BodyTimeout`` when no byte of the body arrives for ``idle_s`` seconds."""
    content = request.content
    if content.is_eof():  # all of it is here already (most bodies come with their head)
        return await request.read()
    loop = asyncio.get_running_loop()
    reading = asyncio.ensure_future(request.read())
    tick = max(0.05, min(idle_s / 4, 1.0))
    seen, last = content.total_bytes, loop.time()
    try:
        while True:  # each turn waits at most `tick`; it ends by data, EOF or `idle_s`
            done, _ = await asyncio.wait((reading,), timeout=tick)
            if done:
                return reading.result()
            now = loop.time()
            if content.total_bytes != seen:
                seen, last = content.total_bytes, now
            elif now - last >= idle_s:
                raise BodyTimeout(idle_s, seen)
    finally:
        if not reading.done():
            reading.cancel()


ErrorAnswer = Callable[[web.Request, int, str], web.StreamResponse]


def body_timeout_middleware(idle_s: float, answer: ErrorAnswer) -> Any:
    """A middleware that reads every request body first, bounded by ``idle_s`` of silence
    (408) and by the app's ``client_max_size`` (413); a compressed body is refused (415)
    and one aiohttp cannot read answered 400; ``answer(request, status, message)``
    makes (or raises) the server's own error answer. Put it after authentication, so an
    unauthenticated client's body is never buffered."""
    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.body_exists:
            coding = request.headers.get("Content-Encoding", "").strip().lower()
            if coding not in ("", "identity"):
                # A compressed request body is refused before it is read: no API client
                # sends one (vLLM's server does not decode them), and aiohttp's decoder can
                # fail a complete body without ending the read (a raw deflate stream cut
                # short waited for the body timeout).
                return answer(request, 415, f"Content-Encoding {coding!r} is not accepted "
                              "on requests: send the body uncompressed")
            try:
                await read_body(request, idle_s)
            except BodyTimeout as e:
                return answer(request, 408, str(e))
            except web.HTTPRequestEntityTooLarge:
                return answer(request, 413, "request body too large: the limit is "
                              f"{request.client_max_size} bytes")
            except RequestPayloadError as e:  # the client's framing or encoding: a 400
                return answer(request, 400, f"request body could not be read: {_why(e)}")
        return await handler(request)
    return middleware


def _why(e: RequestPayloadError) -> str:
    """What aiohttp's parser found wrong with a body (e.g. a Content-Encoding it is not)."""
    cause = e.__cause__
    text = cause.message if isinstance(cause, HttpProcessingError) else str(e)
    return " ".join(str(text).split()) or "malformed body"


def _busy_response(max_connections: int) -> bytes:
    body = ('{"error": {"message": "server at its connection limit (%d, --max-connections); '
            'retry later", "type": "service_unavailable", "param": null, "code": null}}'
            % max_connections).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, closed when the client closes its
    side or after ``REFUSED_CLOSE_S`` (what it sends meanwhile is dropped)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.answer)
        self.timer = asyncio.get_running_loop().call_later(REFUSED_CLOSE_S, transport.close)

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class _Counted(asyncio.Protocol):
    """An aiohttp connection handler, counted from its creation until its connection is
    lost (the transport talks to this; aiohttp's own code keeps using the handler)."""

    __slots__ = ("inner", "gate", "open")

    def __init__(self, inner: asyncio.Protocol, gate: CappedSite) -> None:
        self.inner, self.gate, self.open = inner, gate, True
        gate.num_connections += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.open:
            self.open = False
            self.gate.num_connections -= 1
        self.inner.connection_lost(exc)


class CappedSite(web.SockSite):
    """``web.SockSite`` that serves at most ``max_connections`` connections at a time."""

    __slots__ = ("max_connections", "num_connections", "refused", "_busy")

    def __init__(self, runner: web.BaseRunner, sock: Any, max_connections: int,
                 backlog: int = 1024) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self.max_connections = max_connections
        self.num_connections = 0
        self.refused = 0  # connections answered 503 for the cap, since start
        self._busy = _busy_response(max_connections)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # (registers the site; SockSite's would listen itself)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._accept(server), sock=self._sock, backlog=self._backlog)

    def _accept(self, server: web.Server) -> asyncio.Protocol:
        if self.num_connections >= self.max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("connection limit %d reached: refused %d connection(s) with 503 so far",
                            self.max_connections, self.refused)
            return _Refused(self._busy)
        return _Counted(server(), self)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for host:port (IPv4 or IPv6); OSError when taken."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e


def raise_open_files_limit(max_connections: int) -> None:
    """Raise this process's soft descriptor limit so ``max_connections`` can be reached (as
    vLLM raises its own); a warning when the hard limit is too low for it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit to %d: %s", new, e)
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open-files limit %d is below --max-connections %d + %d in reserve; "
                    "connections beyond it fail to be accepted (raise `ulimit -n`)",
                    soft, max_connections, FD_RESERVE)


def hard_exit_after(seconds: float, what: str) -> threading.Timer:
    """Exit the process (status 1) in ``seconds`` unless the returned timer is cancelled:
    the backstop of a bounded shutdown, for a request, thread or stop routine that hangs
    (``asyncio.run`` waits for worker threads without a bound)."""
    def _exit() -> None:
        log.error("%s did not finish within %.0f s; exiting now", what, seconds)
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(1)

    timer = threading.Timer(seconds, _exit)
    timer.daemon = True
    timer.start()
    return timer
