"""Forward one request to one endpoint and pass the answer through, chunk by chunk.

The body is forwarded byte for byte (never re-encoded). A streamed answer is written to
the client as each upstream chunk arrives; the first and last few KB are kept to read the
prompt's cached tokens. `Upstream` errors raised *before the first byte* let the gateway
retry on another endpoint; after the first byte the stream is the client's, and a stream
the upstream ends before its end (OpenAI's `data: [DONE]`, Anthropic's `message_stop`, the
Responses API's `response.completed`; the engine died, the connection broke) gets an error
event in that API's shape (OpenAI's error object and `[DONE]`, as vLLM's server does for
its own errors), so that clients raise rather than take a truncated answer for a whole
one. A client disconnect cancels the handler, which closes the upstream connection, which
makes the engine abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from agentserve.api.kv_transfer import AUTH_HEADER

logger = logging.getLogger(__name__)

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
        "accept-encoding"}
_TAIL = 16384


class Upstream(Exception):
    """The endpoint failed before answering; `status` None means it was unreachable."""

    def __init__(self, message: str, status: int | None = None, body: bytes = b"",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.headers = headers or {}


REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_KEY = web.RequestKey("request_id", str)


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id, or one made up once for this request: every engine leg
    gets it (so their logs and response ids name the same request) and so does the client."""
    rid = request.get(_REQUEST_ID_KEY)
    if rid is None:
        rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        request[_REQUEST_ID_KEY] = rid
    return rid


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the request id on every /v1/ answer, errors included."""
    if request.path.startswith("/v1/") and request.method == "POST":
        response.headers[REQUEST_ID_HEADER] = request_id(request)


OPERATOR_HEADER = "x-agentserve-operator-key"  # the router's operator_key: internal fields kept
INTERNAL_HEADERS = frozenset({AUTH_HEADER, OPERATOR_HEADER})  # never forwarded from a client
TRANSFER_AUTH = web.RequestKey("transfer_auth", str)  # the router's signature for this leg


def forward_headers(request: web.Request) -> dict[str, str]:
    """The client's headers for an engine: hop-by-hop and internal ones dropped, the request
    id set, and the signature of the leg's kv_transfer_params when the router made one
    (``request[TRANSFER_AUTH]``, `pd.py`)."""
    headers = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP and k.lower() != "x-request-id"
               and k.lower() not in INTERNAL_HEADERS}
    headers[REQUEST_ID_HEADER] = request_id(request)
    auth = request.get(TRANSFER_AUTH)
    if auth:
        headers[AUTH_HEADER] = auth
    return headers


def cached_tokens_of(usage: Any) -> int | None:
    """The prompt's cached tokens in a usage object: OpenAI's
    ``prompt_tokens_details.cached_tokens``, the Responses API's
    ``input_tokens_details.cached_tokens`` or Anthropic's ``cache_read_input_tokens``."""
    if not isinstance(usage, dict):
        return None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
    read = usage.get("cache_read_input_tokens")
    return read if isinstance(read, int) else None


def _usage_in(event: Any) -> Any:
    """The usage object of a streamed event: at its top (OpenAI), in its ``response``
    (Responses) or its ``message`` (Anthropic's message_start)."""
    if not isinstance(event, dict):
        return None
    for holder in (event, event.get("response"), event.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]
    return None


_CACHED = re.compile(rb'"(?:cached_tokens|cache_read_input_tokens)":(\d+)')


def usage_from_sse(tail: bytes, head: bytes = b"") -> int | None:
    """Cached tokens from the last SSE ``data:`` line that reports them (the final usage
    chunk, response.completed), else from the first (Anthropic's message_start). A line
    cut by the kept window is read by pattern."""
    for lines in (reversed(tail.split(b"\n")), head.split(b"\n")):
        for line in lines:
            if not line.startswith(b"data:") or b'"usage"' not in line:
                continue
            try:
                got = cached_tokens_of(_usage_in(msgspec.json.decode(line[5:].strip())))
            except msgspec.DecodeError:
                m = _CACHED.findall(line)
                got = int(m[-1]) if m else None
            if got is not None:
                return got
    return None


