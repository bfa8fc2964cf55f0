"""ZMQ transport of KV events, frame- and byte-compatible with vLLM's publisher.

Frames: ``(topic, 8-byte big-endian sequence, msgpack KVEventBatch)``. The publisher
sends from its own thread (an engine step never blocks on the network) and keeps the
last batches for the replay socket; the subscriber is what routers and tests use.

Replay, as vLLM's: a request ``[b"", start_seq]`` on the ROUTER socket gets every buffered
batch with seq >= start, then the end marker. One extension, for a subscriber that starts
after the buffer wrapped (a restarted router): when ``start`` is older than the oldest
buffered batch, the answer is one *snapshot* batch instead, numbered with the last sequence
sent: ``AllBlocksCleared`` then ``BlockStored`` runs of every block held now
(`event_snapshot.HeldBlocks`). It is an ordinary batch, so any vLLM consumer applies it
correctly, and together with the batches after it it is the whole stream's state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from agentserve.kv.event_snapshot import HeldBlocks
from agentserve.kv.events import (KVEvent, KVEventBatch, decode_event_batch,
                                  encode_event_batch)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # replay end marker, as vLLM's


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank, ``inproc://x`` -> ``inproc://x_dp{rank}``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(
        f"invalid KV events endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://"
    )


def _is_bind(endpoint: str) -> bool:
    # vLLM binds wildcard and ipc/inproc endpoints and connects to the rest.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _open(ctx: zmq.Context, kind: int, endpoint: str, bind: bool | None = None
          ) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(kind)
    try:
        if _is_bind(endpoint) if bind is None else bind:
            sock.bind(endpoint)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves a :0 port
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        # OSError, like a taken HTTP port: the CLIs report it in one line
        raise OSError(f"cannot open KV events socket on {endpoint!r}: {e}") from e
    return sock, endpoint


class KVEventPublisher:
    """ZMQ PUB publisher of KVEventBatch, frame- and byte-compatible with vLLM's.

    ``publish`` only appends to a bounded in-memory queue (drop-oldest, counted in
    ``dropped``) so an engine step never blocks on the network; a daemon thread encodes,
    sends, keeps the last ``buffer_steps`` payloads (and at most ``buffer_bytes`` of them)
    and answers replay requests; a replay from before the oldest kept batch gets a snapshot
    of the held blocks instead (``HeldBlocks``), so the caps bound memory, not correctness.
    ``endpoint``/``replay_endpoint`` hold the resolved addresses (``tcp://*:0`` binds a
    free port).
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "kv-events",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        buffer_bytes: int = 4 << 20,
        data_parallel_rank: int = 0,
        max_queue: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._rank = data_parallel_rank
        self._topic = topic.encode()
        self._pending: deque[KVEventBatch] = deque()
        self._max_queue = max_queue
        # Capped by count (vLLM's buffer_steps) and by bytes: a prefill engine's batches are
        # ~4 KB each (many blocks stored per step), so 10,000 of them would be ~40 MiB.
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_steps = max(1, buffer_steps)
        self._buffer_cap = max(1, buffer_bytes)
        self._buffered = 0  # bytes of the payloads in _buffer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._running = True
        self.dropped = 0
        self.published = 0
        endpoint = offset_endpoint_port(endpoint, data_parallel_rank) or endpoint
        # Unlike vLLM (which connects unless the address is a wildcard), the engine always
        # binds: `--kv-events-endpoint tcp://127.0.0.1:5557` publishes on loopback only,
        # and routers connect to it.
        self._pub, self.endpoint = _open(self._ctx, zmq.PUB, endpoint, bind=True)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        self._seq = 0  # the next batch's sequence number (the sender thread's)
        self._held: HeldBlocks | None = None  # what the stream holds (replay snapshots)
        if replay_endpoint:
            ep = offset_endpoint_port(replay_endpoint, data_parallel_rank) or replay_endpoint
            self._replay, self.replay_endpoint = _open(self._ctx, zmq.ROUTER, ep, bind=True)
            self._held = HeldBlocks()
        self._thread = threading.Thread(target=self._run, name="kv-event-pub", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent] | KVEventBatch, ts: float | None = None) -> None:
        """Queue one batch (one engine step); never blocks. Empty event lists are skipped."""
        if not self._running:
            raise RuntimeError("KVEventPublisher.publish called after close()")
        if isinstance(events, KVEventBatch):
            batch = events
        elif not events:
            return
        else:
            batch = KVEventBatch(time.time() if ts is None else ts, list(events))
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        with self._lock:
            if len(self._pending) >= self._max_queue:
                self._pending.popleft()  # the router resyncs via replay; the engine must not stall
                self.dropped += 1
            self._pending.append(batch)
        self._wake.set()

    def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued (up to ``timeout`` s), stop the thread, close sockets."""
        if not self._running:
            return
        self._running = False
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread still busy after %.1fs", timeout)
            return  # closing sockets under a live thread would crash it; it is a daemon
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        # With a replay socket we must poll it, so wake up at least every 10 ms.
        wait = 0.01 if self._replay is not None else 0.1
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            with self._lock:
                batches, self._pending = self._pending, deque()
            for batch in batches:
                payload = encode_event_batch(batch)
                seq_bytes = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._keep(self._seq, payload)
                if self._held is not None:
                    self._held.apply(batch.events)
                self._seq += 1
                self.published += 1
            if not self._running and not self._pending:
                return

    def _keep(self, seq: int, payload: bytes) -> None:
        """Append one payload to the replay log, dropping the oldest beyond either cap."""
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while len(self._buffer) > 1 and (len(self._buffer) > self._buffer_steps
                                         or self._buffered > self._buffer_cap):
            self._buffered -= len(self._buffer.popleft()[1])

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring malformed KV event replay request: %r", frames[:4])
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        oldest = self._buffer[0][0] if self._buffer else self._seq
        if start_seq < oldest and self._held is not None:
            # the log from start_seq is gone: send the state as of the last batch instead
            snap = encode_event_batch(self._held.snapshot(time.time(), self._rank))
            last = (self._seq - 1).to_bytes(8, "big")
            self._replay.send_multipart((client, b"", self._topic, last, snap))
        else:
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    frame = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    self._replay.send_multipart(frame)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


class KVEventSubscriber:
    """SUB side: ``recv`` one ``(seq, batch)``; ``replay`` missed batches from a ROUTER."""

    def __init__(
        self, endpoint: str, topic: str = "kv-events", replay_endpoint: str | None = None
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._topic = topic.encode()
        self._sub, self.endpoint = _open(self._ctx, zmq.SUB, endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay, _ = _open(self._ctx, zmq.DEALER, replay_endpoint)

    def recv(self, timeout_ms: int = 1000) -> tuple[int, KVEventBatch] | None:
        """The next batch on our exact topic, or None after ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        while (left := deadline - time.monotonic()) > 0 or timeout_ms == 0:
            if not self._sub.poll(max(0, int(left * 1000))):
                return None
            frames = self._sub.recv_multipart()
            # ZMQ subscriptions are prefix matches; "kv-events-2" must not leak in.
            if len(frames) == 3 and frames[0] == self._topic:
                return int.from_bytes(frames[1], "big"), decode_event_batch(frames[2])
        return None

    def replay(self, start_seq: int, timeout_ms: int = 1000) -> list[tuple[int, KVEventBatch]]:
        """Ask the publisher for buffered batches with seq >= ``start_seq``."""
        if self._replay is None:
            raise RuntimeError("KVEventSubscriber was created without replay_endpoint")
        self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out: list[tuple[int, KVEventBatch]] = []
        while self._replay.poll(timeout_ms):
            _, _, seq, payload = self._replay.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), decode_event_batch(payload)))
        raise TimeoutError(
            f"KV event replay from seq {start_seq}: no end marker within {timeout_ms} ms"
        )

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
