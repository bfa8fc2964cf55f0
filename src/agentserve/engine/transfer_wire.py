"""KV transfer over TCP: framing, the pluggable `TransferBackend` protocol, the TCP backend.

Wire format (one request, one reply per connection round trip; connections are reused):

    frame  = u32 header_len | msgpack header | payload (header["nbytes"] raw bytes)
    pull   -> {"op": "pull", "token", "rid", "idx": [block index], "hashes": [bytes], "release"}
    reply  <- {"ok", "error", "nbytes", "shape": [2, L, n*bs, H, D], "dtype", "sum"} + payload

The payload is the contiguous host tensor of ``gather_blocks`` sent as one memoryview
(zero-copy on both ends: ``sendall`` from the tensor's buffer, ``recv_into`` straight into
the destination tensor). Many blocks travel in one message. ``sum`` is a 64-bit
wrap-around sum of the payload's words: TCP already checksums segments, this catches a
truncated or mis-framed payload at memory speed (zlib.crc32 runs at ~1 GB/s here and
would halve throughput). Content identity is checked separately by block hash.
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

log = logging.getLogger("agentserve.transfer")

_HDR = struct.Struct("!I")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_HEADER = 16 << 20


class TransferError(RuntimeError):
    """A pull failed (peer gone, refused, bad size/checksum); the caller recomputes."""


def payload_sum(buf: torch.Tensor) -> int:
    """Wrap-around 64-bit sum of the payload bytes viewed as int64 words (tail as bytes)."""
    raw = buf.reshape(-1).view(torch.uint8)
    n8 = raw.numel() // 8 * 8
    s = int(raw[:n8].view(torch.int64).sum()) if n8 else 0
    return (s + int(raw[n8:].sum())) & 0xFFFFFFFFFFFFFFFF


def send_frame(sock: socket.socket, header: dict[str, Any], payload: torch.Tensor | None = None) -> None:
    head = msgspec.msgpack.encode(header)
    sock.sendall(_HDR.pack(len(head)) + head)
    if payload is not None and payload.numel():
        sock.sendall(memoryview(payload.reshape(-1).view(torch.uint8).numpy()))


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_header(sock: socket.socket) -> dict[str, Any]:
    raw = bytearray(_HDR.size)
    _recv_exact(sock, memoryview(raw))
    (n,) = _HDR.unpack(raw)
    if n > MAX_HEADER:
        raise TransferError(f"header of {n} bytes exceeds the {MAX_HEADER} limit")
    head = bytearray(n)
    _recv_exact(sock, memoryview(head))
    return msgspec.msgpack.decode(head)


def recv_payload(sock: socket.socket, header: dict[str, Any]) -> torch.Tensor:
    """Receive the payload straight into a fresh tensor; check its size and sum."""
    dtype = DTYPES.get(header.get("dtype", ""))
    shape = header.get("shape") or []
    nbytes = int(header.get("nbytes", 0))
    if dtype is None:
        raise TransferError(f"unknown dtype {header.get('dtype')!r}")
    expect = dtype.itemsize
    for d in shape:
        expect *= d
    if expect != nbytes:
        raise TransferError(f"size mismatch: shape {shape} needs {expect} bytes, header says {nbytes}")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    _recv_exact(sock, memoryview(buf.numpy()))
    if payload_sum(buf) != header.get("sum"):
        raise TransferError("payload checksum mismatch")
    return buf.view(dtype).view(*shape)


@dataclass(slots=True)
class PullSpec:
    """Blocks ``idx`` of prefill request ``rid`` (with their expected hashes) at ``host:port``."""

    host: str
    port: int
    rid: str
    idx: list[int]
    hashes: list[bytes]
    release: bool = True


class BlockSource(Protocol):
    """The prefill side's pinned blocks, as the transfer server sees them (thread-safe)."""

    def checkout(self, rid: str, idx: list[int], hashes: list[bytes]) -> list[int]:
        """Device block ids for ``idx``; raises TransferError if unknown or hashes differ."""

    def checkin(self, rid: str, release: bool) -> None:
        """The server is done reading (after ``checkout``); ``release`` frees the pins."""

    def release(self, rid: str) -> None:
        """Free the pins without reading them (the decode side needs none of them)."""

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """Contiguous host copy [2, L, n*bs, H, D] of the device blocks."""


