"""EventApplier ordering/gap logic, and live ZMQ streams from our publisher."""

import asyncio
import time

import msgspec
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                  decode_event_batch, encode_event_batch)
from agentserve.kv.zmq_events import KVEventPublisher
from agentserve.router.events import EventApplier, rebuild, subscribe
from agentserve.router.index import PrefixIndex

URL = "http://e"


def local(address):
    return address.replace("0.0.0.0", "127.0.0.1")


def stored(hashes, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                       block_size=16, lora_id=None, medium=medium, lora_name=None)


def batch(*events, rank=0, ts=None):
    return KVEventBatch(ts=time.time() if ts is None else ts, events=list(events),
                        data_parallel_rank=rank)


def run(index):
    return index.match([1, 2, 3]).best_run((URL, 0))


def test_in_order_apply_and_remove():
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    assert a.on_batch(0, 0, batch(stored([1, 2, 3]))) == "first"
    assert run(idx) == 3
    removed = batch(BlockRemoved(block_hashes=[3], medium="GPU"))
    assert a.on_batch(0, 1, removed) == "ok"
    assert run(idx) == 2
    # a batch seen again (the replay gave it, the SUB queue held it too) carries its own ts
    assert a.on_batch(0, 1, batch(stored([9]), ts=removed.ts)) == "dup"
    assert a.on_batch(0, 2, batch(AllBlocksCleared())) == "ok"
    assert run(idx) == 0


def test_gap_without_replay_clears():
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    a.on_batch(0, 0, batch(stored([1, 2])))
    assert a.on_batch(0, 5, batch(stored([7]))) == "gap"
    assert run(idx) == 0 and idx.match([7]).best_run((URL, 0)) == 1
    assert a.streams[0].gaps == 1 and a.streams[0].clears == 1


def test_gap_filled_by_replay():
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    a.on_batch(0, 0, batch(stored([1])))
    replayed = [(1, batch(stored([2]))), (2, batch(stored([3])))]
    assert a.on_batch(0, 3, batch(stored([4])), replayed) == "gap"
    assert idx.match([1, 2, 3, 4]).best_run((URL, 0)) == 4
    assert a.streams[0].clears == 0


def test_restart_clears():
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    a.on_batch(0, 0, batch(stored([1, 2, 3])))
    a.on_batch(0, 1, batch(stored([5])))
    assert a.on_batch(0, 0, batch(stored([1]))) == "restart"
    assert run(idx) == 1


def test_rank_and_medium_from_batch():
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    a.on_batch(0, 0, batch(stored([1, 2], "CPU"), rank=1))
    m = idx.match([1, 2])
    assert m.best_run((URL, 1)) == 2 and m.tiers == ["GPU", "CPU"] and m.runs[(URL, 1)][0] == 0


def test_vllm_map_encoding_roundtrip():
    payload = encode_event_batch(batch(stored([2**63 + 5, b"\x01" * 32])))
    idx = PrefixIndex()
    EventApplier(idx, URL).on_batch(0, 0, decode_event_batch(payload))
    assert len(idx) == 2


async def _wait(pred, timeout=5.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.01)


async def test_live_zmq_with_replay_catches_up():
    pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        pub.publish([stored([1])])  # sent before we subscribe: only replay can deliver it
        await asyncio.sleep(0.1)
        ctx = zmq.asyncio.Context()
        idx = PrefixIndex()
        a = EventApplier(idx, URL)
        task = asyncio.create_task(subscribe(ctx, a, local(pub.endpoint), local(pub.replay_endpoint)))
        await asyncio.sleep(0.3)  # slow joiner
        pub.publish([stored([2])])
        pub.publish([stored([3])])
        await _wait(lambda: idx.match([1, 2, 3]).best_run((URL, 0)) == 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
    finally:
        pub.close()


def test_a_batch_newer_than_the_stream_but_behind_it_is_a_restart():
    """The engine restarted and we missed its seq 0: its later batch is newer than any
    applied, so it is no duplicate; the holder is rebuilt, not kept with the dead one's."""
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    for seq in range(6):
        a.on_batch(0, seq, batch(stored([1 + seq]), ts=100.0 + seq))
    assert a.on_batch(0, 2, batch(stored([9]), ts=200.0)) == "restart"
    assert len(idx) == 1 and idx.match([9]).best_run((URL, 0)) == 1
    assert a.streams[0].expected == 3


def test_a_snapshot_replay_newer_than_the_live_batch_covers_it():
    """A gap asked of a replay socket whose buffer wrapped: the answer is one snapshot
    batch, numbered past the live batch that showed the gap; it replaces the holder, and
    the live batch (already in it) is not applied again."""
    idx = PrefixIndex()
    a = EventApplier(idx, URL)
    a.on_batch(0, 0, batch(stored([1, 2, 3])))
    snap = batch(AllBlocksCleared(), stored([1, 2]), stored([7]))
    assert a.on_batch(0, 10, batch(stored([8])), [(12, snap)]) == "gap"
    assert run(idx) == 2 and idx.match([7]).best_run((URL, 0)) == 1
    assert idx.match([8]).best_run((URL, 0)) == 0 and a.streams[0].expected == 13


async def test_a_router_started_after_the_buffer_wrapped_rebuilds_before_any_batch():
    """The engines ran for a while (more steps than the replay buffer keeps); the router
    (re)starts: it rebuilds the whole index from the replay socket's snapshot at once,
    without waiting for the engine's next batch."""
    pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=4)
    ctx = zmq.asyncio.Context()
    try:
        for i in range(20):
            pub.publish([stored([100 + i])])
        pub.publish([BlockRemoved(block_hashes=[100], medium="GPU")])
        await _wait(lambda: pub.published == 21)
        idx, ready = PrefixIndex(), asyncio.Event()
        a = EventApplier(idx, URL)
        task = asyncio.create_task(subscribe(ctx, a, local(pub.endpoint),
                                             local(pub.replay_endpoint), ready=ready))
        await asyncio.wait_for(ready.wait(), 5)
        assert len(idx) == 19 and idx.match([101]).best_run((URL, 0)) == 1
        assert a.streams[0].expected == 21
        pub.publish([stored([500])])  # and the live stream continues from there
        await _wait(lambda: idx.match([500]).best_run((URL, 0)) == 1)
        assert a.streams[0].gaps == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        ctx.destroy(linger=0)
        pub.close()


