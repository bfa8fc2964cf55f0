"""`kv_transfer_params` at the API edge: checked field by field, acted on only when signed.

The params are an internal control path: a decode leg's make the engine connect to
``remote_host:remote_port`` and pull KV from there, a prefill leg's make it pin KV for a
decode engine. A client who could set them could point an engine at any address or hold
KV pinned. So an engine with KV transfer takes them through three checks, in this order:

1. shape (400, the message naming ``kv_transfer_params.<field>``): types, ranges, host
   syntax, each block hash as long as this engine's hash algorithm makes them, the block
   size when pulling; a malformed value never reaches the engine core;
2. signature (403): ``x-agentserve-transfer-auth: <unix seconds>.<hex HMAC-SHA256(token,
   "kv_transfer_params\\n<ts>\\n" + canonical JSON of the params)>``, the time within
   ``WINDOW_S`` of this engine's clock. The router signs each leg it sends (the prefill
   leg's params, and the decode leg's, which came from the prefill engine it chose); the
   cluster token (``--kv-transfer-token``) never travels. ``--insecure-transfer`` skips
   this check (vLLM-style setups and tests: anyone who reaches the port may set them);
3. peers (403): with ``--kv-transfer-peers``, a pull's ``remote_host:remote_port`` must be
   one of them (the transfer client checks every connection again).

Params that ask for nothing (neither ``do_remote_decode`` nor ``do_remote_prefill``), and
any params on an engine without KV transfer, are checked for shape only: the engine does
not act on them. The router's release call (``POST /v1/kv_transfer/release``) is signed the
same way over its body, with the purpose ``release``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentserve.api.openai import APIError

AUTH_HEADER = "x-agentserve-transfer-auth"
WINDOW_S = 60.0  # a signature older (or newer) than this is refused: clocks must agree this well
MAX_ID_CHARS = 256
MAX_HOST_CHARS = 253
PARAMS, RELEASE = "kv_transfer_params", "release"  # what a signature is for
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_HEX = re.compile(r"[0-9a-fA-F]*")


@dataclass(slots=True, frozen=True)
class TransferPolicy:
    """What one engine accepts in ``kv_transfer_params`` (built by `engine.builder`)."""

    enabled: bool = False  # the engine serves KV transfer (prefill/decode roles)
    token: str = ""  # the cluster secret the router signs with
    insecure: bool = False  # --insecure-transfer: unsigned params are acted on
    block_size: int = 16
    hash_bytes: int = 32  # the engine's block hash length (sha256_cbor: 32, fast: 16)
    max_blocks: int = 1 << 20  # longest block list a request of this engine can need
    peers: frozenset[tuple[str, int]] | None = None  # --kv-transfer-peers (None: any signed)


def canonical(obj: Any) -> bytes:
    """The bytes a signature covers: sorted keys, no spaces, ASCII (both ends in Python)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def _mac(token: str, purpose: str, ts: int, obj: Any) -> str:
    msg = f"{purpose}\n{ts}\n".encode() + canonical(obj)
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def sign(token: str, obj: Any, purpose: str = PARAMS, now: float | None = None) -> str:
    """The ``x-agentserve-transfer-auth`` value for ``obj`` (the params, or a release body)."""
    ts = int(time.time() if now is None else now)
    return f"{ts}.{_mac(token, purpose, ts, obj)}"


def verify(token: str, header: str | None, obj: Any, purpose: str = PARAMS,
           now: float | None = None, window: float = WINDOW_S) -> str | None:
    """None when ``header`` signs ``obj``; else why not (for the 403's message)."""
    if not header:
        return f"not signed (no {AUTH_HEADER} header)"
    ts_text, _, mac = header.strip().partition(".")
    if not ts_text.isdigit() or len(ts_text) > 12 or not mac:
        return f"malformed {AUTH_HEADER} header (want '<unix seconds>.<hex hmac>')"
    skew = (time.time() if now is None else now) - int(ts_text)
    if abs(skew) > window:
        return (f"signature {skew:+.0f} s old, beyond {window:.0f} s (a replay, or the router's "
                "and this engine's clocks disagree)")
    try:
        if hmac.compare_digest(mac, _mac(token, purpose, int(ts_text), obj)):
            return None
    except (TypeError, ValueError):  # a non-ASCII mac, or params JSON cannot carry
        pass
    return "bad signature (the router's --kv-transfer-token differs from this engine's)"


def signed_headers(token: str, obj: Any, purpose: str = PARAMS) -> dict[str, str]:
    """``{AUTH_HEADER: sign(...)}``: what a caller adds to a request carrying ``obj``."""
    return {AUTH_HEADER: sign(token, obj, purpose)}


def parse_peers(text: str | None) -> frozenset[tuple[str, int]] | None:
    """``host:port,host:port`` (IPv6 as ``[addr]:port``) -> a set; None or empty: None."""
    if not text or not text.strip():
        return None
    out = set()
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or not host_ok(host):
            raise ValueError(f"--kv-transfer-peers: {item!r} is not host:port (IPv6: [addr]:port)")
        out.add(peer_key(host, int(port)))
    return frozenset(out)


def peer_key(host: str, port: int) -> tuple[str, int]:
    """How a peer is compared: host case-folded, without a trailing dot."""
    return host.lower().rstrip("."), port


