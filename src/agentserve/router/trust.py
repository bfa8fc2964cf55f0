"""What only the router may set: internal fields kept from clients, and the legs it signs.

``kv_transfer_params`` steer the engines' KV transfers (where a decode engine connects,
what a prefill engine pins), so they are the router's to set. A client's are removed from
its body before any engine sees it (``agentserve_router_internal_fields_stripped_total``),
unless the client is an operator: it sends the router's ``operator_key`` in
``x-agentserve-operator-key`` (hand-run P/D legs, tests), and then its params are kept and
signed like the router's own. Client-sent ``x-agentserve-transfer-auth`` and
``x-agentserve-operator-key`` headers are never forwarded (`proxy.forward_headers`).

With the cluster's ``kv_transfer_token`` the router signs every leg's params (the prefill
leg's, the decode leg's it got from the prefill engine it chose) and each pin release:
``x-agentserve-transfer-auth`` (`engine.transfer_params`); the token itself is never
sent. A real vLLM ignores the header. An agentserve engine that refuses the router's
signature (no token here, or a different one) answers 403; the router passes that on
instead of quietly prefilling on the decode engine (`TransferRefused`).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from agentserve.api.kv_transfer import AUTH_HEADER, RELEASE, sign
from agentserve.router.errors import error
from agentserve.router.proxy import OPERATOR_HEADER, TRANSFER_AUTH
from agentserve.router.requests import strip_internal

logger = logging.getLogger(__name__)


class TransferRefused(Exception):
    """A prefill engine refused the router's kv_transfer_params (403): a configuration
    error of the cluster (tokens), answered to the client as that 403."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(detail)
        self.url, self.detail = url, detail

    def response(self) -> web.Response:
        return error(403, f"the prefill engine {self.url} refused the router's kv_transfer_params "
                     f"({self.detail}); give the router the cluster's --kv-transfer-token "
                     "(AGENTSERVE_KV_TRANSFER_TOKEN)", "permission_error",
                     param="kv_transfer_params")


class Trust:
    """The router's side of the engines' internal control paths (see the module docstring)."""

    def __init__(self, token: str | None, operator_key: str | None,
                 registry: CollectorRegistry) -> None:
        self.token, self.operator_key = token or "", operator_key or ""
        self.stripped = Counter("agentserve_router_internal_fields_stripped", "Client requests "
                                "whose internal fields (kv_transfer_params) were removed",
                                ["field"], registry=registry)
        self._refusals_logged = False

    def operator(self, request: web.Request) -> bool:
        """The caller sent the router's operator key."""
        got = request.headers.get(OPERATOR_HEADER, "")
        return bool(self.operator_key) and hmac.compare_digest(got.encode(), self.operator_key.encode())

    def admit(self, request: web.Request, body: bytes) -> bytes:
        """The body as engines may see it: a client's internal fields removed; an operator's
        kept, and its kv_transfer_params signed for whichever engine gets them."""
        found = strip_internal(body)
        if found is None:
            return body
        stripped, fields = found
        if self.operator(request):
            self.sign(request, fields.get("kv_transfer_params"))
            return body
        for name in fields:
            self.stripped.labels(name).inc()
        return stripped

    def sign(self, request: web.Request, params: Any) -> None:
        """The signature the next leg of ``request`` carries (`proxy.forward_headers`);
        ``params`` None (or no token): none."""
        if params is None or not self.token:
            request.pop(TRANSFER_AUTH, None)
        else:
            request[TRANSFER_AUTH] = sign(self.token, params)

    def release_headers(self, rid: str) -> dict[str, str]:
        """The signature of a ``/v1/kv_transfer/release`` body ``{"remote_request_id": rid}``."""
        if not self.token:
            return {}
        return {AUTH_HEADER: sign(self.token, {"remote_request_id": rid}, RELEASE)}

    def refused(self, url: str, status: int, body: bytes) -> TransferRefused:
        """A prefill leg's 403, as the error the client gets (logged once: it is the whole
        cluster's configuration, not this request's)."""
        try:
            detail = str(json.loads(body)["error"]["message"])[:300]
        except (ValueError, KeyError, TypeError):
            detail = body.decode("utf-8", "replace")[:300]
        if not self._refusals_logged:
            self._refusals_logged = True
            logger.error("prefill engine %s refused the router's kv_transfer_params (HTTP %d: %s); "
                         "start the router with the engines' --kv-transfer-token", url, status,
                         detail)
        return TransferRefused(url, detail)