async def test_a_restarted_engine_is_rebuilt_from_its_replay():
    """A restarted engine that has published nothing yet holds nothing: rebuilt from its
    replay socket (empty; the gateway does it when its health checks pass again), the
    router stops predicting the dead engine's cache, and the new stream applies."""
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ev, rp = f"tcp://*:{port()}", f"tcp://*:{port()}"
    pub = KVEventPublisher(ev, replay_endpoint=rp)
    ctx = zmq.asyncio.Context()
    try:
        pub.publish([stored([1, 2, 3])])
        await _wait(lambda: pub.published == 1)
        idx = PrefixIndex()
        a = EventApplier(idx, URL)
        task = asyncio.create_task(subscribe(ctx, a, ev.replace("*", "127.0.0.1"),
                                             rp.replace("*", "127.0.0.1")))
        await _wait(lambda: run(idx) == 3)
        pub.close()
        for _ in range(50):  # the engine, restarted on the same ports: seq 0 again
            try:
                pub = KVEventPublisher(ev, replay_endpoint=rp)
                break
            except OSError:  # the old sockets are closed by ZMQ's I/O thread, not at once
                await asyncio.sleep(0.1)
        assert await rebuild(ctx, a, rp.replace("*", "127.0.0.1"))
        assert len(idx) == 0 and a.streams[0].expected == 0
        pub.publish([stored([1])])
        for _ in range(50):  # until the SUB has reconnected: a later batch shows the gap
            if run(idx) == 1:
                break
            await asyncio.sleep(0.1)
            pub.publish([stored([77])])
        assert run(idx) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        ctx.destroy(linger=0)
        pub.close()


_msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
              st.text(max_size=8), st.binary(max_size=12)),
    lambda kids: st.one_of(st.lists(kids, max_size=4),
                           st.dictionaries(st.text(max_size=8), kids, max_size=4)), max_leaves=12)
_events = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved",
                                                     "AllBlocksCleared", "Nope"])},
                          optional={"block_hashes": st.lists(st.one_of(
                              st.integers(-2**63, 2**64 - 1), st.binary(max_size=40)), max_size=3),
                              "parent_block_hash": st.one_of(st.none(), st.integers(0, 9)),
                              "token_ids": st.lists(st.integers(-1, 9), max_size=3),
                              "block_size": st.integers(-2, 64), "medium": st.one_of(
                                  st.none(), st.sampled_from(["GPU", "cpu", "DISK", "", "x"])),
                              "lora_id": st.none(), "lora_name": st.none(),
                              "group_idx": st.one_of(st.none(), st.integers(-1, 2))}),
    _msgpack_values), max_size=4)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.one_of(st.binary(max_size=64), _msgpack_values.map(msgspec.msgpack.encode),
                 st.tuples(st.floats(0, 1e9), _events, st.one_of(st.none(), st.integers(-1, 3))
                           ).map(lambda t: msgspec.msgpack.encode(list(t)))))
def test_any_payload_decodes_to_a_batch_the_index_takes_or_a_value_error(payload: bytes) -> None:
    """Whatever bytes an endpoint publishes, decoding gives a batch or a ValueError (the
    subscriber logs it and resyncs), and applying a decoded batch never raises: one bad
    publisher must not stop the router's event loop for its endpoint."""
    try:
        batch = decode_event_batch(payload)
    except ValueError:
        return
    a = EventApplier(PrefixIndex(), URL, on_block_size=lambda n: None)
    a.apply(0, batch)
