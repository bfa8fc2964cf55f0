"""Forward one request to one endpoint and pass the answer through, chunk by chunk.

The body is forwarded byte for byte (never re-encoded). A streamed answer is written to
the client as each upstream chunk arrives; the last few KB are kept to read the final
`usage` chunk. `Upstream` errors raised *before the first byte* let the gateway retry
on another endpoint; after the first byte the stream is the client's, and a stream the
upstream ends without `data: [DONE]` (engine died, connection broke) gets an OpenAI error
event and `[DONE]`, as vLLM's server does for its own errors, so that clients raise rather
than take a truncated answer for a whole one. A client disconnect cancels the handler,
which closes the upstream connection, which makes the engine abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

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


def forward_headers(request: web.Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP and k.lower() != "x-request-id"}
    headers[REQUEST_ID_HEADER] = request_id(request)
    return headers


def cached_tokens_of(usage: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, if present."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


def usage_from_sse(tail: bytes) -> int | None:
    """Cached tokens from the last SSE `data:` line that carries usage."""
    for line in reversed(tail.split(b"\n")):
        if b'"usage"' in line and line.startswith(b"data:"):
            try:
                return cached_tokens_of(msgspec.json.decode(line[5:].strip()).get("usage"))
            except (msgspec.DecodeError, AttributeError):
                return None
    return None


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
    tail = first[-_TAIL:]
    broke = "the stream ended without [DONE]"
    try:
        if first:
            await out.write(first)
        async for chunk in it:
            await out.write(chunk)
            tail = (tail + chunk)[-_TAIL:]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        broke = f"{type(e).__name__}: {e}"
    except (ConnectionResetError, RuntimeError):
        resp.close()  # the client went away: drop the upstream connection (engine aborts)
        raise
    if not tail.rstrip().endswith(b"data: [DONE]"):
        logger.warning("upstream %s broke mid-stream (%s)", resp.url, broke)
        await out.write(stream_error(tail, f"the engine's stream broke mid-answer ({broke}); "
                                     "the output above is incomplete"))
    await out.write_eof()
    return out, usage_from_sse(tail)


def stream_error(tail: bytes, message: str) -> bytes:
    """An SSE error event (OpenAI error object) and [DONE], starting on an event boundary."""
    body = msgspec.json.encode({"error": {"message": message, "type": "internal_error",
                                          "param": None, "code": None}})
    sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"  # close a cut-off event
    return sep + b"data: " + body + b"\n\ndata: [DONE]\n\n"
