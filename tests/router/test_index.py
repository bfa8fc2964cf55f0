"""PrefixIndex: holders, tiers, runs, speculation, clearing."""

import random

import pytest

from agentserve.router.index import PrefixIndex, block_key

A, B, C = ("http://a", 0), ("http://b", 0), ("http://b", 1)


def test_block_key_int_and_bytes_agree():
    h = bytes(range(32))
    assert block_key(h) == int.from_bytes(h, "big") & (2**64 - 1)
    assert block_key(int.from_bytes(h, "big")) == block_key(h)


def test_runs_stop_at_first_hole_exact():
    idx = PrefixIndex(exact=True)
    keys = list(range(100, 110))
    idx.store(A, keys[:6])
    idx.store(B, keys[:3] + keys[4:])  # hole at block 3
    m = idx.match(keys)
    assert m.best_run(A) == 6
    assert m.best_run(B) == 3
    assert m.best_run(C) == 0


@pytest.mark.parametrize("exact", [True, False])
def test_remove_and_clear(exact):
    idx = PrefixIndex(exact=exact)
    keys = [1, 2, 3]
    idx.store(A, keys)
    idx.store(B, keys)
    idx.remove(A, [2] if exact else [3])  # bisect mode assumes tail-first eviction
    assert idx.match(keys).best_run(A) == (1 if exact else 2)
    assert idx.clear_holder(B) == 3
    assert idx.match(keys).best_run(B) == 0
    assert idx.match(keys).best_run(A) == (1 if exact else 2)


@pytest.mark.parametrize("exact", [True, False])
def test_tiers_weighted(exact):
    idx = PrefixIndex({"GPU": 1.0, "CPU": 0.8}, exact)
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


@pytest.mark.parametrize("exact", [True, False])
def test_many_holders_one_pass(exact):
    idx = PrefixIndex(exact=exact)
    keys = list(range(1000))
    for e in range(100):
        idx.store((f"e{e}", 0), keys[: 10 * (e + 1)])
    m = idx.match(keys)
    assert all(m.best_run((f"e{e}", 0)) == 10 * (e + 1) for e in range(100))
    assert len(idx) == 1000 and idx.memory_bytes() > 0


def test_bisect_equals_exact_on_prefix_closed_holdings():
    rng = random.Random(5)
    keys = list(range(5000))
    ex, bi = PrefixIndex(exact=True), PrefixIndex()
    for h in range(40):
        run = rng.choice([0, 1, 17, 300, 4999, 5000, rng.randrange(5000)])
        for idx in (ex, bi):
            idx.store((f"e{h}", 0), keys[:run])
    bi.speculate(("e3", 0), keys[:2000], 5.0)
    ex.speculate(("e3", 0), keys[:2000], 5.0)
    for q in (keys, keys[:100], keys[:1] + [99999]):
        a, b = ex.match(q), bi.match(q)
        assert {h: r for h, r in a.runs.items() if r[-1]} == {h: r for h, r in b.runs.items() if r[-1]}
