"""HeldBlocks: the snapshot batch a publisher answers a replay older than its buffer with."""

from __future__ import annotations

import socket
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.event_snapshot import HeldBlocks
from agentserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, block_stored
from agentserve.kv.zmq_events import KVEventPublisher, KVEventSubscriber


def held_set(events) -> set[tuple[int, str | None]]:
    """A reference model of what a stream holds: (hash, medium) pairs; a clear drops the
    device's (GPU or unnamed) and keeps the CPU/disk tiers'."""
    held: set[tuple[int, str | None]] = set()
    for ev in events:
        if isinstance(ev, BlockStored):
            held |= {(h, ev.medium) for h in ev.block_hashes}
        elif isinstance(ev, BlockRemoved):
            held -= {(h, ev.medium) for h in ev.block_hashes}
        else:
            held = {(h, m) for h, m in held if m not in (None, "GPU")}
    return held


_media = st.sampled_from(["GPU", "CPU", "DISK", None])
_events = st.lists(st.one_of(
    st.builds(lambda hs, m, p: block_stored(hs, p, [h * 10 + i for h in hs for i in range(2)],
                                            2, medium=m),
              st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True), _media,
              st.one_of(st.none(), st.integers(1, 12))),
    st.builds(lambda hs, m: BlockRemoved(hs, m), st.lists(st.integers(1, 12), max_size=3), _media),
    st.just(AllBlocksCleared())), max_size=30)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_events)
def test_a_snapshot_holds_exactly_what_the_stream_does(events) -> None:
    held = HeldBlocks()
    held.apply(events)
    snap = held.snapshot(1.0, 0)
    assert isinstance(snap.events[0], AllBlocksCleared)
    assert held_set(snap.events) == held_set(events)  # applied from nothing, by anyone
    again = HeldBlocks()
    again.apply(snap.events)
    assert held_set(again.snapshot(2.0).events) == held_set(events)
    for ev in snap.events[1:]:  # each run carries its blocks' tokens, in order
        assert ev.token_ids == [h * 10 + i for h in ev.block_hashes for i in range(2)] or \
            not ev.token_ids


def test_a_chain_comes_back_as_one_run_per_medium() -> None:
    held = HeldBlocks()
    held.apply([block_stored([1, 2], None, list(range(8)), 4),
                block_stored([3], 2, list(range(8, 12)), 4),
                block_stored([1, 2], None, list(range(8)), 4, medium="CPU"),
                BlockRemoved([3], "GPU", group_idx=0)])
    _, gpu, cpu = held.snapshot(1.0).events
    assert (gpu.block_hashes, gpu.parent_block_hash, gpu.medium) == ([1, 2], None, "GPU")
    assert gpu.token_ids == list(range(8)) and gpu.block_size == 4
    assert (cpu.block_hashes, cpu.medium) == ([1, 2], "CPU")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_replay_older_than_the_buffer_gets_a_snapshot_at_the_last_seq() -> None:
    port, rport = _free_port(), _free_port()
    pub = KVEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}", buffer_steps=3)
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    try:
        for i in range(10):  # seqs 0-9; the buffer keeps 7-9
            pub.publish([block_stored([100 + i], 100 + i - 1 if i else None, [i], 1)])
        pub.publish([BlockRemoved([100], "GPU")])  # seq 10
        deadline = time.monotonic() + 5
        while pub.published < 11:
            assert time.monotonic() < deadline, "publisher thread stuck"
            time.sleep(0.01)
        (seq, snap), = sub.replay(0)
        assert seq == 10 and isinstance(snap.events[0], AllBlocksCleared)
        assert held_set(snap.events) == {(100 + i, "GPU") for i in range(1, 10)}
        assert [s for s, _ in sub.replay(8)] == [8, 9, 10]  # within the buffer: vLLM's log
    finally:
        sub.close()
        pub.close()


def test_the_replay_log_is_capped_by_bytes_as_well_as_by_steps() -> None:
    """Big batches (a prefill engine stores many blocks a step) hit the byte cap long before
    the step cap; what fell out of the log is still served, as a snapshot."""
    port, rport = _free_port(), _free_port()
    pub = KVEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}",
                           buffer_steps=10_000, buffer_bytes=3 * 1024)
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    try:
        for i in range(20):  # ~1 KB each: 64 token ids a block, 4 blocks
            hashes = [1000 + 4 * i + j for j in range(4)]
            pub.publish([block_stored(hashes, None, list(range(256)), 64)])
        deadline = time.monotonic() + 5
        while pub.published < 20:
            assert time.monotonic() < deadline, "publisher thread stuck"
            time.sleep(0.01)
        kept = [s for s, _ in pub._buffer]
        assert 1 <= len(kept) < 20 and kept == list(range(20 - len(kept), 20))
        assert sum(len(p) for _, p in pub._buffer) <= 3 * 1024 or len(kept) == 1
        (seq, snap), = sub.replay(0)  # older than the log: the state instead
        assert seq == 19 and isinstance(snap.events[0], AllBlocksCleared)
        assert len(held_set(snap.events)) == 80
        assert [s for s, _ in sub.replay(kept[0])] == kept
    finally:
        sub.close()
        pub.close()