class Dialect:
    """How a streaming API ends its stream, and an error event in its shape."""

    def __init__(self, path: str) -> None:
        self.kind = ("anthropic" if path.startswith("/v1/messages")
                     else "responses" if path.startswith("/v1/responses") else "openai")

    def complete(self, tail: bytes) -> bool:
        """The stream reached its end (an error event the engine sent counts)."""
        end = tail.rstrip()
        if self.kind == "openai":
            return end.endswith(b"data: [DONE]")
        last = end.rsplit(b"\n\n", 1)[-1]
        names = ((b"message_stop", b"error") if self.kind == "anthropic" else
                 (b"response.completed", b"response.incomplete", b"response.failed", b"error"))
        return any(last.startswith(b"event: " + n + b"\n") for n in names)

    def error(self, tail: bytes, message: str) -> bytes:
        """An error event that ends the stream, starting on an event boundary."""
        sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"  # close a cut-off event
        if self.kind == "anthropic":
            body = {"type": "error", "error": {"type": "api_error", "message": message}}
            return sep + b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"
        if self.kind == "responses":
            seqs = re.findall(rb'"sequence_number":(\d+)', tail)
            body = {"type": "error", "code": "upstream_error", "message": message, "param": None,
                    "sequence_number": int(seqs[-1]) + 1 if seqs else 0}
            return sep + b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"
        return stream_error(tail, message)


async def forward(request: web.Request, session: aiohttp.ClientSession, url: str,
                  body: bytes, timeout: aiohttp.ClientTimeout,
                  on_first_byte: Callable[[], None],
                  extra_headers: dict[str, str] | None = None
                  ) -> tuple[web.StreamResponse, int | None]:
    """Send `body` to `url`; return the client response and the reported cached tokens.

    `extra_headers` are added to the client response (the router's decision).
    """
    try:
        resp = await session.post(url, data=body, headers=forward_headers(request),
                                  timeout=timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise Upstream(f"{url}: {type(e).__name__}: {e}") from e
    try:
        if resp.status >= 500:
            raw = await resp.read()
            raise Upstream(f"{url}: HTTP {resp.status}", resp.status, raw,
                           {"Content-Type": resp.headers.get("Content-Type", "")})
        ctype = resp.headers.get("Content-Type", "application/json")
        if ctype.startswith("text/event-stream"):
            return await _stream(request, resp, on_first_byte, extra_headers or {})
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Upstream(f"{url}: {type(e).__name__} reading the answer") from e
        on_first_byte()
        cached = None
        if resp.status == 200:
            try:
                cached = cached_tokens_of(msgspec.json.decode(raw).get("usage"))
            except (msgspec.DecodeError, AttributeError):
                cached = None
        out = web.Response(status=resp.status, body=raw,
                           headers={"Content-Type": ctype, **(extra_headers or {})})
        return out, cached
    except BaseException:
        resp.close()  # cancelled (client gone) or failed: never reuse a half-read connection
        raise
    finally:
        resp.release()


async def _stream(request: web.Request, resp: aiohttp.ClientResponse,
                  on_first_byte: Callable[[], None],
                  extra_headers: dict[str, str]) -> tuple[web.StreamResponse, int | None]:
    it = resp.content.iter_any()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = b""
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Upstream(f"stream broke before the first byte: {type(e).__name__}") from e
    on_first_byte()
    out = web.StreamResponse(status=resp.status, headers={
        "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
        "Cache-Control": "no-cache", **extra_headers})
    await out.prepare(request)
    head, tail = first[:_TAIL], first[-_TAIL:]
    dialect = Dialect(request.path)
    broke = "the stream ended before its end event"
    try:
        if first:
            await out.write(first)
        async for chunk in it:
            await out.write(chunk)
            tail = (tail + chunk)[-_TAIL:]
            if len(head) < _TAIL:
                head = (head + chunk)[:_TAIL]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if _client_gone(request):  # our write failed (aiohttp's ClientConnectionResetError
            resp.close()  # is a ClientError too), not the engine's stream: drop it (it aborts)
            return out, None
        broke = f"{type(e).__name__}: {e}"
    except (ConnectionResetError, RuntimeError):
        resp.close()  # the client went away: drop the upstream connection (engine aborts)
        raise
    if not dialect.complete(tail):
        logger.warning("upstream %s broke mid-stream (%s)", resp.url, broke)
        await out.write(dialect.error(tail, f"the engine's stream broke mid-answer ({broke}); "
                                      "the output above is incomplete"))
    try:
        await out.write_eof()
    except ConnectionResetError:  # the client left after the last event: it has it all
        pass
    return out, usage_from_sse(tail, head)


def _client_gone(request: web.Request) -> bool:
    """The client's connection is closed or closing (nothing more can reach it)."""
    return request.transport is None or request.transport.is_closing()


def stream_error(tail: bytes, message: str) -> bytes:
    """An SSE error event (OpenAI error object) and [DONE], starting on an event boundary."""
    body = msgspec.json.encode({"error": {"message": message, "type": "internal_error",
                                          "param": None, "code": None}})
    sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"  # close a cut-off event
    return sep + b"data: " + body + b"\n\ndata: [DONE]\n\n"
