"""The router's own error answers: OpenAI error objects (the engines' shape), the last line
of defence against a bug of ours, and Anthropic's shape on /v1/messages."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web

from agentserve.api.anthropic import anthropic_error
from agentserve.api.openai import APIError

logger = logging.getLogger("agentserve.router.gateway")


def error(status: int, message: str, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None, param: str | None = None,
          code: str | None = None) -> web.Response:
    """An OpenAI error object, the engine's shape: `code` is OpenAI's string code
    (`invalid_api_key`, `context_length_exceeded`, ...) or null, never the HTTP status."""
    if status == 401 and code is None:
        code = "invalid_api_key"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def internal_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A bug of ours in one request answers that request with an OpenAI error object
    (and a logged traceback), not aiohttp's HTML 500 page; other requests are unaffected."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - the last line of defence, logged in full
        logger.exception("internal error handling %s %s", request.method, request.path)
        return error(500, f"router internal error ({type(e).__name__}: {e}); see the router "
                     "log", "internal_error")


@web.middleware
async def anthropic_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """On /v1/messages the router's own errors take Anthropic's shape, as the engines'
    (which pass through as they are)."""
    resp = await handler(request)
    if (not request.path.startswith("/v1/messages") or resp.status < 400
            or not isinstance(resp, web.Response) or resp.body is None):
        return resp
    try:
        body = msgspec.json.decode(resp.body)
    except (msgspec.DecodeError, TypeError):
        return resp
    if isinstance(body, dict) and "type" not in body and isinstance(body.get("error"), dict):
        e = body["error"]
        shaped = anthropic_error(APIError(resp.status, str(e.get("message")), e.get("param")))
        return web.json_response(shaped, status=resp.status, headers={
            k: v for k, v in resp.headers.items() if k.lower() not in ("content-type",
                                                                       "content-length")})
    return resp
