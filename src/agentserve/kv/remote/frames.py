"""Wire-level pieces of the KV transfer: frames, payload pieces and their checksums.

A frame is ``u32 header_len | msgpack header``; a payload travels as spans of the cache
(one per layer and run of consecutive blocks) or a staging buffer, each chunk followed by
a u64 wrap-around sum of its bytes (``block_sums`` precomputes it per block for pinned
prefills). See `agentserve.kv.remote.wire` for the protocol built on them.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

import msgspec
import numpy as np
import torch

from agentserve.kv.offload.copy import block_runs

_HDR = struct.Struct("!I")
SUM = struct.Struct("!Q")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_HEADER = 16 << 20
CHUNK_BLOCKS = 64
# Bytes per sendmsg and sum when the sender sums as it sends (no pinned sums): about L2,
# so the sum reads bytes the send just read.
PIECE_BYTES = int(os.environ.get("AGENTSERVE_KV_PIECE_BYTES") or 1 << 20)
# Bytes per recvmsg_into on the zero-copy receive path; each group's sum then runs on a
# helper thread while the next group arrives (after the kernel's copy the bytes are not
# in cache anyway: ~15-20 GB/s either way; fewer, larger calls mean fewer wake-ups).
RECV_GROUP_BYTES = int(os.environ.get("AGENTSERVE_KV_RECV_GROUP_BYTES") or 4 << 20)
# Fewest bytes per summing call on the receive path (a numpy call costs ~2 us).
SUM_CALL_BYTES = 256 << 10
_MAX_IOV = 512
WAITALL = getattr(socket, "MSG_WAITALL", 0)
MASK = 0xFFFFFFFFFFFFFFFF
SUM_BLOCKS = 64  # blocks per device-side block_sums pass


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


class Flat:
    """A contiguous CPU cache [L, NB, bs, H, D] as flat bytes: a memoryview for the socket
    (slicing one is far cheaper than exporting a numpy slice: a fragmented chunk has a
    piece per layer and block) and numpy arrays (u8, and u64 when whole) for the sums."""

    __slots__ = ("L", "NB", "mv", "u8", "u64", "unit")

    def __init__(self, t: torch.Tensor) -> None:
        self.u8 = t.view(torch.uint8).numpy().reshape(-1)
        self.mv = memoryview(self.u8)
        self.u64 = self.u8.view(np.uint64) if self.u8.size % 8 == 0 else None
        self.L, self.NB = t.shape[0], t.shape[1]
        self.unit = self.u8.size // (self.L * self.NB)


Span = tuple[Flat, int, int]  # (cache, byte offset, byte length)


def cache_spans(k: torch.Tensor, v: torch.Tensor, block_ids: list[int], limit: int = 0,
                flats: tuple[Flat, Flat] | None = None) -> list[Span]:
    """The wire bytes of ``block_ids`` as spans of the cache itself (``gather_blocks``
    order: k then v, layer by layer, runs of consecutive blocks), runs longer than
    ``limit`` bytes (default PIECE_BYTES) cut in whole units, and in single units when
    unit % 8 (both ends then sum unit by unit). Zero-copy: they are sent from / received
    into directly."""
    limit = limit or PIECE_BYTES
    out: list[Span] = []
    runs = block_runs(block_ids)
    for f in flats or (Flat(k), Flat(v)):
        unit = f.unit
        step = unit if unit % 8 else max(unit, limit // unit * unit)
        spans = []
        for start, length in runs:
            off, n = start * unit, length * unit
            spans += [(off + i, min(step, n - i)) for i in range(0, n, step)] if n > step else [(off, n)]
        for layer in range(f.L):
            base = layer * f.NB * unit
            out += [(f, base + off, n) for off, n in spans]
    return out


def layers_sum(f: Flat, l0: int, l1: int, runs: list[tuple[int, int]]) -> int:
    """Sum (not masked) of layers [l0, l1) of the blocks in ``runs``, for a cache whose
    units are whole u64 words: one strided reduction per run, however many layers."""
    w = f.unit // 8
    a = f.u64.reshape(f.L, -1)
    return sum(int(np.add.reduce(a[l0:l1, s * w:(s + n) * w], axis=None)) for s, n in runs)


def span_views(spans: list[Span]) -> list[memoryview]:
    return [f.mv[off:off + n] for f, off, n in spans]


def span_groups(spans: list[Span], limit: int = 0) -> list[list[Span]]:
    """Consecutive spans in groups of about ``limit`` bytes (default PIECE_BYTES) and at
    most _MAX_IOV spans: one sendmsg / recvmsg_into each."""
    limit = limit or PIECE_BYTES
    out: list[list[Span]] = []
    size = limit
    for sp in spans:
        if size + sp[2] > limit or len(out[-1]) >= _MAX_IOV:
            out.append([])
            size = 0
        out[-1].append(sp)
        size += sp[2]
    return out


def spans_sum(spans: list[Span]) -> int:
    """Wrap-around sum of the spans' bytes as u64 words (not masked): ``_piece_sum`` each."""
    s = 0
    for f, off, n in spans:
        if f.u64 is not None and not (off | n) & 7:
            s += int(np.add.reduce(f.u64[off >> 3:(off + n) >> 3]))
        else:
            s += _piece_sum(f.u8[off:off + n])
    return s


