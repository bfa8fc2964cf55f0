"""The engine's OpenAI-compatible HTTP server (aiohttp).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stateless),
POST /v1/messages and /v1/messages/count_tokens (Anthropic's), GET /v1/models, POST
/tokenize and /detokenize (vLLM's), GET /health (503 while draining), GET /metrics
(Prometheus text, vLLM names).

Every failure is an OpenAI error object (on /v1/messages an Anthropic one) with a 4xx/5xx
status; a bad request never disturbs others. With an API key, every route but /health and
/metrics (left open for probes and scrapers) needs `Authorization: Bearer KEY` or
`x-api-key: KEY` (Anthropic clients send the latter). A request body is read in full
before its handler runs, bounded in size (413) and in silence (408; ``httpbounds``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from agentserve.engine.http.metrics import ServerMetrics
from agentserve.api.openai import APIError
from agentserve.api.request_id import echo_request_id
from agentserve.engine.http.serving import EngineClient, json_response
from agentserve.engine.http.completions import create_completion
from agentserve.engine.http.chat import create_chat
from agentserve.engine.http.messages import anthropic_error, count_tokens, create_message
from agentserve.engine.http.responses import create_response
from agentserve.engine.http.tokenize import detokenize, tokenize
from agentserve.api.httpbounds import DEFAULT_LIMITS, body_timeout_middleware
from agentserve.api.kv_transfer import admit_release, policy_of

log = logging.getLogger("agentserve.server")

ENGINE = web.AppKey("engine", object)
METRICS = web.AppKey("metrics", ServerMetrics)
API_KEY = web.AppKey("api_key", object)
CREATED = web.AppKey("created", int)
MAX_BODY = web.AppKey("max_body_bytes", int)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key: probes and scrapers


def _engine(request: web.Request) -> EngineClient:
    return request.app[ENGINE]  # type: ignore[return-value]


def check_model(engine: EngineClient, model: str | None) -> None:
    """Accept the served name or the model folder path; anything else is a 404."""
    if model is None:
        return
    served = getattr(engine, "model_names", [engine.model_name])
    if model not in {*served, str(getattr(engine, "model_dir", engine.model_name))}:
        raise APIError(404, f"The model `{model}` does not exist. This server serves "
                       f"{', '.join(f'`{n}`' for n in served)}.", "model", "model_not_found")


class _ModelOnly(msgspec.Struct):
    model: str | None = None


def _requested_model(body: bytes) -> str | None:
    """The body's "model" field, read leniently (full validation comes later)."""
    try:
        return msgspec.json.decode(body, type=_ModelOnly).model
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # `decode` answers these with a 400 when the body is read in full


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every error into an OpenAI error object (an Anthropic one on /v1/messages)."""
    try:
        return await handler(request)
    except APIError as e:
        err = e
    except web.HTTPRequestEntityTooLarge:
        err = APIError(413, f"request body too large: the limit is {request.app[MAX_BODY]} bytes")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = APIError(e.status, e.reason)
    except Exception as e:  # a bug: answer 500, keep serving
        log.exception("request %s %s failed", request.method, request.path)
        err = APIError(500, f"internal error: {type(e).__name__}: {e}")
    body = anthropic_error(err) if request.path.startswith("/v1/messages") else err.body()
    return json_response(body, err.status)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[API_KEY]
    if key and request.path not in OPEN_PATHS:
        if (request.headers.get("Authorization", "") != f"Bearer {key}"
                and request.headers.get("x-api-key") != key):
            raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>'", code="invalid_api_key")
    return await handler(request)


def _generation(create: Callable[..., Awaitable[web.StreamResponse]]) -> Handler:
    """A generation route: the body's model checked, then ``create(request, engine,
    metrics, body)``."""
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        check_model(_engine(request), _requested_model(body))
        return await create(request, _engine(request), request.app[METRICS], body)
    return handler


def _answer(answer: Callable[[EngineClient, bytes], dict[str, Any]]) -> Handler:
    """A route answered at once (tokenizing, counting): ``answer(engine, body)`` as JSON,
    computed in a worker thread (a long conversation's tokens are not the event loop's)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        check_model(_engine(request), _requested_model(body))
        return json_response(await asyncio.to_thread(answer, _engine(request), body))
    return handler


async def models(request: web.Request) -> web.Response:
    engine = _engine(request)
    cards = [{"id": name, "object": "model", "created": request.app[CREATED],
              "owned_by": "agentserve", "root": str(getattr(engine, "model_dir", engine.model_name)),
              "max_model_len": engine.max_model_len, "role": getattr(engine, "role", "both")}
             for name in getattr(engine, "model_names", [engine.model_name])]
    return json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    engine = _engine(request)
    if getattr(engine, "draining", False):
        return json_response(APIError(503, "server is draining").body(), 503)
    dead = getattr(getattr(engine, "core", None), "dead", None)
    if dead is not None:  # the router ejects us; a supervisor should restart us
        return json_response(APIError(503, f"engine core stopped: {dead!r}").body(), 503)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def kv_transfer_release(request: web.Request) -> web.Response:
    """Drop the pins of a finished prefill leg nobody will pull (the router's client left)."""
    try:
        body = json.loads(await request.read() or b"{}")
        rid = body.get("remote_request_id")
    except (ValueError, AttributeError):
        body = rid = None
    if not isinstance(rid, str) or not rid:
        return json_response(APIError(400, "remote_request_id (string) is required").body(), 400)
    refused = admit_release(body, request.headers, policy_of(_engine(request)))
    if refused is not None:  # an internal path: only the router (signing) may drop pins
        return json_response(APIError(403, refused, "remote_request_id").body(), 403)
    release = getattr(_engine(request), "release_transfer", None)
    if release is None or not release(rid):
        return json_response(APIError(404, "this engine has no KV transfer (--role both)").body(), 404)
    return json_response({"released": rid})


def _raise_error(request: web.Request, status: int, message: str) -> web.StreamResponse:
    raise APIError(status, message)  # shaped by errors_middleware (Anthropic's on /v1/messages)


def build_app(engine: EngineClient, api_key: str | None = None, max_body_bytes: int = 32 << 20,
              body_timeout_s: float = DEFAULT_LIMITS.body_timeout_s) -> web.Application:
    """The aiohttp app for one engine; the caller runs it (and starts the engine).
    ``body_timeout_s``: a body that sends nothing for this long is answered 408."""
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[errors_middleware, auth_middleware,
                                       body_timeout_middleware(body_timeout_s, _raise_error)])
    app[ENGINE] = engine
    app[METRICS] = ServerMetrics(engine)
    app[API_KEY] = api_key
    app[CREATED] = int(time.time())
    app[MAX_BODY] = max_body_bytes
    app.on_response_prepare.append(echo_request_id)
    app.router.add_post("/v1/completions", _generation(create_completion))
    app.router.add_post("/v1/chat/completions", _generation(create_chat))
    app.router.add_post("/v1/responses", _generation(create_response))
    app.router.add_post("/v1/messages", _generation(create_message))
    app.router.add_post("/v1/messages/count_tokens", _answer(count_tokens))
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", _answer(tokenize))
    app.router.add_post("/detokenize", _answer(detokenize))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/kv_transfer/release", kv_transfer_release)
    return app
