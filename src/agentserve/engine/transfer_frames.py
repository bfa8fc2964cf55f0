"""Wire-level pieces of the KV transfer: frames, payload pieces and their checksums.

A frame is ``u32 header_len | msgpack header``; a payload travels as pieces (contiguous
views of cache blocks, or a staging buffer), each chunk followed by a u64 wrap-around
sum of its bytes. See `agentserve.engine.transfer_wire` for the protocol built on them.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import msgspec
import numpy as np
import torch

from agentserve.kv.transfer import block_runs

_HDR = struct.Struct("!I")
SUM = struct.Struct("!Q")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_HEADER = 16 << 20
CHUNK_BLOCKS = 64
# Bytes per send/recv syscall group and checksum pass: about L2, so the sum reads hot bytes.
PIECE_BYTES = int(os.environ.get("AGENTSERVE_KV_PIECE_BYTES") or 1 << 20)
_MAX_IOV = 512
MASK = 0xFFFFFFFFFFFFFFFF


class TransferError(RuntimeError):
    """A pull failed (peer gone, refused, bad size/checksum); the caller recomputes."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def payload_sum(buf: torch.Tensor) -> int:
    """Wrap-around 64-bit sum of a contiguous tensor's bytes as int64 words (tail as bytes)."""
    raw = as_bytes(buf)
    n8 = raw.numel() // 8 * 8
    s = int(raw[:n8].view(torch.int64).sum()) if n8 else 0
    return (s + int(raw[n8:].sum())) & MASK


def _piece_sum(x: np.ndarray) -> int:
    """Wrap-around sum of a byte piece as u64 words (tail as bytes); additive over pieces
    whose lengths are multiples of 8, so both ends agree however they cut the stream."""
    n8 = x.size // 8 * 8
    s = int(np.add.reduce(x[:n8].view(np.uint64))) if n8 else 0
    return s + (int(x[n8:].sum()) if n8 < x.size else 0)


def _cache_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU cache [L, NB, bs, H, D] as a numpy byte array [L, NB, unit] (no copy)."""
    return t.view(torch.uint8).numpy().reshape(t.shape[0], t.shape[1], -1)


def _split(x: np.ndarray, unit: int) -> list[np.ndarray]:
    """Cut a run of whole units into pieces of about PIECE_BYTES (a unit each if unit % 8)."""
    step = unit if unit % 8 else max(unit, PIECE_BYTES // unit * unit)
    return [x[i:i + step] for i in range(0, x.size, step)]


def cache_pieces(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> list[np.ndarray]:
    """The wire bytes of ``block_ids`` as pieces of the cache itself (``gather_blocks``
    order: k then v, layer by layer, runs of consecutive blocks). Zero-copy: the pieces
    share the cache's memory, so they are sent from / received into directly."""
    out: list[np.ndarray] = []
    runs = block_runs(block_ids)
    for a in (_cache_bytes(k), _cache_bytes(v)):
        unit = a.shape[2]
        for layer in range(a.shape[0]):
            for start, length in runs:
                out += _split(a[layer, start:start + length].reshape(-1), unit)
    return out


def iov_groups(pieces: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Consecutive pieces in groups of about PIECE_BYTES: one sendmsg/recvmsg_into each."""
    out: list[list[np.ndarray]] = []
    size = PIECE_BYTES
    for x in pieces:
        if size + x.size > PIECE_BYTES or len(out[-1]) >= _MAX_IOV:
            out.append([])
            size = 0
        out[-1].append(x)
        size += x.size
    return out


def _advance(bufs: list[memoryview], i: int, off: int, n: int) -> tuple[int, int]:
    while n:
        rem = len(bufs[i]) - off
        if n < rem:
            return i, off + n
        n -= rem
        i, off = i + 1, 0
    return i, off


def send_pieces(sock: socket.socket, pieces: list[np.ndarray], checksum: bool = True) -> int:
    """sendmsg the pieces (partial sends resumed); returns their checksum."""
    bufs = [memoryview(x) for x in pieces]
    i = off = 0
    while i < len(bufs):
        n = sock.sendmsg([bufs[i][off:], *bufs[i + 1:i + _MAX_IOV]])
        i, off = _advance(bufs, i, off, n)
    return sum(_piece_sum(x) for x in pieces) if checksum else 0  # just read: hot in cache


def recv_pieces(sock: socket.socket, pieces: list[np.ndarray], checksum: bool = True) -> int:
    """recvmsg_into the pieces until all are full; returns their checksum."""
    bufs = [memoryview(x) for x in pieces]
    i = off = 0
    while i < len(bufs):
        n = sock.recvmsg_into([bufs[i][off:], *bufs[i + 1:i + _MAX_IOV]])[0]
        if n == 0:
            raise TransferError(f"peer closed the connection mid-payload (piece {i} of {len(bufs)})")
        i, off = _advance(bufs, i, off, n)
    return sum(_piece_sum(x) for x in pieces) if checksum else 0  # just written: hot


def staged_sum(buf: torch.Tensor, unit: int) -> int:
    return sum(_piece_sum(x) for x in _split(as_bytes(buf).numpy(), unit)) & MASK


def send_frame(sock: socket.socket, header: dict[str, Any], payload: torch.Tensor | None = None) -> None:
    head = msgspec.msgpack.encode(header)
    sock.sendall(_HDR.pack(len(head)) + head)
    if payload is not None and payload.numel():
        sock.sendall(memoryview(as_bytes(payload).numpy()))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_header(sock: socket.socket) -> dict[str, Any]:
    raw = bytearray(_HDR.size)
    recv_exact(sock, memoryview(raw))
    (n,) = _HDR.unpack(raw)
    if n > MAX_HEADER:
        raise TransferError(f"header of {n} bytes exceeds the {MAX_HEADER} limit")
    head = bytearray(n)
    recv_exact(sock, memoryview(head))
    return msgspec.msgpack.decode(head)


def recv_sum(sock: socket.socket) -> int:
    raw = bytearray(SUM.size)
    recv_exact(sock, memoryview(raw))
    return SUM.unpack(raw)[0]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def block_shape(k: torch.Tensor) -> list[int]:
    """[2, L, bs, H, D]: one block's bytes on the wire (k and v of every layer)."""
    L, _, bs, H, D = k.shape
    return [2, L, bs, H, D]


def chunked(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]