class TransferBackend(Protocol):
    """How KV bytes move between engines. TCP here; a NIXL backend would implement the same."""

    name: str

    def serve(self, source: BlockSource, host: str, port: int) -> int:
        """Start serving ``source``; returns the bound port."""

    def pull(self, spec: PullSpec) -> torch.Tensor:
        """Fetch the blocks as a host tensor [2, L, n*bs, H, D]; raises TransferError."""

    def release(self, host: str, port: int, rid: str) -> None:
        """Tell the prefill side to drop its pins for ``rid`` without reading them."""

    def close(self) -> None: ...


class TcpBackend:
    """Raw TCP, one thread per connection on the server, pooled connections on the client."""

    name = "tcp"

    def __init__(self, token: str = "", timeout: float = 30.0) -> None:
        self.token, self.timeout = token, timeout
        self._listener: socket.socket | None = None
        self._pool: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.on_sent: Callable[[int], None] = lambda n: None

    # ---- server -------------------------------------------------------------------------
    def serve(self, source: BlockSource, host: str, port: int) -> int:
        lst = socket.create_server((host, port), reuse_port=False)
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst, source), name="kv-xfer-accept",
                         daemon=True).start()
        return lst.getsockname()[1]

    def _accept(self, lst: socket.socket, source: BlockSource) -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle, args=(conn, source), name="kv-xfer-conn",
                             daemon=True).start()

    def _handle(self, conn: socket.socket, source: BlockSource) -> None:
        with conn:
            while True:
                try:
                    req = recv_header(conn)
                except (TransferError, OSError, msgspec.DecodeError):
                    return
                if not hmac.compare_digest(str(req.get("token", "")), self.token):
                    send_frame(conn, {"ok": False, "error": "bad kv-transfer token"})
                    return
                try:
                    self._reply(conn, req, source)
                except OSError:
                    return

    def _reply(self, conn: socket.socket, req: dict[str, Any], source: BlockSource) -> None:
        rid, op = str(req.get("rid", "")), req.get("op")
        if op == "release":
            source.release(rid)
            send_frame(conn, {"ok": True, "nbytes": 0})
            return
        try:
            ids = source.checkout(rid, list(req.get("idx", [])), list(req.get("hashes", [])))
        except TransferError as e:
            send_frame(conn, {"ok": False, "error": str(e)})
            return
        try:
            buf = source.gather(ids)
        finally:
            source.checkin(rid, bool(req.get("release", True)))
        dtype = next(k for k, v in DTYPES.items() if v == buf.dtype)
        send_frame(conn, {"ok": True, "nbytes": buf.numel() * buf.element_size(),
                          "shape": list(buf.shape), "dtype": dtype, "sum": payload_sum(buf)}, buf)
        self.on_sent(buf.numel() * buf.element_size())

    # ---- client -------------------------------------------------------------------------
    def _conn(self, host: str, port: int) -> socket.socket:
        with self._lock:
            free = self._pool.get((host, port))
            if free:
                return free.pop()
        s = socket.create_connection((host, port), timeout=self.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def _call(self, host: str, port: int, req: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        s = self._conn(host, port)
        try:
            send_frame(s, {**req, "token": self.token})
            head = recv_header(s)
            if not head.get("ok"):
                raise TransferError(f"prefill engine refused: {head.get('error')}")
            data = recv_payload(s, head) if head.get("nbytes") else None
        except BaseException:
            s.close()  # the stream may be mid-frame: never reuse it
            raise
        with self._lock:
            self._pool.setdefault((host, port), []).append(s)
        return head, data

    def pull(self, spec: PullSpec) -> torch.Tensor:
        try:
            _, data = self._call(spec.host, spec.port, {"op": "pull", "rid": spec.rid, "idx": spec.idx,
                                                        "hashes": spec.hashes, "release": spec.release})
        except OSError as e:
            raise TransferError(f"pull from {spec.host}:{spec.port} failed: {e!r}") from e
        if data is None:
            raise TransferError("prefill engine sent no payload")
        return data

    def release(self, host: str, port: int, rid: str) -> None:
        try:
            self._call(host, port, {"op": "release", "rid": rid})
        except (OSError, TransferError) as e:
            log.info("release of %s at %s:%d failed (its pins expire anyway): %r", rid, host, port, e)

    def close(self) -> None:
        if self._listener is not None:
            try:  # shutdown() wakes the accept() thread on Linux; close() alone may not
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            for conns in self._pool.values():
                for s in conns:
                    s.close()
            self._pool.clear()
