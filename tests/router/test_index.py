"""PrefixIndex: holders, tiers, runs, speculation, clearing."""

from agentserve.router.index import PrefixIndex, block_key

A, B, C = ("http://a", 0), ("http://b", 0), ("http://b", 1)


def test_block_key_int_and_bytes_agree():
    h = bytes(range(32))
    assert block_key(h) == int.from_bytes(h, "big") & (2**64 - 1)
    assert block_key(int.from_bytes(h, "big")) == block_key(h)


def test_runs_stop_at_first_hole():
    idx = PrefixIndex()
    keys = list(range(100, 110))
    idx.store(A, keys[:6])
    idx.store(B, keys[:3] + keys[4:])  # hole at block 3
    m = idx.match(keys)
    assert m.best_run(A) == 6
    assert m.best_run(B) == 3
    assert m.best_run(C) == 0


def test_remove_and_clear():
    idx = PrefixIndex()
    keys = [1, 2, 3]
    idx.store(A, keys)
    idx.store(B, keys)
    idx.remove(A, [2])
    assert idx.match(keys).best_run(A) == 1
    assert idx.clear_holder(B) == 3
    assert idx.match(keys).best_run(B) == 0
    assert idx.match(keys).best_run(A) == 1


def test_tiers_weighted():
    idx = PrefixIndex({"GPU": 1.0, "CPU": 0.8})
    keys = [1, 2, 3, 4]
    idx.store(A, keys[:2], "GPU")
    idx.store(A, keys[2:], "CPU")
    m = idx.match(keys)
    assert m.best_run(A) == 4
    assert m.weighted(A, {"GPU": 1.0, "CPU": 0.8}) == 2 + 2 * 0.8


def test_speculation_expires():
    idx = PrefixIndex()
    idx.speculate(A, [7, 8], ttl_s=1.0, now=100.0)
    assert idx.match([7, 8], now=100.5).best_run(A) == 2
    assert idx.match([7, 8], now=101.5).best_run(A) == 0
    assert not idx._spec


def test_drop_endpoint_frees_bits():
    idx = PrefixIndex()
    idx.store(B, [1])
    idx.store(C, [1])
    idx.store(A, [1])
    idx.drop_endpoint("http://b")
    assert idx.match([1]).runs.keys() == {A}
    assert idx.bit(("http://d", 0)) == 1  # bit 0 reused


def test_many_holders_one_pass():
    idx = PrefixIndex()
    keys = list(range(1000))
    for e in range(100):
        idx.store((f"e{e}", 0), keys[: 10 * (e + 1)])
    m = idx.match(keys)
    assert all(m.best_run((f"e{e}", 0)) == 10 * (e + 1) for e in range(100))
    assert len(idx) == 1000 and idx.memory_bytes() > 0