def host_ok(host: str) -> bool:
    """A host name or an IP literal, nothing else (no scheme, path, port or brackets)."""
    if not host or len(host) > MAX_HOST_CHARS:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(_LABEL.fullmatch(label) for label in host.rstrip(".").split("."))


def _bad(field: str, want: str, got: Any) -> APIError:
    shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
    return APIError(400, f"kv_transfer_params.{field} must be {want}, got {shown}",
                    f"kv_transfer_params.{field}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_shape(params: Any, policy: TransferPolicy) -> None:
    """400 naming the field unless every known field has its type and range."""
    if not isinstance(params, dict):
        raise APIError(400, f"kv_transfer_params must be an object, got {type(params).__name__}",
                       PARAMS)
    p = params
    for f in ("do_remote_decode", "do_remote_prefill"):
        if p.get(f) is not None and not isinstance(p[f], bool):
            raise _bad(f, "true or false", p[f])
    if p.get("do_remote_decode") and p.get("do_remote_prefill"):
        raise APIError(400, "kv_transfer_params.do_remote_decode and do_remote_prefill cannot "
                       "both be true (a leg is either the prefill or the decode)", PARAMS)
    host = p.get("remote_host")
    if host is not None and not (isinstance(host, str) and host_ok(host)):
        raise _bad("remote_host", "a host name or IP address (no scheme, port or path)", host)
    port = p.get("remote_port")
    if port is not None and not (_int(port) and 1 <= port <= 65535):
        raise _bad("remote_port", "an integer 1-65535", port)
    for f in ("remote_request_id", "remote_engine_id"):
        v = p.get(f)
        if v is not None and not (isinstance(v, str) and 0 < len(v) <= MAX_ID_CHARS):
            raise _bad(f, f"a non-empty string of at most {MAX_ID_CHARS} characters", v)
    for f in ("remote_num_tokens", "remote_block_size", "tp_size"):
        v = p.get(f)
        if v is not None and not (_int(v) and v >= 0):
            raise _bad(f, "a non-negative integer", v)
    _check_lists(p, policy)
    bs = p.get("remote_block_size")
    if policy.enabled and p.get("do_remote_prefill") and bs is not None and bs != policy.block_size:
        raise _bad("remote_block_size", f"this engine's block size {policy.block_size} (start "
                   "the prefill and decode engines with one --block-size)", bs)


def _check_lists(p: dict[str, Any], policy: TransferPolicy) -> None:
    ids = p.get("remote_block_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > policy.max_blocks:
            raise _bad("remote_block_ids", f"a list of at most {policy.max_blocks} block ids", ids)
        bad = next((b for b in ids if not (_int(b) and b >= 0)), None)
        if bad is not None:
            raise _bad("remote_block_ids", "a list of non-negative integers", bad)
    hashes = p.get("remote_block_hashes")
    if hashes is not None:
        if not isinstance(hashes, list) or len(hashes) > policy.max_blocks:
            raise _bad("remote_block_hashes", f"a list of at most {policy.max_blocks} hashes",
                       hashes)
        n = 2 * policy.hash_bytes
        bad = next((h for h in hashes if not (isinstance(h, str) and len(h) == n
                                              and _HEX.fullmatch(h))), None)
        if bad is not None:
            raise _bad("remote_block_hashes", f"a list of {n}-digit hex strings (this engine's "
                       f"{policy.hash_bytes}-byte block hashes)", bad)


def asks(params: Mapping[str, Any] | None) -> bool:
    """The params ask the engine to act (pin for a decode engine, or pull)."""
    return bool(params and (params.get("do_remote_decode") or params.get("do_remote_prefill")))


def admit(params: Any, headers: Mapping[str, str], policy: TransferPolicy) -> None:
    """The whole edge check of a generation request's ``kv_transfer_params`` (see the
    module docstring); raises APIError 400 or 403, both naming kv_transfer_params."""
    if params is None:
        return
    check_shape(params, policy)
    if not policy.enabled or not asks(params):
        return
    if not policy.insecure:
        why = verify(policy.token, headers.get(AUTH_HEADER), params)
        if why is not None:
            raise APIError(403, f"kv_transfer_params refused: {why}; only the router (or a "
                           "caller holding the cluster's --kv-transfer-token) may set them", PARAMS)
    host, port = params.get("remote_host"), params.get("remote_port")
    if (policy.peers is not None and params.get("do_remote_prefill") and host is not None
            and port is not None and peer_key(host, port) not in policy.peers):
        raise APIError(403, f"kv_transfer_params.remote_host:remote_port {host}:{port} is not in "
                       "this engine's --kv-transfer-peers", "kv_transfer_params.remote_host")


def admit_release(body: Any, headers: Mapping[str, str], policy: TransferPolicy) -> str | None:
    """None when a ``/v1/kv_transfer/release`` call may drop pins; else why not (a 403)."""
    if policy.insecure or not policy.enabled:  # (without transfer there are no pins: a 404)
        return None
    why = verify(policy.token, headers.get(AUTH_HEADER), body, RELEASE)
    return None if why is None else f"kv transfer release refused: {why}"


def policy_of(engine: Any) -> TransferPolicy:
    """The engine's policy (`builder` sets it); an engine without one has no KV transfer."""
    policy = getattr(engine, "transfer_policy", None)
    return policy if isinstance(policy, TransferPolicy) else TransferPolicy()
