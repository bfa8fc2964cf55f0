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
- `seq < expected`: a duplicate (a batch the replay already gave), unless it is newer
  than the last batch applied (seq 0, or a later timestamp): then the engine restarted
  (sequence numbers start at 0 again), and the holder is rebuilt from seq 0.

With a replay socket the stream is rebuilt from seq 0 as soon as the subscriber starts
(a router started after its engines does not begin with an empty index) and, before the
endpoint takes traffic again, whenever it comes back after failed health checks (a
restarted engine that has published nothing yet has nothing cached). A replay from seq 0
is a rebuild: the holder is cleared and the answer applied. Our engines answer a replay
older than their buffer with one snapshot batch (`kv.zmq_events`); any replayed batch
that opens with `AllBlocksCleared` is such a point: what came before it is not needed.

Only KV cache group 0 (the full-attention group; `group_idx` None or 0) is indexed.
"""

from __future__ import annotations

import logging
import time
import asyncio
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

    def classify(self, rank: int, seq: int, ts: float | None = None) -> str:
        """'ok' | 'first' | 'gap' | 'restart' | 'dup' for a batch arriving on a stream.

        A batch behind the stream is a duplicate when it is no newer than the last batch
        applied (a replayed batch also queued live carries the same timestamp); a newer
        one comes from a restarted engine whose first batches we missed."""
        st = self.streams.setdefault(rank, StreamState())
        if st.expected is None:
            return "first"
        if seq == st.expected:
            return "ok"
        if seq > st.expected:
            return "gap"
        return "restart" if seq == 0 or (ts is not None and ts > st.last_ts) else "dup"

    def accept(self, rank: int, seq: int, batch: KVEventBatch) -> None:
        st = self.streams.setdefault(rank, StreamState())
        self.apply(rank, batch)
        st.expected, st.applied, st.last_ts = seq + 1, st.applied + 1, batch.ts
        st.lag_s = max(0.0, time.time() - batch.ts)

    def on_batch(self, rank: int, seq: int, batch: KVEventBatch,
                 replayed: list[tuple[int, KVEventBatch]] | None = None) -> str:
        """Handle one live batch; `replayed` is what the replay socket returned when asked
        (from `expected` for a gap, from 0 otherwise)."""
        kind = self.classify(rank, seq, batch.ts)
        st = self.streams[rank]
        if kind == "dup":
            return kind
        if kind != "ok":
            if kind in ("gap", "restart"):
                st.gaps += 1
            if kind == "restart":
                st.expected = None
                if replayed is None:
                    self.clear(rank)
            if replayed is not None:
                self.catch_up(rank, st.expected if kind == "gap" else 0, replayed)
            if st.expected is not None and seq < st.expected:
                return kind  # the replay covered this batch
            if st.expected is not None and seq != st.expected:
                self.clear(rank)  # a hole nothing filled: an empty index beats a wrong one
        self.accept(rank, seq, batch)
        return kind

    def catch_up(self, rank: int, start: int, replayed: list[tuple[int, KVEventBatch]]) -> None:
        """Apply a replay answer for batches from `start` (0: rebuild the holder).

        It begins at its last restart point (a batch opening with `AllBlocksCleared`: our
        engines' snapshot), else at `start`; an answer that does not reach back to `start`
        (the publisher's buffer wrapped) is applied from its own first batch after a clear.
        Application stops at a hole; `expected` then points at it."""
        st = self.streams.setdefault(rank, StreamState())
        st.resyncs += 1
        got = sorted({s: b for s, b in replayed if s >= start}.items())
        cut = next((i for i in range(len(got) - 1, -1, -1)
                    if got[i][1].events and isinstance(got[i][1].events[0], AllBlocksCleared)),
                   None)
        if cut is None and got and got[0][0] != start:
            cut = 0  # only the log's tail is left: the best that can be rebuilt
        if start == 0 or cut is not None:
            self.clear(rank)
            if not got:
                st.expected = 0  # the engine has published nothing
        for i, (s, b) in enumerate(got[cut or 0:]):
            if i and s != got[(cut or 0) + i - 1][0] + 1:
                break
            self.accept(rank, s, b)


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


def stream_address(address: str, url: str, rank: int) -> str:
    """The address to connect to for DP rank `rank` of an endpoint's configured socket."""
    return offset_endpoint_port(connect_address(address, url), rank) or address


async def rebuild(ctx: zmq.asyncio.Context, applier: EventApplier, replay_address: str,
                  rank: int = 0) -> bool:
    """Rebuild one stream's holder from the engine's replay socket (its configured address);
    False if it did not answer."""
    address = stream_address(replay_address, applier.url, rank)
    got = await replay(ctx, address, 0)
    if got is None:
        logger.warning("KV events: no replay answer from %s; the index of %s waits for its "
                       "next batch", address, applier.url)
        return False
    applier.catch_up(rank, 0, got)
    return True


async def subscribe(ctx: zmq.asyncio.Context, applier: EventApplier, address: str,
                    replay_address: str | None, rank: int = 0,
                    ready: asyncio.Event | None = None) -> None:
    """Run forever: receive one stream's batches and apply them in order.

    With a replay socket the holder is rebuilt first; `ready` is set once that was tried.
    (The gateway rebuilds it again, with `rebuild`, when the endpoint comes back from
    failed health checks.)"""
    address = stream_address(address, applier.url, rank)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.connect(address)
    try:
        if replay_address:
            await rebuild(ctx, applier, replay_address, rank)
        if ready is not None:
            ready.set()
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
            kind = applier.classify(rank, seq, batch.ts)
            got = None
            if replay_address and kind in ("gap", "first", "restart"):
                got = await replay(ctx, stream_address(replay_address, applier.url, rank),
                                   0 if kind != "gap" else applier.streams[rank].expected or 0)
            applier.on_batch(rank, seq, batch, got)
    finally:
        sock.close(linger=0)