def _split(x: np.ndarray, unit: int) -> list[np.ndarray]:
    """Cut a run of whole units into pieces of about PIECE_BYTES (a unit each if unit % 8)."""
    step = unit if unit % 8 else max(unit, PIECE_BYTES // unit * unit)
    return [x[i:i + step] for i in range(0, x.size, step)]


def block_sums(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> list[int]:
    """Per-block wrap-around sums of the wire bytes of ``block_ids`` (k and v, every layer).

    A chunk's trailer is the sum of its blocks' sums (mod 2**64), however either end cuts
    it into pieces: a pinned prefill's sums can be computed once, off the pull's critical
    path, and the sender then only sends. CPU caches are summed with numpy (no copy), other
    devices on the device, SUM_BLOCKS blocks at a time (bounded temporary memory)."""
    if not block_ids:
        return []
    if k.device.type == "cpu" and k.is_contiguous() and v.is_contiguous():
        return _block_sums_numpy(k, v, block_ids)
    return [s for part in chunked(block_ids, SUM_BLOCKS) for s in _block_sums_torch(k, v, part)]


def _block_sums_numpy(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> list[int]:
    acc = np.zeros(len(block_ids), np.uint64)  # uint64 array arithmetic wraps silently
    for a in (_cache_bytes(k), _cache_bytes(v)):
        pos = 0
        for start, length in block_runs(block_ids):
            x = a[:, start:start + length]  # [L, n, unit], each unit contiguous
            if x.shape[2] % 8 == 0:
                for layer in range(x.shape[0]):
                    acc[pos:pos + length] += np.add.reduce(x[layer].view(np.uint64), axis=1)
            else:  # odd units travel as pieces of one unit each: sum them that way
                acc[pos:pos + length] += np.array(
                    [sum(_piece_sum(x[layer, j]) for layer in range(x.shape[0])) & MASK
                     for j in range(length)], np.uint64)
            pos += length
    return [int(s) for s in acc]


@torch.inference_mode()
def _block_sums_torch(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> list[int]:
    idx = torch.tensor(block_ids, device=k.device)
    out = [0] * len(block_ids)
    for t in (k, v):
        x = t.index_select(1, idx)  # [L, n, bs, H, D], contiguous
        x = x.view(torch.uint8).reshape(x.shape[0], x.shape[1], -1)
        if x.shape[2] % 8:
            sums = [sum(_piece_sum(u) for u in row) for row in x.cpu().numpy().transpose(1, 0, 2)]
        else:  # int64 sums wrap like u64 ones; masked below
            sums = x.view(torch.int64).sum(dim=(0, 2)).tolist()
        out = [a + b for a, b in zip(out, sums)]
    return [s & MASK for s in out]


def _advance(bufs: list[memoryview], i: int, off: int, n: int) -> tuple[int, int]:
    while n:
        rem = len(bufs[i]) - off
        if n < rem:
            return i, off + n
        n -= rem
        i, off = i + 1, 0
    return i, off


def sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """sendmsg every buffer, _MAX_IOV at a time, resuming partial sends."""
    bufs = [b for b in bufs if len(b)]  # every call then makes progress or raises
    i = off = 0
    while i < len(bufs):
        n = sock.sendmsg([bufs[i][off:], *bufs[i + 1:i + _MAX_IOV]])
        i, off = _advance(bufs, i, off, n)


def send_spans(sock: socket.socket, spans: list[Span], checksum: bool = True) -> int:
    """sendmsg the spans (partial sends resumed); returns their sum (0 without)."""
    sendmsg_all(sock, span_views(spans))
    return spans_sum(spans) if checksum else 0  # just read: warm in cache


def recv_into_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """recvmsg_into the buffers until all are full (MSG_WAITALL on a blocking socket: one
    call per _MAX_IOV buffers unless a signal or the socket's timeout cuts it short)."""
    bufs = [b for b in bufs if len(b)]  # 0 bytes read then always means: peer closed
    i = off = 0
    while i < len(bufs):
        n = sock.recvmsg_into([bufs[i][off:], *bufs[i + 1:i + _MAX_IOV]], 0, WAITALL)[0]
        if n == 0:
            raise TransferError(f"peer closed the connection mid-payload (piece {i} of {len(bufs)})")
        i, off = _advance(bufs, i, off, n)


def staged_sum(buf: torch.Tensor, unit: int) -> int:
    return sum(_piece_sum(x) for x in _split(as_bytes(buf).numpy(), unit)) & MASK


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def set_io_timeout(sock: socket.socket, seconds: float, recv: bool = True,
                   recv_seconds: float | None = None) -> None:
    """Blocking socket whose send (and recv) calls fail after ``seconds`` without progress
    (recv: ``recv_seconds`` when given, e.g. a server's idle timeout between requests).

    Kernel timeouts (SO_SNDTIMEO/SO_RCVTIMEO) instead of Python's: a blocking socket sends
    a whole iovec in one sendmsg and fills one in one recvmsg_into (MSG_WAITALL), where a
    Python timeout makes the socket non-blocking: a poll and a partial call per segment."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
    if recv or recv_seconds is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        _timeval(seconds if recv_seconds is None else recv_seconds))


def send_frame(sock: socket.socket, header: dict[str, Any], payload: torch.Tensor | None = None) -> None:
    head = msgspec.msgpack.encode(header)
    sock.sendall(_HDR.pack(len(head)) + head)
    if payload is not None and payload.numel():
        sock.sendall(memoryview(as_bytes(payload).numpy()))


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; with ``deadline`` (time.monotonic) also fail once it has passed, so
    that a peer dripping a byte per socket timeout cannot hold the reader forever."""
    got = 0
    while got < len(view):
        if deadline is not None and time.monotonic() > deadline:
            raise TransferError(f"timed out after {got} of {len(view)} bytes")
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_header(sock: socket.socket, limit: int = MAX_HEADER,
                deadline: float | None = None) -> dict[str, Any]:
    """One frame's msgpack header (at most ``limit`` bytes: an unauthenticated peer gets a
    small one)."""
    raw = bytearray(_HDR.size)
    recv_exact(sock, memoryview(raw), deadline)
    (n,) = _HDR.unpack(raw)
    if n > limit:
        raise TransferError(f"header of {n} bytes exceeds the {limit} limit")
    head = bytearray(n)
    recv_exact(sock, memoryview(head), deadline)
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
