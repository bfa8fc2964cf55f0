"""Authenticating a KV transfer connection without sending the secret.

Challenge-response once per connection (then the connection is trusted for its life):

    server -> {"op": "hello", "v": 2, "nonce": sn}            (32 random bytes; or a refusal:
                                                              {"ok": false, "error"})
    client -> {"op": "auth", "nonce": cn, "mac": HMAC-SHA256(token, "client" | sn | cn)}
    server -> {"ok": true, "mac": HMAC-SHA256(token, "server" | sn | cn)}
              (or {"ok": false, "error"} and it closes)

Both MACs cover both nonces, so neither side can replay a recorded exchange (the other's
nonce is fresh), and the labels keep one side's answer from passing for the other's. Only
MACs and nonces travel: a listener learns nothing it could use on another connection, and
a fake server (say, one a client named in ``remote_host``) learns nothing about the token.
The client checks the server's MAC before sending a request, so it never writes pulled
bytes it got from an engine without the token. The token may be empty (engines started
with ``--insecure-transfer``): the exchange then proves nothing, but the protocol is one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from agentserve.kv.remote.frames import TransferError, recv_header, send_frame

PROTOCOL = 2
NONCE_BYTES = 32
MAX_AUTH_FRAME = 1024  # bytes of an auth-phase header: an unauthenticated peer sends small ones
MISMATCH = "kv transfer authentication failed: the engines' --kv-transfer-token differ"


def _mac(token: str, label: bytes, sn: bytes, cn: bytes) -> bytes:
    return hmac.new(token.encode(), label + b"|" + sn + cn, hashlib.sha256).digest()


def _nonce(frame: object) -> bytes | None:
    n = frame.get("nonce") if isinstance(frame, dict) else None
    return n if isinstance(n, bytes) and len(n) == NONCE_BYTES else None


def refuse(sock: socket.socket, reason: str) -> None:
    """Answer a new connection with a refusal instead of a challenge (then close it)."""
    try:
        send_frame(sock, {"ok": False, "error": reason})
    except OSError:
        pass


def server_handshake(sock: socket.socket, token: str, deadline: float) -> None:
    """Challenge the peer; returns once it proved the token, raises TransferError (after
    telling it why) when it did not, or did not answer by ``deadline``."""
    sn = secrets.token_bytes(NONCE_BYTES)
    send_frame(sock, {"op": "hello", "v": PROTOCOL, "nonce": sn})
    frame = recv_header(sock, MAX_AUTH_FRAME, deadline)
    cn, mac = _nonce(frame), frame.get("mac") if isinstance(frame, dict) else None
    if (cn is None or not isinstance(mac, bytes)
            or not hmac.compare_digest(mac, _mac(token, b"client", sn, cn))):
        refuse(sock, MISMATCH)
        raise TransferError("peer failed kv transfer authentication")
    send_frame(sock, {"ok": True, "mac": _mac(token, b"server", sn, cn)})


def client_handshake(sock: socket.socket, token: str) -> None:
    """Answer the server's challenge and check its proof (the socket's own timeouts bound
    each wait); raises TransferError with the server's reason when refused."""
    hello = recv_header(sock, MAX_AUTH_FRAME)
    sn = _nonce(hello)
    if sn is None:
        why = hello.get("error") if isinstance(hello, dict) else None
        raise TransferError(f"prefill engine refused the connection: {why or 'no challenge sent'}")
    cn = secrets.token_bytes(NONCE_BYTES)
    send_frame(sock, {"op": "auth", "nonce": cn, "mac": _mac(token, b"client", sn, cn)})
    reply = recv_header(sock, MAX_AUTH_FRAME)
    mac = reply.get("mac") if isinstance(reply, dict) else None
    if not isinstance(reply, dict) or not reply.get("ok"):
        why = reply.get("error") if isinstance(reply, dict) else None
        raise TransferError(f"prefill engine refused: {why or MISMATCH}")
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(token, b"server", sn, cn)):
        raise TransferError(f"{MISMATCH} (the server could not prove it holds the token)")
