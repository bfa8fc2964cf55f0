"""KV events in, index updates out: one ZMQ SUB per endpoint (and per DP rank).

Frames are vLLM's `(topic, seq as 8-byte big-endian, msgpack KVEventBatch)`; payloads
in both array and map encodings are decoded by `agentserve.kv.events`. Per stream the
router applies batches strictly in sequence order:

- `seq == expected`: apply.
- `seq > expected` (a gap: the PUB socket dropped frames, or we reconnected): ask the
  replay socket, if configured, for everything from `expected`; apply what it returns
  in order. If there is no replay socket, or it cannot fill the gap, the holder's entries
  are cleared (a stale index routes badly; an empty one only routes by load until the
  next BlockStored events arrive), then the batch is applied.
- `seq < expected`: the engine restarted (sequence numbers start at 0 again): clear.
- The first batch ever seen: with a replay socket, catch up from seq 0 first.

Only KV cache group 0 (the full-attention group; `group_idx` None or 0) is indexed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

import zmq
import zmq.asyncio

from agentserve.kv.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                  decode_event_batch)
from agentserve.kv.zmq_events import END_SEQ, offset_endpoint_port
from agentserve.router.index import PrefixIndex, block_key

logger = logging.getLogger(__name__)


def connect_address(address: str, url: str) -> str:
    """A bind-style address (`tcp://*:5557`, `tcp://0.0.0.0:5557`) gets the endpoint's host."""
    host = urlparse(url).hostname or "127.0.0.1"
    for wild in ("*", "0.0.0.0"):
        address = address.replace(f"//{wild}:", f"//{host}:")
    return address


@dataclass(slots=True)
class StreamState:
    """Sequence bookkeeping of one (endpoint, socket rank) stream."""

    expected: int | None = None
    applied: int = 0
    gaps: int = 0
    resyncs: int = 0
    clears: int = 0
    last_ts: float = 0.0
    lag_s: float = 0.0


@dataclass
class EventApplier:
    """Applies one endpoint's batches to the index in order (no I/O; unit-testable)."""

    index: PrefixIndex
    url: str
    on_block_size: Callable[[int], None] | None = None
    streams: dict[int, StreamState] = field(default_factory=dict)

    def apply(self, rank: int, batch: KVEventBatch) -> None:
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else rank
        holder = (self.url, rank)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.group_idx not in (None, 0):
                    continue
                if self.on_block_size is not None:
                    self.on_block_size(ev.block_size)
                self.index.store(holder, [block_key(h) for h in ev.block_hashes], ev.medium)
            elif isinstance(ev, BlockRemoved):
                if ev.group_idx not in (None, 0):
                    continue
                self.index.remove(holder, [block_key(h) for h in ev.block_hashes], ev.medium)
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear_holder(holder)

    def clear(self, rank: int) -> None:
        self.index.clear_holder((self.url, rank))
        self.streams.setdefault(rank, StreamState()).clears += 1

    def classify(self, rank: int, seq: int) -> str:
        """'ok' | 'first' | 'gap' | 'restart' | 'dup' for a batch arriving on a stream."""
        st = self.streams.setdefault(rank, StreamState())
        if st.expected is None:
            return "first"
        if seq == st.expected:
            return "ok"
        if seq > st.expected:
            return "gap"
        return "restart" if seq == 0 else "dup"

    def accept(self, rank: int, seq: int, batch: KVEventBatch) -> None:
        st = self.streams.setdefault(rank, StreamState())
        self.apply(rank, batch)
        st.expected, st.applied, st.last_ts = seq + 1, st.applied + 1, batch.ts
        st.lag_s = max(0.0, time.time() - batch.ts)

    def on_batch(self, rank: int, seq: int, batch: KVEventBatch,
                 replayed: list[tuple[int, KVEventBatch]] | None = None) -> str:
        """Handle one live batch; `replayed` is what the replay socket returned, if asked."""
        kind = self.classify(rank, seq)
        st = self.streams[rank]
        if kind == "dup":
            return kind
        if kind != "ok":
            start = st.expected if kind == "gap" else 0
            got = sorted((s, b) for s, b in (replayed or []) if start <= s < seq)
            complete = [s for s, _ in got] == list(range(start, seq))
            if kind in ("gap", "restart"):
                st.gaps += 1
            if kind == "restart" or (kind == "gap" and not complete):
                self.clear(rank)
            if replayed is not None:
                st.resyncs += 1
            for s, b in _contiguous_tail(got, seq):
                self.accept(rank, s, b)
        self.accept(rank, seq, batch)
        return kind


def _contiguous_tail(got: list[tuple[int, KVEventBatch]],
                     end: int) -> list[tuple[int, KVEventBatch]]:
    """The longest run of `got` (sorted by seq) ending exactly at seq `end - 1`."""
    i = len(got)
    while i > 0 and got[i - 1][0] == end - (len(got) - i) - 1:
        i -= 1
    return got[i:]


async def replay(ctx: zmq.asyncio.Context, address: str, start: int,
                 timeout_s: float = 1.0) -> list[tuple[int, KVEventBatch]] | None:
    """Fetch buffered batches with seq >= start from a vLLM replay ROUTER; None on failure."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    out: list[tuple[int, KVEventBatch]] = []
    try:
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        while await sock.poll(int(timeout_s * 1000)):
            frames = await sock.recv_multipart()
            if len(frames) != 4:
                continue
            if frames[2] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[2], "big"), decode_event_batch(frames[3])))
        return None
    finally:
        sock.close(linger=0)


async def subscribe(ctx: zmq.asyncio.Context, applier: EventApplier, address: str,
                    replay_address: str | None, rank: int = 0) -> None:
    """Run forever: receive one stream's batches and apply them in order."""
    address = offset_endpoint_port(connect_address(address, applier.url), rank) or address
    if replay_address:
        replay_address = offset_endpoint_port(connect_address(replay_address, applier.url), rank)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.connect(address)
    try:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            try:
                batch = decode_event_batch(frames[2])
            except Exception as e:  # a corrupt frame is a gap: resync on the next one
                logger.warning("KV events from %s: undecodable batch %d: %s", address, seq, e)
                continue
            kind = applier.classify(rank, seq)
            got = None
            if replay_address and kind in ("gap", "first", "restart"):
                got = await replay(ctx, replay_address, 0 if kind != "gap"
                                   else applier.streams[rank].expected or 0)
            applier.on_batch(rank, seq, batch, got if got is not None else None)
    finally:
        sock.close(linger=0)
