import socket
import time

import msgspec
import pytest

from agentserve.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_stored,
    decode_event_batch,
    encode_event_batch,
)
from agentserve.kv.zmq_events import KVEventPublisher, KVEventSubscriber, offset_endpoint_port
from tests.kv.conftest import VECTORS


def vllm_batch() -> KVEventBatch:
    """The batch gen_vllm_vectors.event_vectors encoded with vLLM's own Structs."""
    return KVEventBatch(
        ts=1700000000.5,
        events=[
            block_stored([123, 456], None, [1, 2, 3, 4], 2),
            BlockStored([b"\x01" * 32], b"\x02" * 32, [5, 6], 2, None, "CPU", None),
            BlockRemoved([123], "GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_encoding_is_byte_identical_to_vllm():
    assert encode_event_batch(vllm_batch()).hex() == VECTORS["events"]["batch"]
    no_rank = KVEventBatch(1.25, [AllBlocksCleared()])
    assert encode_event_batch(no_rank).hex() == VECTORS["events"]["batch_no_rank"]


@pytest.mark.parametrize("name", ["batch", "batch_no_rank", "pool_run"])
def test_decodes_vllm_payloads(name):
    batch = decode_event_batch(bytes.fromhex(VECTORS["events"][name]))
    assert encode_event_batch(batch).hex() == VECTORS["events"][name]


def test_round_trip_and_lenient_shapes():
    b = vllm_batch()
    assert decode_event_batch(encode_event_batch(b)) == b
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
              "lora_name": None}
    two = msgspec.msgpack.encode([3.0, [stored, {"type": "AllBlocksCleared"}]])
    assert decode_event_batch(two).events[1] == AllBlocksCleared()
    as_map = msgspec.msgpack.encode({"ts": 3, "events": [["BlockRemoved", [9], "CPU"]]})
    out = decode_event_batch(as_map)
    assert out.ts == 3.0 and out.events == [BlockRemoved([9], "CPU")]


@pytest.mark.parametrize(
    "payload",
    [b"\xc1garbage", msgspec.msgpack.encode("x"), msgspec.msgpack.encode([1.0, "no"]),
     msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
     msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]])],
)
def test_garbage_raises_value_error(payload):
    with pytest.raises(ValueError):
        decode_event_batch(payload)


def test_offset_endpoint_port():
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pub_sub_and_replay_over_tcp():
    port, rport = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}",
                            replay_endpoint=f"tcp://127.0.0.1:{rport}")
    other = KVEventPublisher("tcp://*:0", topic="kv-events-2")  # prefix-sharing topic
    try:
        # PUB/SUB drops messages until the subscription propagates: probe until one lands.
        deadline = time.monotonic() + 5
        while (got := sub.recv(timeout_ms=50)) is None:
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.publish([AllBlocksCleared()])
        first_seq = got[0]
        pub.publish([block_stored([1, 2], None, list(range(8)), 4)], ts=10.0)
        pub.publish([BlockRemoved([2], "GPU", group_idx=0)], ts=11.0)
        pub.publish([])  # empty steps are not sent
        received = []
        while len(received) < 2:
            item = sub.recv(timeout_ms=2000)
            assert item is not None, "batch lost on loopback"
            if item[1].ts >= 10.0:
                received.append(item)
        (s1, b1), (s2, b2) = received
        assert first_seq < s1 < s2 and s2 == s1 + 1
        assert b1.events[0].block_hashes == [1, 2] and b1.data_parallel_rank == 0
        assert b2.events == [BlockRemoved([2], "GPU", group_idx=0)]
        replayed = sub.replay(s1)
        assert [(s, b.ts) for s, b in replayed] == [(s1, 10.0), (s2, 11.0)]
        assert sub.replay(s2 + 1) == []
        assert pub.dropped == 0
    finally:
        sub.close()
        pub.close()
        other.close()


def test_publish_never_blocks_and_drops_oldest(monkeypatch):
    import threading

    from agentserve.kv import events as ev_mod
    from agentserve.kv import zmq_events as zmq_mod

    gate, taken, real = threading.Event(), threading.Event(), ev_mod.encode_event_batch

    def stalled(batch):  # the sender thread blocks here, as on a stuck network
        taken.set()
        gate.wait(5)
        return real(batch)

    # the sender thread calls zmq_events' own name for the encoder (patching events' did
    # nothing: the test passed only while the burst outran the thread's 0.1 s wake-ups)
    monkeypatch.setattr(zmq_mod, "encode_event_batch", stalled)
    pub = KVEventPublisher("tcp://*:0", max_queue=3)
    try:
        t = time.monotonic()
        for i in range(20):
            pub.publish([AllBlocksCleared()], ts=float(i))
            if i == 0:  # let the thread take batch 0 and stall on it (a wait, not a sleep:
                assert taken.wait(5)  # on a loaded machine 0.3 s was not always enough)
                t = time.monotonic()
        assert time.monotonic() - t < 1.5, "publish() blocked the caller"
        assert pub.dropped == 20 - 1 - 3
    finally:
        gate.set()
        pub.close()
    assert pub.published == 4
    kept = [decode_event_batch(p).ts for _, p in pub._buffer]
    assert kept == [0.0, 17.0, 18.0, 19.0]  # the oldest queued ones were dropped
    with pytest.raises(RuntimeError, match="after close"):
        pub.publish([AllBlocksCleared()])
