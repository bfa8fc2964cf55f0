"""The serving half of `wire.TcpBackend`: the prefill side's transfer server (`TcpServer`,
which a backend starts when it serves).

One thread per connection, at most ``max_conns`` (more are refused at once); a connection
first proves it holds the token (`auth`: challenge-response, within
``auth_timeout``), then each request is a pull (check the blocks out of the
`BlockSource`, send them chunk by chunk, each chunk followed by its checksum trailer, check
them back in) or a release, and a connection idle for ``idle_timeout`` between requests is
closed. Wire format and checksums: see `wire`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from agentserve.kv.remote.backend import BlockSource
from agentserve.kv.remote.auth import refuse, server_handshake
from agentserve.kv.remote.frames import (
    MASK,
    SUM,
    TransferError,
    as_bytes,
    block_shape,
    cache_spans,
    chunked,
    dtype_name,
    recv_header,
    send_frame,
    send_spans,
    sendmsg_all,
    set_io_timeout,
    span_groups,
    span_views,
    staged_sum,
)
from agentserve.kv.offload.copy import StagingBuffer, gather_blocks

log = logging.getLogger("agentserve.transfer")


def use_staging(staged: bool | None, k: torch.Tensor) -> bool:
    """Whether blocks of cache ``k`` go through a staging buffer (both sides): ``staged``
    if set, else for CUDA or non-contiguous caches."""
    if staged is not None:
        return staged
    return k.device.type != "cpu" or not k.is_contiguous()


class TcpServer:
    """Serves ``source`` to pulling engines: an accept thread, one thread per connection.

    ``copy_pool`` gives the copy thread the staged path gathers chunks on (the backend's,
    shared with its receiving side); ``on_sent`` is told the bytes of each pull sent."""

    def __init__(self, source: BlockSource, token: str, timeout: float, auth_timeout: float,
                 idle_timeout: float, max_conns: int, chunk_blocks: int, staged: bool | None,
                 copy_pool: Callable[[], ThreadPoolExecutor],
                 on_sent: Callable[[int], None]) -> None:
        self.source, self.token, self.timeout = source, token, timeout
        self.auth_timeout, self.idle_timeout, self.max_conns = auth_timeout, idle_timeout, max_conns
        self.chunk_blocks, self.staged = chunk_blocks, staged
        self._copy_pool, self.on_sent = copy_pool, on_sent
        self._conns = 0  # connections open (authenticating or authenticated)
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` and accept in a thread; returns the bound port."""
        lst = socket.create_server((host, port), reuse_port=False)
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst, self.source), name="kv-xfer-accept",
                         daemon=True).start()
        return lst.getsockname()[1]

    def close(self) -> None:
        """Stop accepting (connections being served end on their own timeouts)."""
        if self._listener is not None:
            try:  # shutdown() wakes the accept() thread on Linux; close() alone may not
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()

    def _accept(self, lst: socket.socket, source: BlockSource) -> None:
        while True:
            try:
                conn, peer = lst.accept()
            except OSError:
                return  # closed
            with self._lock:
                busy = self._conns >= self.max_conns
                self._conns += 0 if busy else 1
            if busy:  # refused at once, from this thread: the cap bounds the threads
                set_io_timeout(conn, 1.0)
                refuse(conn, f"the prefill engine has {self.max_conns} kv transfer connections "
                             "open, its limit; retry")
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # until it authenticates: auth_timeout for each wait (and a deadline for all)
            set_io_timeout(conn, self.auth_timeout)
            threading.Thread(target=self._handle, args=(conn, peer, source), name="kv-xfer-conn",
                             daemon=True).start()

    def _handle(self, conn: socket.socket, peer: Any, source: BlockSource) -> None:
        try:
            with conn:
                try:
                    server_handshake(conn, self.token, time.monotonic() + self.auth_timeout)
                except (TransferError, OSError, msgspec.DecodeError) as e:
                    log.info("kv transfer connection from %s closed before it authenticated: %r",
                             peer, e)
                    return
                # sends: a reader that stalls frees its pins; receives: an idle connection
                # (no request within idle_timeout) is closed, the client opens a new one
                set_io_timeout(conn, self.timeout, recv_seconds=self.idle_timeout)
                self._serve_requests(conn, source)
        finally:
            with self._lock:
                self._conns -= 1

    def _serve_requests(self, conn: socket.socket, source: BlockSource) -> None:
        pin = source.k.is_cuda
        stages = (StagingBuffer(pin), StagingBuffer(pin))  # this connection's, reused per pull
        while True:
            try:
                req = recv_header(conn)
            except (TransferError, OSError, msgspec.DecodeError):
                return  # closed, idle past idle_timeout, or garbled
            if not isinstance(req, dict):
                send_frame(conn, {"ok": False, "error": "malformed request: not a map"})
                return
            try:
                self._reply(conn, req, source, stages)
            except (OSError, TransferError) as e:
                log.info("kv transfer connection dropped mid-reply: %r", e)
                return

    def _reply(self, conn: socket.socket, req: dict[str, Any], source: BlockSource,
               stages: tuple[StagingBuffer, StagingBuffer]) -> None:
        rid, op = str(req.get("rid", "")), req.get("op")
        idx, hashes = req.get("idx", []), req.get("hashes", [])
        if not (isinstance(idx, list) and all(type(i) is int for i in idx)
                and isinstance(hashes, list) and isinstance(req.get("chunk_blocks") or 0, int)):
            send_frame(conn, {"ok": False, "error": "malformed request: idx must be a list of "
                              "block indexes, hashes a list, chunk_blocks an integer"})
            return
        if op == "release":
            source.release(rid)
            send_frame(conn, {"ok": True, "nbytes": 0})
            return
        try:
            ids = source.checkout(rid, idx, hashes)
        except TransferError as e:
            send_frame(conn, {"ok": False, "error": str(e)})
            return
        if any(not 0 <= b < source.k.shape[1] for b in ids):  # a source bug: never send garbage
            source.checkin(rid, False)
            send_frame(conn, {"ok": False, "error": "block id out of range"})
            return
        try:
            k, v = source.k, source.v
            shape = block_shape(k)
            bb = k.element_size()
            for d in shape:
                bb *= d
            cb = max(1, min(int(req.get("chunk_blocks") or self.chunk_blocks), 1 << 16))
            check = bool(req.get("checksum", True))
            send_frame(conn, {"ok": True, "n": len(ids), "nbytes": len(ids) * bb,
                              "block_shape": shape, "dtype": dtype_name(k.dtype), "chunk_blocks": cb})
            sums = self._pinned_sums(source, rid, req, len(ids)) if check else None
            chunks = chunked(ids, cb)
            if use_staging(self.staged, k):
                self._send_staged(conn, k, v, chunks, stages, check, sums)
            else:
                for j, chunk in enumerate(chunks):  # zero-copy: straight from the pinned blocks
                    if check and sums is None:  # sum each group right after sending it (warm)
                        s = sum(send_spans(conn, g) for g in span_groups(cache_spans(k, v, chunk)))
                        conn.sendall(SUM.pack(s & MASK))
                        continue
                    s = sum(sums[j * cb:j * cb + len(chunk)]) if sums is not None else 0
                    bufs = span_views(cache_spans(k, v, chunk, 1 << 62))
                    sendmsg_all(conn, [*bufs, memoryview(SUM.pack(s & MASK))])  # few large calls
        finally:
            source.checkin(rid, bool(req.get("release", True)))
        self.on_sent(len(ids) * bb)

    @staticmethod
    def _pinned_sums(source: BlockSource, rid: str, req: dict[str, Any], n: int) -> list[int] | None:
        get = getattr(source, "pinned_sums", None)
        sums = get(rid, list(req.get("idx", []))) if get is not None else None
        return list(sums) if sums is not None and len(sums) == n else None

    def _send_staged(self, conn: socket.socket, k: torch.Tensor, v: torch.Tensor,
                     chunks: list[list[int]], stages: tuple[StagingBuffer, StagingBuffer],
                     check: bool, sums: list[int] | None = None) -> None:
        """Gather chunk j+1 into the other staging buffer while chunk j is being sent."""
        L, _, bs, H, D = k.shape
        unit = bs * H * D * k.element_size()
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c))

        def gather(j: int) -> tuple[torch.Tensor, int]:
            out = stages[j % 2].get(len(chunks[j]) * bs * L * H * D * 2 * k.element_size(),
                                    k.dtype, (2, L, len(chunks[j]) * bs, H, D))
            gather_blocks(k, v, chunks[j], out=out)
            if not check:
                return out, 0
            if sums is not None:
                return out, sum(sums[starts[j]:starts[j + 1]]) & MASK
            return out, staged_sum(out, unit)

        pool = self._copy_pool()
        fut = pool.submit(gather, 0)
        try:
            for j in range(len(chunks)):
                buf, s = fut.result()
                if j + 1 < len(chunks):
                    fut = pool.submit(gather, j + 1)
                conn.sendall(memoryview(as_bytes(buf).numpy()))
                conn.sendall(SUM.pack(s))
        finally:
            fut.result()  # never leave a gather writing into a buffer the next pull reuses
