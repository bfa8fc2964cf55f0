import hashlib

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.hashing import BlockHasher, hash_block, none_hash, to_external
from tests.kv.conftest import VECTORS, vtokens

SEEDS = {"default": None, "0": "0", "42": "42"}


@pytest.mark.parametrize("seed_name", list(SEEDS))
@pytest.mark.parametrize("bs", [16, 128])
def test_matches_vllm_known_answers(seed_name, bs, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    exp = VECTORS["hashes"][seed_name]
    h = BlockHasher("sha256_cbor", bs, SEEDS[seed_name])
    assert h.none_hash.hex() == exp["none_hash"]
    chain = h.hash_blocks(vtokens(3 * bs + 5))  # trailing partial block ignored
    assert [c.hex() for c in chain] == exp[str(bs)]["chain"]
    assert [to_external(c) for c in chain] == exp[str(bs)]["external"]
    with_parent = h.hash_block(bytes.fromhex("ab" * 32), vtokens(bs))
    assert with_parent.hex() == exp[str(bs)]["with_parent_ab"]
    salted = h.hash_block(None, vtokens(bs), (("cache_salt", "salt1"),))
    assert salted.hex() == exp[str(bs)]["salted"]


def test_seed_from_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert BlockHasher(block_size=16).none_hash.hex() == VECTORS["hashes"]["42"]["none_hash"]


def test_to_external_modes(monkeypatch):
    h = bytes(range(32))
    assert to_external(h) == int.from_bytes(h[-8:], "big")
    assert to_external(h, as_int=False) is h
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert to_external(h) is h


@settings(max_examples=100, deadline=None)
@given(
    toks=st.lists(st.integers(-(2**40), 2**40), max_size=200),
    bs=st.sampled_from([1, 3, 4, 16]),
    algo=st.sampled_from(["sha256_cbor", "fast"]),
    cut=st.integers(0, 200),
)
def test_extend_equals_one_shot(toks, bs, algo, cut):
    h = BlockHasher(algo, bs, "0")
    grown: list[bytes] = []
    h.extend(grown, toks[:cut])
    h.extend(grown, toks)
    h.extend(grown, toks)  # idempotent once up to date
    assert grown == h.hash_blocks(toks)
    assert h.hash_blocks(np.array(toks, dtype=np.int64)) == grown


@settings(max_examples=100, deadline=None)
@given(toks=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=4, max_size=40))
def test_sha256_cbor_equals_reference_encoding(toks):
    """The vectorised CBOR path equals cbor2 over the (parent, tuple, extra) triple."""
    h = BlockHasher("sha256_cbor", 4, "7")
    parent, ref = h.none_hash, []
    for i in range(len(toks) // 4):
        key = (parent, tuple(toks[4 * i : 4 * i + 4]), None)
        parent = hashlib.sha256(cbor2.dumps(key, canonical=True)).digest()
        ref.append(parent)
    assert h.hash_blocks(toks) == ref
    assert h.hash_blocks(toks * 3)[: len(ref)] == ref  # the vectorised (>= 8 blocks) path


def test_fast_is_deterministic_and_chain_sensitive():
    a, b = BlockHasher("fast", 4, "s"), BlockHasher("fast", 4, "s")
    toks = list(range(12))
    assert a.hash_blocks(toks) == b.hash_blocks(toks)
    assert len(a.hash_blocks(toks)[0]) == 16
    other = a.hash_blocks([99, 1, 2, 3] + toks[4:])
    assert all(x != y for x, y in zip(other, a.hash_blocks(toks)))  # change propagates
    assert BlockHasher("fast", 4, "t").hash_blocks(toks)[0] != a.hash_blocks(toks)[0]
    assert a.hash_block(None, [0, 1, 2, 3], ("x",)) != a.hash_block(None, [0, 1, 2, 3])
    assert hash_block(None, [1, 2], algo="fast", seed="s") != hash_block(None, [1, 2], seed="s")


def test_empty_parent_is_none_hash_and_errors():
    h = BlockHasher(block_size=2, seed="0")
    assert h.hash_block(b"", [1, 2]) == h.hash_block(None, [1, 2])  # vLLM: `if not parent`
    assert none_hash("sha256_cbor", "0") == h.none_hash
    with pytest.raises(ValueError, match="unknown hash algo"):
        BlockHasher("md5", 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size=0)
    with pytest.raises(ValueError, match="extra_keys"):
        h.hash_blocks([1, 2, 3, 4], extra_keys=[None])
