"""Request ids over HTTP: ``X-Request-Id`` names a request, as in vLLM.

The response's id is ``{prefix}-{X-Request-Id}`` (``msg_`` / ``resp_`` for Anthropic's and
the Responses API's ids, which use an underscore as the real APIs do), the engine logs and aborts the request
under that name, and the header comes back on the response (the router forwards the
client's header, or makes one up). Without the header the id is a fresh random one.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from agentserve.api.openai import APIError

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_MAX = 256  # characters; a longer header is refused rather than cut
REQUEST_ID_KEY = web.RequestKey("request_id", str)  # what the response's X-Request-Id echoes


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def request_ids(request: web.Request, prefix: str, sep: str = "-") -> tuple[str, str]:
    """(the response's ``id``, the engine's request id) for one HTTP request.

    The engine's id has a random suffix when the client named the request, so two
    requests sent with the same header never collide in the engine.
    """
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if len(given) > REQUEST_ID_MAX:
        raise APIError(400, f"{REQUEST_ID_HEADER} is longer than {REQUEST_ID_MAX} characters")
    if not given.isprintable():  # control characters, or bytes that are not UTF-8 (which
        # aiohttp keeps as surrogates, and no answer carrying the id can encode)
        raise APIError(400, f"{REQUEST_ID_HEADER} must be printable UTF-8 text, got {given!r}")
    if not given:
        cid = new_id(prefix, sep)
        request[REQUEST_ID_KEY] = cid
        return cid, cid
    request[REQUEST_ID_KEY] = given
    cid = f"{prefix}{sep}{given}"
    return cid, f"{cid}-{uuid.uuid4().hex[:8]}"


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the request's id (the client's, or the one it was given)."""
    rid = request.get(REQUEST_ID_KEY)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid
