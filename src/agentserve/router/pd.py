"""Prefill/decode orchestration: two legs per request, vLLM's `kv_transfer_params` contract.

Per request, when the fleet has prefill endpoints:

1. pick the decode endpoint first (roles decode/both; the same scorers: cache locality
   against active requests);
2. disaggregate only when the decode endpoint lacks at least ``pd_threshold`` prompt
   tokens (a mostly cached turn is cheaper to finish where its KV already is);
3. pick a prefill endpoint (roles prefill/both; prefix- and queue-aware scorers);
4. prefill leg: the same body with ``max_tokens=1`` (``max_output_tokens`` on
   /v1/responses), ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true,
   ...}``, to the same path (chat, completions, Responses or Anthropic Messages: the
   engines carry the params on each);
5. decode leg: the original body plus the ``kv_transfer_params`` the prefill returned,
   streamed back through the normal proxy.

Field names are vLLM's, so a vLLM P/D pair (NIXL connector) can sit behind this too. A
prefill endpoint that is down, slow or answers without params makes the decode endpoint
prefill locally (``agentserve_router_pd_fallbacks``). A client that disconnects cancels
the leg in flight (aiohttp cancels the handler; the engine aborts and frees its blocks).
Pins of a finished prefill leg are released by the decode engine's pull; when the client
left between the legs, or the decode leg failed or was cancelled before its engine
answered, the router frees them at once (``POST /v1/kv_transfer/release`` on the prefill
engine, ``agentserve_router_pd_releases``); otherwise they expire.

Every leg's params and each release are signed with the cluster's token, and a client's
own ``kv_transfer_params`` never reach an engine (`trust.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import Counter, Histogram

from agentserve.router.core import Decision, NoEndpoint, RouteInput, Router
from agentserve.router.endpoints import request_fault
from agentserve.router.proxy import Upstream, forward, forward_headers
from agentserve.router.trust import TransferRefused, Trust

logger = logging.getLogger(__name__)
RELEASE_PATH = "/v1/kv_transfer/release"  # agentserve engines; vLLM's pins expire instead
MAX_FIELD = {"/v1/responses": "max_output_tokens"}  # a path's output limit, where not max_tokens
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


class DecodeUnreachable(Exception):
    """The decode leg's engine could not be reached (refused, or gone before answering):
    nothing reached the client, so the gateway retries the request once elsewhere."""

    def __init__(self, url: str, upstream: Upstream) -> None:
        super().__init__(str(upstream))
        self.url, self.upstream = url, upstream


def pick(router: Router, req: RouteInput, roles: tuple[str, ...], charge_output: bool) -> Decision:
    """``Router.decide`` restricted to endpoints with one of ``roles`` (books the choice)."""
    t0, now = time.perf_counter(), time.monotonic()
    cands, keys = router.candidates(req, now)
    cands = [c for c in cands if c.role in roles and c.model_ok]
    if not cands:
        raise NoEndpoint(f"no healthy endpoint with role {'/'.join(roles)}")
    cands = router.fits(cands, len(req.token_ids))  # a prompt over every context limit: 400
    return router.pick_and_book(req, cands, keys, now, t0, charge_output)


class PDOrchestrator:
    """The gateway's P/D path; ``route`` returns None when a request should not split."""

    def __init__(self, gw: Any, threshold: int = 256, prefill_timeout_s: float = 120.0) -> None:
        self.gw, self.threshold, self.prefill_timeout_s = gw, threshold, prefill_timeout_s
        r, p = gw.metrics.registry, "agentserve_router_pd_"
        self.legs = Counter(p + "requests", "Requests by P/D path", ["path"], registry=r)
        self.fallbacks = Counter(p + "fallbacks", "Prefill legs that failed (decode prefilled "
                                 "locally)", ["reason"], registry=r)
        self.prefill_seconds = Histogram(p + "prefill_leg_seconds", "Prefill leg latency",
                                         registry=r)
        self.releases = Counter(p + "releases", "Prefill pins released by the router (no decode "
                                "leg will pull them)", ["reason"], registry=r)
        self.trust = Trust(gw.cfg.kv_transfer_token, gw.cfg.operator_key, r)
        self._tasks: set[asyncio.Task] = set()
        if not self.trust.token and any(e.role == "prefill" for e in gw.cfg.endpoints):
            logger.warning("prefill endpoints but no --kv-transfer-token: agentserve engines "
                           "refuse unsigned P/D legs (403); vLLM engines ignore the signature")

    def enabled(self) -> bool:
        """The fleet has a prefill pool (healthy or not) and a decode endpoint up.

        Configured, not healthy, prefill endpoints count: with the whole prefill pool down
        or ejected, requests still take the P/D path and fall back visibly
        (``fallbacks{reason="no_prefill_endpoint"}``) instead of silently turning into
        aggregated traffic."""
        eps = self.gw.router.endpoints.values()
        return (any(ep.cfg.role == "prefill" for ep in eps)
                and any(ep.cfg.role in ("decode", "both") and ep.available() for ep in eps))

    async def route(self, request: web.Request, body: bytes,
                    route: RouteInput) -> web.StreamResponse | None:
        router: Router = self.gw.router
        try:
            d = pick(router, route, ("decode", "both"), True)
        except NoEndpoint as e:
            if e.status == 400:
                raise  # the prompt fits no decode endpoint: the client's error, not a reason to split
            return None
        headers: dict[str, str] = {"x-agentserve-endpoint": d.url, "x-agentserve-reason": d.reason}
        # computed on the decode engine alone, its cached tokens are its own prefix hit, as
        # predicted; a pulled prompt's are not (pulled tokens count as cached there, as in vLLM)
        predicted = {"x-agentserve-predicted-cached": str(d.predicted_cached)}
        req: Any = None
        try:
            req = msgspec.json.decode(body)
            # n > 1 is not split: a P/D leg is one sample (the engines refuse n > 1 with
            # kv_transfer_params), and the decode engine computes the prompt once for all n;
            # nor is a request scoring its prompt, which one engine computes all of
            if (d.uncached < self.threshold or not isinstance(req, dict)
                    or req.get("kv_transfer_params") or route.samples > 1 or _scores_prompt(req)):
                self.legs.labels("aggregated").inc()
                return await self._decode_leg(request, d, body, {**headers, **predicted})
            try:
                params, info, prefill_url = await self._prefill_leg(request, route, req)
            except TransferRefused as e:  # the cluster's tokens disagree: say so, loudly
                return e.response()
            headers["x-agentserve-pd"] = info
            if params is None:
                self.legs.labels("fallback").inc()
                self.trust.sign(request, None)
                return await self._decode_leg(request, d, body, {**headers, **predicted})
            self.legs.labels("disaggregated").inc()
            headers["x-agentserve-pd"] = f"{info};decode_route_ms={d.seconds * 1e3:.2f}"
            return await self._pulling_leg(request, d, req, params, prefill_url, headers)
        finally:
            router.finish(d)
            if not (isinstance(req, dict) and req.get("kv_transfer_params")):
                self.trust.sign(request, None)  # (an operator's own signature stays for a retry)

    async def _pulling_leg(self, request: web.Request, d: Decision, req: dict[str, Any],
                           params: dict[str, Any], prefill_url: str,
                           headers: dict[str, str]) -> web.StreamResponse:
        """The decode leg with the prefill's params, signed; releases the pins when it
        never reached its engine."""
        router: Router = self.gw.router
        if request.transport is None or request.transport.is_closing():
            # the client left between the legs: no decode leg will pull these pins
            self._release(request, prefill_url, params, "client_gone")
            return web.Response(status=499)
        body = msgspec.json.encode({**req, "kv_transfer_params": params})
        self.trust.sign(request, params)
        started = False

        def first_byte() -> None:
            nonlocal started
            started = True
            router.first_byte(d)

        try:
            resp = await self._decode_leg(request, d, body, headers, first_byte)
        except asyncio.CancelledError:  # client gone before the decode engine answered
            if not started:
                self._release(request, prefill_url, params, "client_gone")
            raise
        except DecodeUnreachable:  # retried elsewhere, without these pins
            self._release(request, prefill_url, params, "decode_failed")
            raise
        if not started:  # the decode leg failed: its engine may never have seen the params
            self._release(request, prefill_url, params, "decode_failed")
        return resp

    def _release(self, request: web.Request, prefill_url: str, params: dict[str, Any],
                 reason: str) -> None:
        """Free the prefill engine's pins now, in a task of its own (survives cancellation).

        Harmless when the decode engine already pulled them (an unknown id is a no-op); a
        prefill engine without the endpoint (e.g. vLLM) lets its pins expire instead."""
        rid = params.get("remote_request_id")
        if not rid:
            return
        self.releases.labels(reason).inc()
        headers = {k: v for k, v in forward_headers(request).items()
                   if k.lower() in ("authorization", "x-api-key")}
        headers.update(self.trust.release_headers(str(rid)))
        task = asyncio.get_running_loop().create_task(self._post_release(prefill_url, str(rid), headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_release(self, prefill_url: str, rid: str, headers: dict[str, str]) -> None:
        try:
            assert self.gw.session is not None
            async with self.gw.session.post(prefill_url + RELEASE_PATH, json={"remote_request_id": rid},
                                            headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass  # the pins expire after --kv-transfer-timeout anyway

    async def _prefill_leg(self, request: web.Request, route: RouteInput,
                           req: dict[str, Any]) -> tuple[dict | None, str, str]:
        """Run the prefill leg; (params, timing header, prefill URL), params None on failure."""
        router: Router = self.gw.router
        try:
            p = pick(router, route, ("prefill",), False)
        except NoEndpoint:
            self.fallbacks.labels("no_prefill_endpoint").inc()
            return None, "fallback=no_prefill_endpoint", ""
        leg = {**req, "stream": False, "kv_transfer_params": dict(PREFILL_PARAMS),
               MAX_FIELD.get(request.path, "max_tokens"): 1}
        leg.pop("stream_options", None)
        leg.pop("max_completion_tokens", None)
        self.trust.sign(request, leg["kv_transfer_params"])
        t0 = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.prefill_timeout_s,
                                        sock_connect=self.gw.opts.connect_timeout_s)
        reason = "ok"
        try:
            assert self.gw.session is not None
            async with self.gw.session.post(p.url + request.path, data=msgspec.json.encode(leg),
                                            headers=forward_headers(request), timeout=timeout) as r:
                if r.status == 403:  # refused our signature: no silent local prefill
                    raise self.trust.refused(p.url, r.status, await r.read())
                out = await r.json(content_type=None) if r.status == 200 else None
                reason = f"http_{r.status}" if out is None else reason
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            out, reason = None, type(e).__name__
            if router.endpoints.get(p.url) is not None:
                router.endpoints[p.url].record_failure(self.gw.opts)
        finally:
            router.finish(p)
        secs = time.perf_counter() - t0
        params = (out or {}).get("kv_transfer_params") if isinstance(out, dict) else None
        if not params:
            self.fallbacks.labels(reason if reason != "ok" else "no_params").inc()
            return None, f"fallback={reason};prefill={p.url}", p.url
        self.prefill_seconds.observe(secs)
        return (params, f"prefill={p.url};prefill_ms={secs * 1e3:.1f};route_ms={p.seconds * 1e3:.2f}",
                p.url)

    async def _decode_leg(self, request: web.Request, d: Decision, body: bytes,
                          headers: dict[str, str],
                          first_byte: Callable[[], None] | None = None) -> web.StreamResponse:
        timeout = aiohttp.ClientTimeout(total=self.gw.opts.request_timeout_s,
                                        sock_connect=self.gw.opts.connect_timeout_s)
        try:
            resp, _ = await forward(request, self.gw.session, d.url + request.path, body, timeout,
                                    first_byte or (lambda: self.gw.router.first_byte(d)), headers)
        except Upstream as e:
            ep = self.gw.router.endpoints.get(d.url)
            if (ep is not None and not request_fault(e.status, e.body)
                    and ep.record_failure(self.gw.opts)):
                self.gw.metrics.ejections.labels(d.url).inc()
            if e.status is None:
                raise DecodeUnreachable(d.url, e) from e
            return self.gw.upstream_error(e)
        return resp


def _scores_prompt(req: dict[str, Any]) -> bool:
    """The request asks for its prompt's logprobs (``prompt_logprobs``, or echo with logprobs)."""
    return req.get("prompt_logprobs") is not None or (bool(req.get("echo"))
                                                      and req.get("logprobs") is not None)
