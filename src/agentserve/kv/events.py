"""KV cache events, wire-compatible with vLLM 0.32 (vllm/distributed/kv_events.py).

Wire format, as vLLM 0.32 sends it (checked against its encoder, see tests/kv):

- ZMQ PUB multipart ``(topic, seq as 8-byte big-endian, msgpack payload)``; seq starts
  at 0 (kv_events.py:495-499).
- payload ``KVEventBatch`` is ``array_like`` -> ``[ts, [events...], data_parallel_rank]``
  (the publisher fills rank 0 when unset, kv_events.py:392).
- events are tagged, *not* array-like -> maps ``{"type": "BlockStored", ...}``; fields
  without defaults are always present (even when None), defaulted ones omitted.
- replay: ROUTER socket; a client sends ``[b"", start_seq(8B BE)]`` (e.g. from a DEALER)
  and gets ``[b"", topic, seq, payload]`` per buffered batch with seq >= start, then
  ``[b"", b"", END_SEQ, b""]`` where END_SEQ is -1 as signed 8 bytes (kv_events.py:509-527).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from agentserve.kv.hashing import BlockHash

ExternalBlockHash = bytes | int
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events; the tag is the class name (``"type"`` key)."""


class BlockStored(KVCacheEvent):
    """A run of consecutive full blocks became cached; field order is vLLM's."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache of ``medium`` (vLLM sends one hash per event)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class KVEventQueue:
    """Sink the block pool appends to; the engine drains it once per step with ``take``."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def append(self, event: KVEvent) -> None:
        self._events.append(event)

    def take(self) -> list[KVEvent]:
        """Return all queued events (oldest first) and clear the queue."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def encode_event_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes identical to what vLLM 0.32's publisher sends for ``batch``."""
    return _ENCODER.encode(batch)


def decode_event_batch(payload: bytes) -> KVEventBatch:
    """Decode a KV event payload from vLLM or from us.

    Accepts vLLM's encoding (array batch, tagged map events) and looser shapes other
    producers use: a map batch ``{"ts", "events", "data_parallel_rank"}``, a 2-element
    ``[ts, events]`` array, and array-like events ``["BlockStored", field, ...]``.
    Raises ValueError with the reason on anything else.
    """
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass  # fall through to the lenient path for the rarer shapes
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"KV event payload is not msgpack ({len(payload)} bytes): {e}") from e
    return _normalize_batch(raw)


def _normalize_batch(raw: Any) -> KVEventBatch:
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
    else:
        raise ValueError(
            "KV event payload must be [ts, events, rank?] or a map with ts/events; "
            f"got {type(raw).__name__} {str(raw)[:80]}"
        )
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise ValueError(f"KV event batch needs numeric ts and a list of events; got {raw!r:.120}")
    if rank is not None and not isinstance(rank, int):
        raise ValueError(f"data_parallel_rank must be an int or None, got {rank!r}")
    return KVEventBatch(float(ts), [_normalize_event(e) for e in events], rank)


def _normalize_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        cls = _EVENT_TYPES.get(tag)
        names = cls.__struct_fields__ if cls else ()
        if len(raw) - 1 > len(names):
            raise ValueError(f"array-like {tag} event has {len(raw) - 1} fields, max {len(names)}")
        fields = dict(zip(names, raw[1:]))
    else:
        raise ValueError(f"KV event must be a tagged map or array, got {raw!r:.120}")
    cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ValueError(f"unknown KV event type {tag!r}; expected one of {list(_EVENT_TYPES)}")
    try:
        return msgspec.convert(fields, cls)  # type: ignore[return-value]
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid {tag} event: {e}") from e


def block_stored(
    hashes: list[ExternalBlockHash],
    parent: ExternalBlockHash | None,
    token_ids: list[int],
    block_size: int,
    medium: str = MEDIUM_GPU,
    extra_keys: list[tuple[Any, ...] | None] | None = None,
    session_id: str | None = None,
) -> BlockStored:
    """A BlockStored shaped like vLLM's block pool emits it (group 0, no LoRA).

    vLLM always sends one ``extra_keys`` entry per block, None when a block has none,
    and ``group_idx=0`` (block_pool.py:363-374), so we do too for byte-equal payloads.
    """
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=extra_keys if extra_keys is not None else [None] * len(hashes),
        group_idx=0,
        session_id=session_id,
    )


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
        raise ValueError(f"cannot open KV events socket on {endpoint!r}: {e}") from e
    return sock, endpoint


class KVEventPublisher:
    """ZMQ PUB publisher of KVEventBatch, frame- and byte-compatible with vLLM's.

    ``publish`` only appends to a bounded in-memory queue (drop-oldest, counted in
    ``dropped``) so an engine step never blocks on the network; a daemon thread encodes,
    sends, keeps the last ``buffer_steps`` payloads and answers replay requests.
    ``endpoint``/``replay_endpoint`` hold the resolved addresses (``tcp://*:0`` binds a
    free port).
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "kv-events",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        max_queue: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._rank = data_parallel_rank
        self._topic = topic.encode()
        self._pending: deque[KVEventBatch] = deque()
        self._max_queue = max_queue
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
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
        if replay_endpoint:
            ep = offset_endpoint_port(replay_endpoint, data_parallel_rank) or replay_endpoint
            self._replay, self.replay_endpoint = _open(self._ctx, zmq.ROUTER, ep, bind=True)
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
        seq = 0
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
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.published += 1
            if not self._running and not self._pending:
                return

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring malformed KV event replay request: %r", frames[:4])
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
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


__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventQueue",
    "KVEventSubscriber",
    "block_stored",
    "decode_event_batch",
    "encode_event_batch",
]
