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

from typing import Any

import msgspec

from agentserve.kv.hashing import BlockHash

ExternalBlockHash = bytes | int
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"


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


__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventQueue",
    "block_stored",
    "decode_event_batch",
    "encode_event_batch",
]
