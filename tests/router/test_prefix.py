"""HashCache: same keys as hashing from scratch, and only new blocks hashed."""

import random

import cbor2
import hashlib

from agentserve.kv.hashing import BlockHasher, to_external
from agentserve.router.index import block_key
from agentserve.router.prefix import HashCache


def ref_keys(tokens, bs, seed):
    """vLLM's algorithm written out independently (sha256 of canonical CBOR)."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // bs):
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i * bs:(i + 1) * bs]), None),
                                            canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def test_keys_match_vllm_reference_and_external():
    rng = random.Random(0)
    toks = [rng.randrange(100000) for _ in range(5000)]
    cache = HashCache(BlockHasher("sha256_cbor", 16, "0"), chunk_blocks=8)
    ph = cache.keys_for_tokens(toks)
    assert list(ph.keys) == ref_keys(toks, 16, "0")
    digests = [ph.parent(i) for i in range(len(ph))]
    assert digests == cache.hasher.hash_blocks(toks)
    assert list(ph.keys) == [block_key(to_external(h, as_int=True)) for h in digests]


def test_growth_hashes_only_new_blocks():
    rng = random.Random(1)
    toks = [rng.randrange(50000) for _ in range(20000)]
    cache = HashCache(BlockHasher("sha256_cbor", 16, None), chunk_blocks=16)
    first = cache.keys_for_tokens(toks)
    n0 = cache.hashed_blocks
    assert n0 == 20000 // 16
    grown = toks + [rng.randrange(50000) for _ in range(700)]
    ph = cache.keys_for_tokens(grown)
    assert ph.keys[: len(first.keys)] == first.keys
    assert cache.hashed_blocks - n0 < 16 + 700 // 16 + 2
    assert list(ph.keys) == [block_key(h) for h in cache.hasher.hash_blocks(grown)]


def test_edit_in_middle_rehashes_from_edit():
    rng = random.Random(2)
    toks = [rng.randrange(50000) for _ in range(8192)]
    cache = HashCache(BlockHasher("sha256_cbor", 16, None), chunk_blocks=16)
    cache.keys_for_tokens(toks)
    edited = list(toks)
    edited[5000] += 1
    ph = cache.keys_for_tokens(edited)
    assert list(ph.keys) == [block_key(h) for h in cache.hasher.hash_blocks(edited)]


def test_extend_from_shared_prefix():
    rng = random.Random(3)
    toks = [rng.randrange(50000) for _ in range(1000)]
    cache = HashCache(BlockHasher("sha256_cbor", 16, None))
    prev = cache.keys_for_tokens(toks)
    new = toks[:900] + [1, 2, 3] * 50
    ph = cache.extend(prev, 900, new)
    assert list(ph.keys) == [block_key(h) for h in cache.hasher.hash_blocks(new)]
