"""KV transfer over TCP: the TCP implementation of `transfer_api.TransferBackend`
(frames and payload pieces live in `transfer_frames`).

Wire format (one request, one reply per round trip; connections are pooled and reused):

    frame  = u32 header_len | msgpack header
    first, once per connection: the challenge-response of `auth` (no secret sent)
    pull   -> {"op": "pull", "rid", "idx": [block index], "hashes": [bytes], "release",
               "chunk_blocks", "checksum"}
    reply  <- {"ok", "error", "n", "nbytes", "block_shape": [2, L, bs, H, D], "dtype",
               "chunk_blocks"}
              then per chunk of up to chunk_blocks blocks: its bytes in ``gather_blocks``
              layout [2, L, nc*bs, H, D], then a u64 wrap-around sum of those bytes.

Many blocks travel in one reply, cut in chunks (default 64 blocks) so that the two ends
work as a pipeline instead of one big copy after another:

* CPU caches (zero-copy): the prefill side sends straight from the pinned cache blocks
  (``cache_spans``: one span per layer and run of consecutive blocks; a chunk and its
  trailer in as few ``sendmsg`` calls as the iovec limit allows) and the decode side
  receives straight into its freshly allocated destination blocks (``recvmsg_into`` with
  MSG_WAITALL, RECV_GROUP_BYTES per call). No gather, no scatter, no staging buffer. A
  failed or mismatched pull frees those blocks uncached (the scheduler recomputes), so
  writing before the check is safe.
* Other devices (staged): chunk j+1 is gathered into a reused (pinned) staging buffer on
  a helper thread while chunk j is on the wire; the receiver reuses two staging buffers
  per pulling thread and scatters chunk j on the helper thread while chunk j+1 arrives.

Checksums: the trailer of a chunk is the 64-bit wrap-around sum of its bytes as u64 words
(``_piece_sum``; additive, so either end may cut the stream as it likes). It catches a
truncated, mis-framed or corrupted payload at memory speed (zlib.crc32 runs at ~1 GB/s
here); TCP checksums segments, and content identity is checked separately by block hash.
The prefill side does not sum during a pull: the blocks of a finished prefill are
immutable while pinned, so `RemoteKV.pin` has their per-block sums (``block_sums``)
computed once on its kv-pin-sum thread, and the server adds those up (``pinned_sums``);
a pull that arrives before they are ready sums the bytes as it sends them. The decode
side always sums every byte it receives, on the kv-xfer-sum thread while the next bytes
arrive, and compares each chunk with its trailer: a wrong precomputed sum or a pinned
block changed after its sums fails the pull like a corrupted payload does.

Every socket wait is bounded: blocking sockets with kernel timeouts (``set_io_timeout``):
a peer that stops sending fails the pull; a puller that stops reading makes the server's
send fail, which checks its pins back in. The server closes a connection that does not
authenticate within ``auth_timeout`` or sits idle for ``idle_timeout``, and refuses more
than ``max_conns`` at once. The client reuses a pooled connection only while it is younger
than POOL_IDLE_S of idleness (below the server's idle timeout), and retries a request once
on a fresh connection when a reused one turns out closed before any reply came. With
``peers`` it connects only to those ``(host, port)``, for pulls and releases alike.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import msgspec
import torch

from agentserve.kv.remote.backend import BlockSource, PullSpec
from agentserve.kv.remote.auth import client_handshake
from agentserve.kv.remote.frames import (
    CHUNK_BLOCKS,
    MASK,
    RECV_GROUP_BYTES,
    SUM_CALL_BYTES,
    Flat,
    TransferError,
    as_bytes,
    block_shape,
    cache_spans,
    chunked,
    dtype_name,
    layers_sum,
    recv_exact,
    recv_header,
    recv_into_all,
    recv_sum,
    send_frame,
    set_io_timeout,
    span_groups,
    span_views,
    spans_sum,
    staged_sum,
)
from agentserve.api.kv_transfer import peer_key
from agentserve.kv.remote.server import TcpServer, use_staging
from agentserve.kv.offload.copy import (
    StagingBuffer,
    block_runs,
    scatter_blocks,
)

log = logging.getLogger("agentserve.transfer")

AUTH_TIMEOUT_S = 5.0  # a new connection must authenticate within this
IDLE_TIMEOUT_S = 60.0  # the server closes a connection idle this long between requests
POOL_IDLE_S = 30.0  # the client drops pooled connections idle longer (< IDLE_TIMEOUT_S)
MAX_CONNS = 64  # concurrent transfer connections a server accepts


class TcpBackend:
    """Raw TCP, one thread per connection on the server (`server.TcpServer`, started by
    ``serve``), pooled connections on the client (here).

    ``staged``: None picks zero-copy for CPU caches and staging otherwise; True forces
    staging (tests run the staged path on CPU). ``checksum`` (the puller's choice, sent
    with each pull): per-chunk sums; off, the trailer is 0 and nothing is summed (TCP's
    own checksums and the size checks remain). ``timeout``: seconds any socket call may
    wait without progress (connect, send, receive). ``token``: the shared secret both ends
    prove they hold (`auth`); ``peers``: the only ``(host, port)`` this client
    connects to (None: any; see `api.kv_transfer.peer_key`)."""

    name = "tcp"

    def __init__(self, token: str = "", timeout: float = 30.0, chunk_blocks: int = CHUNK_BLOCKS,
                 staged: bool | None = None, checksum: bool = True,
                 auth_timeout: float = AUTH_TIMEOUT_S, idle_timeout: float = IDLE_TIMEOUT_S,
                 max_conns: int = MAX_CONNS,
                 peers: frozenset[tuple[str, int]] | None = None) -> None:
        self.token, self.timeout = token, timeout
        self.chunk_blocks, self.staged = max(1, chunk_blocks), staged
        self.checksum = checksum
        self.auth_timeout, self.idle_timeout = auth_timeout, idle_timeout
        self.max_conns, self.peers = max(1, max_conns), peers
        self._server: TcpServer | None = None
        self._pool: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # per pulling thread: its two receive staging buffers
        self._copier: ThreadPoolExecutor | None = None
        self._summer: ThreadPoolExecutor | None = None
        self.on_sent: Callable[[int], None] = lambda n: None

    def _sum_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._summer is None:
                self._summer = ThreadPoolExecutor(1, thread_name_prefix="kv-xfer-sum")
            return self._summer

    def _copy_pool(self) -> ThreadPoolExecutor:
        """The copy thread both sides' staged paths use (started on first use)."""
        with self._lock:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-xfer-copy")
            return self._copier

    # ---- server -------------------------------------------------------------------------
    def serve(self, source: BlockSource, host: str, port: int) -> int:
        self._server = TcpServer(source, self.token, self.timeout, self.auth_timeout,
                                 self.idle_timeout, self.max_conns, self.chunk_blocks,
                                 self.staged, self._copy_pool, lambda n: self.on_sent(n))
        return self._server.start(host, port)

    # ---- client -------------------------------------------------------------------------
    def _conn(self, host: str, port: int) -> tuple[socket.socket, bool]:
        """A connection to ``host:port`` (pooled if one is fresh, else new and
        authenticated), and whether it was reused."""
        now = time.monotonic()
        with self._lock:
            free = self._pool.get((host, port), [])
            while free:
                s, used = free.pop()
                if now - used < POOL_IDLE_S:
                    return s, True
                s.close()  # the server may have closed it as idle
        if self.peers is not None and peer_key(host, port) not in self.peers:
            raise TransferError(f"{host}:{port} is not one of this engine's --kv-transfer-peers")
        s = socket.create_connection((host, port), timeout=self.timeout)
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_io_timeout(s, self.timeout)  # blocking: MSG_WAITALL fills a group in one call
            client_handshake(s, self.token)
        except BaseException:
            s.close()
            raise
        return s, False

    def _call(self, host: str, port: int, req: dict[str, Any],
              body: Callable[[socket.socket, dict[str, Any]], Any] | None = None) -> Any:
        """One round trip on a pooled connection; ``body`` reads the reply's payload."""
        for attempt in range(2):
            s, reused = self._conn(host, port)
            try:
                send_frame(s, req)
                head = recv_header(s)
            except (OSError, TransferError):
                s.close()
                if reused and attempt == 0:
                    continue  # closed while pooled (idle timeout, restart): once more, fresh
                raise
            break
        try:
            if not head.get("ok"):
                raise TransferError(f"prefill engine refused: {head.get('error')}")
            out = body(s, head) if body is not None else head
        except BaseException:
            s.close()  # the stream may be mid-frame: never reuse it
            raise
        with self._lock:
            self._pool.setdefault((host, port), []).append((s, time.monotonic()))
        return out

    def pull_into(self, spec: PullSpec, k: torch.Tensor, v: torch.Tensor,
                  block_ids: list[int]) -> int:
        if len(block_ids) != len(spec.idx):
            raise TransferError(f"{len(spec.idx)} remote blocks for {len(block_ids)} local ones")

        check = self.checksum

        def body(s: socket.socket, head: dict[str, Any]) -> int:
            shape, want = head.get("block_shape"), block_shape(k)
            if (shape != want or head.get("dtype") != dtype_name(k.dtype)
                    or head.get("n") != len(block_ids)):
                raise TransferError(f"size mismatch: got {head.get('n')} blocks of {shape} "
                                    f"{head.get('dtype')}, want {len(block_ids)} of {want} "
                                    f"{dtype_name(k.dtype)}")
            chunks = chunked(block_ids, max(1, int(head.get("chunk_blocks") or 1)))
            if use_staging(self.staged, k):
                self._recv_staged(s, k, v, chunks, check)
            else:
                self._recv_zero_copy(s, k, v, chunks, check)
            return int(head["nbytes"])

        try:
            return self._call(spec.host, spec.port, {
                "op": "pull", "rid": spec.rid, "idx": spec.idx, "hashes": spec.hashes,
                "release": spec.release, "chunk_blocks": self.chunk_blocks, "checksum": check}, body)
        except (OSError, msgspec.DecodeError) as e:
            raise TransferError(f"pull from {spec.host}:{spec.port} failed: {e!r}") from e

    def _recv_zero_copy(self, s: socket.socket, k: torch.Tensor, v: torch.Tensor,
                        chunks: list[list[int]], check: bool) -> None:
        """Straight into the destination blocks, RECV_GROUP_BYTES per call. The bytes are
        summed on the kv-xfer-sum thread while the next ones arrive (numpy and the socket
        both release the GIL), a few whole layers at a time (one strided reduction per run
        of blocks: a fragmented chunk costs few calls), and each chunk's total is checked
        against its trailer."""
        pool = self._sum_pool() if check else None
        flats = (Flat(k), Flat(v))
        L = k.shape[0]
        by_layers = all(f.u64 is not None and f.unit % 8 == 0 for f in flats)
        inflight: list[Future] = []
        pending: list[tuple[list[Future], int]] = []  # per chunk: its sums, its trailer
        try:
            for chunk in chunks:
                runs = block_runs(chunk)
                layer_bytes = len(chunk) * flats[0].unit
                # layers per sum task: >= RECV_GROUP_BYTES and >= SUM_CALL_BYTES per call
                per_task = -(-max(RECV_GROUP_BYTES, len(runs) * SUM_CALL_BYTES) // layer_bytes)
                parts: list[Future] = []
                got = done = 0  # bytes received; layers (of 2L: k's then v's) submitted
                spans = cache_spans(k, v, chunk, RECV_GROUP_BYTES, flats)
                for g in span_groups(spans, RECV_GROUP_BYTES):
                    recv_into_all(s, span_views(g))
                    if pool is None:
                        continue
                    if not by_layers:
                        parts.append(pool.submit(spans_sum, g))
                        inflight.append(parts[-1])
                        continue
                    got += sum(n for _, _, n in g)
                    full = got // layer_bytes
                    while done < full:
                        end = L if done < L else 2 * L  # a task never straddles k and v
                        hi = min(full, done + per_task, end)
                        if hi - done < per_task and hi < end:
                            break  # wait for more layers
                        parts.append(pool.submit(layers_sum, flats[done // L], done % L,
                                                 done % L + hi - done, runs))
                        inflight.append(parts[-1])
                        done = hi
                pending.append((parts, recv_sum(s)))
                while pending and all(f.done() for f in pending[0][0]):
                    self._check(*pending.pop(0))
            while pending:
                self._check(*pending.pop(0))
        finally:  # never return (or let the blocks be freed) while a sum still reads them
            for f in inflight:
                f.cancel()
            wait(inflight)

    @staticmethod
    def _check(parts: list[Future], want: int) -> None:
        if sum(f.result() for f in parts) & MASK != want:  # both 0 without checksums
            raise TransferError("payload checksum mismatch")

    def _recv_staged(self, s: socket.socket, k: torch.Tensor, v: torch.Tensor,
                     chunks: list[list[int]], check: bool) -> None:
        """Receive chunk j+1 into one reused buffer while chunk j is scattered from the other."""
        L, _, bs, H, D = k.shape
        unit = bs * H * D * k.element_size()
        stages = getattr(self._local, "stages", None)
        if stages is None:
            stages = self._local.stages = (StagingBuffer(k.is_cuda), StagingBuffer(k.is_cuda))
        pool = self._copy_pool()
        pending: list[Future | None] = [None, None]
        try:
            for j, chunk in enumerate(chunks):
                slot = j % 2
                if pending[slot] is not None:
                    pending[slot].result()  # the scatter reading this buffer is done
                buf = stages[slot].get(len(chunk) * bs * L * H * D * 2 * k.element_size(),
                                       k.dtype, (2, L, len(chunk) * bs, H, D))
                recv_exact(s, memoryview(as_bytes(buf).numpy()))
                if (staged_sum(buf, unit) if check else 0) != recv_sum(s):
                    raise TransferError("payload checksum mismatch")
                pending[slot] = pool.submit(scatter_blocks, k, v, buf, chunk)
        finally:
            for f in pending:
                if f is not None:
                    f.result()

    def release(self, host: str, port: int, rid: str) -> None:
        try:
            self._call(host, port, {"op": "release", "rid": rid})
        except (OSError, TransferError, msgspec.DecodeError) as e:
            log.info("release of %s at %s:%d failed (its pins expire anyway): %r", rid, host, port, e)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with self._lock:
            for conns in self._pool.values():
                for s, _ in conns:
                    s.close()
            self._pool.clear()
            for pool in (self._copier, self._summer):
                if pool is not None:
                    pool.shutdown(wait=False)
