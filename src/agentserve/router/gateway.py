"""The router's HTTP front (aiohttp): OpenAI API in, one endpoint per request out.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streamed chunk by chunk),
`GET /v1/models` (union of endpoints), `GET /health`, `GET /metrics`, and, behind the
API key, `POST /admin/endpoints` (add: an endpoint config mapping), `DELETE
/admin/endpoints?url=...` and `POST /admin/reload` (re-read the config file, also on
SIGHUP).

With an API key every route but /health and /metrics needs it. Every request body is read
before its handler, bounded in size (413) and silence (408; `agentserve.api.httpbounds`).
Per request: authenticate, parse (400 without touching a backend), tokenize
incrementally, admit (at most `max_inflight` in flight, `max_queue` waiting up to
`queue_timeout_s`, else 503 + Retry-After), decide, forward; an endpoint that fails
before the first byte is charged a failure and the request is retried once on the
next-best endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any

import aiohttp
import msgspec
import yaml
from aiohttp import web

from agentserve.api.httpbounds import body_timeout_middleware
from agentserve.router.config import EndpointConfig, RouterConfig, load_config
from agentserve.router.core import NoEndpoint, RouteInput, Router
from agentserve.router.endpoints import Endpoint, cancel, check_health, poll_loop, request_fault
from agentserve.router.errors import anthropic_errors, error, internal_errors
from agentserve.router.events import EventApplier, rebuild, subscribe
from agentserve.router.metrics import RouterMetrics
from agentserve.router.pd import DecodeUnreachable
from agentserve.router.proxy import Upstream, echo_request_id, forward
from agentserve.prompt.rawprompt import RawPromptCache
from agentserve.router.requests import BadRequest, parse_request

logger = logging.getLogger(__name__)
REBUILD_WAIT_S = 5.0  # longest the start waits for the engines' replay sockets
RELOAD_ERRORS = (OSError, ValueError, TypeError, yaml.YAMLError)  # a bad config file
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key: probes and scrapers


class Gateway:
    """Router + background loops + HTTP handlers."""

    def __init__(self, cfg: RouterConfig, config_path: str | None = None,
                 tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.opts = cfg.options
        self.config_path = config_path
        self.router = Router(cfg)
        self.metrics = RouterMetrics()
        self.tokenizer = tokenizer  # IncrementalTokenizer or None (token-id prompts only)
        mb = self.opts.raw_prompt_cache_mb
        self.raw_prompts = RawPromptCache(int(mb * 2**20)) if mb > 0 else None
        self.session: aiohttp.ClientSession | None = None
        self.zctx: Any = None
        self.tasks: dict[str, list[asyncio.Task]] = {}
        self.appliers: dict[str, EventApplier] = {}
        self._ready: dict[str, list[asyncio.Event]] = {}  # per endpoint: first rebuild tried
        self.active = 0
        self.waiting = 0
        self._slot = asyncio.Condition()
        from agentserve.router.pd import PDOrchestrator  # P/D: only acts with prefill endpoints
        self.pd = PDOrchestrator(self, self.opts.pd_threshold)

    # ---- lifecycle --------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.opts.max_body_mb * 2**20),
                              middlewares=[anthropic_errors, internal_errors, self._auth_middleware(),
                                           body_timeout_middleware(self.opts.body_timeout_s,
                                                                   self._error_answer)])
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_post("/v1/responses", self.handle_generate)
        app.router.add_post("/v1/messages", self.handle_generate)
        app.router.add_post("/v1/messages/count_tokens", self.handle_tokenize)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_post("/tokenize", self.handle_tokenize)
        app.router.add_post("/detokenize", self.handle_tokenize)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_post("/admin/endpoints", self.handle_add)
        app.router.add_delete("/admin/endpoints", self.handle_remove)
        app.router.add_post("/admin/reload", self.handle_reload)
        app.on_response_prepare.append(echo_request_id)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        import zmq.asyncio

        self.zctx = zmq.asyncio.Context()
        # Idle pooled connections are dropped after 15 s, before an engine closes them (its
        # --http-header-timeout, 30 s by default), so none is reused as the engine closes it.
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=15)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        for ep in list(self.router.endpoints.values()):
            self._spawn(ep.cfg)
        # Listen only once the index is rebuilt from the engines' replay sockets (a router
        # restarted beside running engines predicts their caches from its first request);
        # an engine that does not answer is caught up from its next batch.
        ready = [ev for evs in self._ready.values() for ev in evs]
        if ready:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in ready)),
                                       REBUILD_WAIT_S)
        # SIGHUP reload needs the main thread's loop (not so when embedded, e.g. in tests);
        # POST /admin/reload works everywhere.
        if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
        else:
            logger.info("SIGHUP reload not installed (not the main thread); use POST /admin/reload")

    async def _stop(self, app: web.Application) -> None:
        for url in list(self.tasks):
            await self._kill(url)
        if self.session is not None:
            await self.session.close()
        if self.zctx is not None:
            self.zctx.destroy(linger=0)

    def _spawn(self, e: EndpointConfig) -> None:
        """Start the poll loop and (precise mode) the KV event subscribers of an endpoint."""
        assert self.session is not None
        ep = self.router.endpoints[e.url]
        tasks = [asyncio.create_task(poll_loop(ep, self.session, self.opts,
                                               lambda url=e.url: self._rebuild(url)))]
        if e.kv_events and self.cfg.index == "precise":
            def learn(bs: int, ep=ep) -> None:
                if ep.cfg.block_size is None and ep.scrape.block_size is None:
                    ep.scrape.block_size = bs
            applier = self.appliers[e.url] = EventApplier(self.router.index, e.url, learn)
            ready = self._ready[e.url] = [asyncio.Event() for _ in range(e.dp_ranks)]
            tasks += [asyncio.create_task(subscribe(self.zctx, applier, e.kv_events, e.replay, r,
                                                    ready[r]))
                      for r in range(e.dp_ranks)]
        self.tasks[e.url] = tasks

    async def _rebuild(self, url: str) -> None:
        """An endpoint back from failed health checks (perhaps a restarted engine, which
        holds nothing yet): its index entries from its replay socket, before it takes
        traffic again (bounded by the replay's timeout)."""
        applier, ep = self.appliers.get(url), self.router.endpoints.get(url)
        if applier is None or ep is None or not ep.cfg.replay:
            return
        for r in range(ep.cfg.dp_ranks):
            await rebuild(self.zctx, applier, ep.cfg.replay, r)

    async def _kill(self, url: str) -> None:
        for t in self.tasks.pop(url, []):
            await cancel(t)
        self.appliers.pop(url, None)
        self._ready.pop(url, None)

    async def add_endpoint(self, e: EndpointConfig) -> Endpoint:
        await self._kill(e.url)
        new = e.url not in self.router.endpoints
        ep = self.router.add_endpoint(e)
        if self.session is not None:
            # Added while serving (admin, reload): no traffic until a health check passes,
            # as a pod that is not Ready gets none; its poll loop checks at once.
            if new:
                ep.healthy = False
            self._spawn(e)
        return ep

    async def remove_endpoint(self, url: str) -> bool:
        url = url.rstrip("/")
        known = url in self.router.endpoints
        await self._kill(url)
        self.router.remove_endpoint(url)
        return known

    async def reload(self) -> dict[str, list[str]]:
        """Re-read the config file: add new endpoints, drop vanished ones."""
        if not self.config_path:
            return {"added": [], "removed": []}
        new = load_config(self.config_path)
        want = {e.url: e for e in new.endpoints}
        removed = [u for u in list(self.router.endpoints) if u not in want]
        for u in removed:
            await self.remove_endpoint(u)
        added = [u for u in want if u not in self.router.endpoints]
        for u in added:
            await self.add_endpoint(want[u])
        return {"added": added, "removed": removed}

    def _on_sighup(self) -> None:
        asyncio.get_running_loop().create_task(self._reload_logged())

    async def _reload_logged(self) -> None:
        try:
            logger.info("SIGHUP reload: %s", await self.reload())
        except RELOAD_ERRORS as e:
            logger.error("SIGHUP reload failed, configuration unchanged: %s", e)

    # ---- admission ------------------------------------------------------------------
    async def _admit(self) -> bool:
        async with self._slot:
            if self.active < self.opts.max_inflight:
                self.active += 1
                return True
            if self.waiting >= self.opts.max_queue:
                return False
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slot.wait_for(
                    lambda: self.active < self.opts.max_inflight), self.opts.queue_timeout_s)
            except asyncio.TimeoutError:
                return False
            finally:
                self.waiting -= 1
            self.active += 1
            return True

    async def _release(self) -> None:
        async with self._slot:
            self.active -= 1
            self._slot.notify()

    def _authorized(self, request: web.Request) -> bool:
        key = self.cfg.api_key  # (Anthropic clients send it as x-api-key)
        return (not key or request.headers.get("Authorization", "") == f"Bearer {key}"
                or request.headers.get("x-api-key") == key)

    def _auth_middleware(self) -> Any:
        """With an API key, every route but the probes' needs it (before its body is read)."""
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path not in OPEN_PATHS and not self._authorized(request):
                return self._count(error(401, "invalid or missing API key",
                                         "authentication_error"))
            return await handler(request)
        return auth

    def _error_answer(self, request: web.Request, status: int, message: str) -> web.Response:
        return self._count(error(status, message))  # (a body too large or stalled)

    # ---- handlers -------------------------------------------------------------------
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # (read by body_timeout_middleware: at once)
        body = self.pd.trust.admit(request, body)  # a client's kv_transfer_params: removed
        try:
            route = parse_request(request.path, body, request.headers, self.tokenizer,
                                  self.raw_prompts)
        except BadRequest as e:
            return self._count(error(400, str(e)))
        if not await self._admit():
            self.metrics.rejected.inc()
            return self._count(error(503, "router saturated: too many requests in flight; "
                                     "retry later", "service_unavailable",
                                     {"Retry-After": str(self.opts.retry_after_s)}))
        try:
            return self._count(await self._route(request, body, route))
        finally:
            await self._release()

    async def handle_tokenize(self, request: web.Request) -> web.StreamResponse:
        """/tokenize, /detokenize and /v1/messages/count_tokens: answered by the least busy
        available engine serving the body's model (engines of one model tokenize alike); a
        second one if it fails."""
        try:
            body = await request.read()  # (read by body_timeout_middleware: at once)
            model = msgspec.json.decode(body).get("model") if body else None
        except (msgspec.DecodeError, AttributeError, RecursionError):
            return self._count(error(400, "request body is not a JSON object"))
        serving = [ep for ep in self.router.endpoints.values()
                   if not isinstance(model, str) or ep.serves(model)]
        if not serving:
            return self._count(error(404, f"model {model!r} is not served by any endpoint",
                                     param="model", code="model_not_found"))
        eps = sorted((ep for ep in serving if ep.available()), key=lambda ep: ep.inflight)
        if not eps:
            return self._count(error(503, "no available endpoint serves this model",
                                     "service_unavailable"))
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.opts.request_timeout_s,
                                        sock_connect=self.opts.connect_timeout_s)
        last: Upstream | None = None
        for ep in eps[:2]:
            try:
                resp, _ = await forward(request, self.session, ep.url + request.path, body,
                                        timeout, lambda: None, {"x-agentserve-endpoint": ep.url})
                return self._count(resp)
            except Upstream as e:
                last = e
        return self._count(self.upstream_error(last))

    async def _route(self, request: web.Request, body: bytes,
                     route: RouteInput) -> web.StreamResponse:
        assert self.session is not None
        tried: set[str] = set()
        last: Upstream | None = None
        if self.pd.enabled():
            try:
                resp = await self.pd.route(request, body, route)
            except NoEndpoint as e:  # a prompt over every decode endpoint's context limit
                return error(e.status, str(e), e.kind, param=e.param, code=e.code)
            except DecodeUnreachable as e:  # nothing was sent back: retry once, elsewhere
                tried.add(e.url)
                last, resp = e.upstream, None
            if resp is not None:
                return resp
        timeout = aiohttp.ClientTimeout(total=self.opts.request_timeout_s,
                                        sock_connect=self.opts.connect_timeout_s)
        for attempt in range(len(tried), 2):  # one try, and one retry before the first byte
            try:
                d = self.router.decide(route, exclude=tried)
            except NoEndpoint as e:
                if last is not None:
                    break
                return error(e.status, str(e), e.kind, param=e.param, code=e.code)
            if d.url in tried:
                self.router.finish(d)  # booked by decide: release it
                break
            tried.add(d.url)
            self._observe_decision(d, route, attempt)
            ep = self.router.endpoints[d.url]
            try:
                resp, cached = await forward(
                    request, self.session, d.url + request.path, body, timeout,
                    lambda d=d: self.router.first_byte(d),
                    {"x-agentserve-endpoint": d.url, "x-agentserve-reason": d.reason,
                     "x-agentserve-predicted-cached": str(d.predicted_cached)})
            except Upstream as e:
                last = e
                if request_fault(e.status, e.body):
                    break  # the request's own failure: it would fail anywhere; not the engine's
                if ep.record_failure(self.opts):
                    self.metrics.ejections.labels(d.url).inc()
                continue
            finally:
                self.router.finish(d)
            ep.record_success()
            if cached is not None:
                self.metrics.observe_cached(d.predicted_cached, cached)
            return resp
        return self.upstream_error(last)

    def _observe_decision(self, d: Any, route: RouteInput, attempt: int) -> None:
        self.metrics.decisions.labels(d.url, d.reason).inc()
        self.metrics.decision_seconds.observe(d.seconds + route.parse_seconds)
        self.metrics.prompt_tokens.inc(d.prompt_len)
        if attempt:
            self.metrics.retries.inc()

    def upstream_error(self, last: Upstream | None) -> web.Response:
        """The answer when no endpoint served: the last upstream's error as it sent it, or
        a 502 when none answered (used by the P/D orchestration too)."""
        if last is not None and last.status is not None:
            return web.Response(status=last.status, body=last.body, headers=last.headers)
        return error(502, f"all endpoints tried failed; last: {last}", "bad_gateway")

    def _count(self, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(str(resp.status)).inc()
        return resp

    async def handle_models(self, request: web.Request) -> web.Response:
        ids: dict[str, str] = {}
        for ep in self.router.endpoints.values():
            for m in ep.models or ([ep.cfg.model] if ep.cfg.model else []):
                ids.setdefault(m, ep.url)
        data = [{"id": m, "object": "model", "owned_by": "agentserve", "created": 0}
                for m in ids]
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        eps = self.router.endpoints.values()
        up = [ep.url for ep in eps if ep.available()]
        routable = bool(self.router.live(count=False))  # panic routing counts as serving
        body = {"status": "ok" if routable else "unavailable", "healthy": up,
                "unhealthy": [ep.url for ep in eps if not ep.available()]}
        return web.json_response(body, status=200 if routable else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        m = self.metrics
        m.index_blocks.set(len(self.router.index))
        m.queue.set(self.waiting)
        for mode, n in getattr(self.tokenizer, "renders", {}).items():
            m.chat_renders.labels(mode).set(n)
        for mode, n in getattr(self.raw_prompts, "parses", {}).items():
            m.token_id_parses.labels(mode).set(n)
        m.panic_routing.set(self.router.panics)
        for url, ep in self.router.endpoints.items():
            m.inflight.labels(url).set(ep.inflight)
            m.healthy.labels(url).set(1 if ep.available() else 0)
        for url, a in self.appliers.items():
            m.event_lag.labels(url).set(max((s.lag_s for s in a.streams.values()), default=0))
            m.event_gaps.labels(url).set(sum(s.gaps for s in a.streams.values()))
        return web.Response(body=m.render(), content_type="text/plain", charset="utf-8")

    async def handle_add(self, request: web.Request) -> web.Response:
        if not self.cfg.api_key or not self._authorized(request):
            return error(401, "admin needs the router's API key (start with --api-key)",
                         "authentication_error")
        try:
            e = EndpointConfig(**msgspec.json.decode(await request.read()))
        except (msgspec.DecodeError, TypeError, ValueError) as ex:
            return error(400, f"bad endpoint config: {ex}")
        ep = await self.add_endpoint(e)
        ok = ep.healthy
        if self.session is not None and not ok:  # answer with what the first check finds
            ok = await check_health(ep, self.session, self.opts)
        return web.json_response({"added": e.url, "healthy": ok})

    async def handle_remove(self, request: web.Request) -> web.Response:
        if not self.cfg.api_key or not self._authorized(request):
            return error(401, "admin needs the router's API key (start with --api-key)",
                         "authentication_error")
        url = request.query.get("url", "")
        if not await self.remove_endpoint(url):
            return error(404, f"no endpoint {url!r}")
        return web.json_response({"removed": url.rstrip("/")})

    async def handle_reload(self, request: web.Request) -> web.Response:
        if not self.cfg.api_key or not self._authorized(request):
            return error(401, "admin needs the router's API key", "authentication_error")
        try:
            return web.json_response(await self.reload())
        except RELOAD_ERRORS as e:  # the running configuration stays as it was
            return error(400, f"reload failed: {e}")

