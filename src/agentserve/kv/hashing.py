"""Chained block hashes, byte-compatible with vLLM 0.32 prefix caching.

A block hash is ``H((parent or NONE_HASH, tuple(block_token_ids), extra_keys))`` over
*full* blocks only, so one hash fingerprints the whole prefix ending at that block
(vllm/v1/core/kv_cache_utils.py:695 ``hash_block_tokens``). Algorithms:

- ``"sha256_cbor"`` (default): sha256 of canonical CBOR, identical to vLLM's
  ``sha256_cbor`` (vllm/utils/hashing.py:43). Hashes agree with a vLLM started with the
  same ``PYTHONHASHSEED`` and block size.
- ``"fast"``: blake2b-128 over the parent digest, the token count and the tokens packed as
  little-endian int64, plus canonical CBOR of the extra keys. Same chain structure;
  internal use only (never matches vLLM).

NONE_HASH (the parent of block 0) is ``H(seed)``. vLLM 0.32 resolves the seed as
PYTHONHASHSEED if set, else the fixed ``"vllm-none-hash"`` for cryptographic algorithms
(kv_cache_utils.py:122-144); it only uses random bytes for xxhash. We do the same (both of
our algorithms are cryptographic), and the seed can be passed explicitly.

Speed (shared 2-core dev box, 200K random tokens at block size 16 = 12,500 blocks):
``hash_blocks`` sha256_cbor 2.3 µs/block (28 ms), fast 1.5 µs/block (19 ms); vLLM's own
per-block ``cbor2.dumps`` + sha256 is ~3.2 µs/block on the same box. ``extend`` by one
block at a time (decode): 4.7 / 3.2 µs/block. The whole prompt's tokens are CBOR-encoded
in one cbor2 call (C) and split with numpy, so each block costs one C-level hash call.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import cbor2
import numpy as np

BlockHash = bytes
ExtraKeys = tuple[Any, ...] | None
Algo = Literal["sha256_cbor", "fast"]
ALGOS: tuple[str, ...] = ("sha256_cbor", "fast")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_CBOR_NONE = b"\xf6"
# Below this many blocks numpy's fixed overhead (~20 µs) costs more than it saves.
_VECTOR_MIN_BLOCKS = 8


def resolve_seed(seed: str | None = None) -> str:
    """The NONE_HASH seed: ``seed``, else PYTHONHASHSEED, else vLLM's fixed default."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def none_hash(algo: str = "sha256_cbor", seed: str | None = None) -> BlockHash:
    """The parent hash used for the first block: ``H(seed)`` as in vLLM's init_none_hash."""
    return _none_hash(algo, resolve_seed(seed))


@lru_cache(maxsize=64)
def _none_hash(algo: str, s: str) -> BlockHash:
    if algo == "sha256_cbor":
        return hashlib.sha256(cbor2.dumps(s, canonical=True)).digest()
    if algo == "fast":
        return hashlib.blake2b(s.encode(), digest_size=16, person=b"agsv-none").digest()
    raise ValueError(f"unknown hash algo {algo!r}; choose one of {ALGOS}")


def _cbor_uint_header(major: int, n: int) -> bytes:
    """CBOR head for major type ``major`` with argument ``n`` (shortest form)."""
    if n < 24:
        return bytes([major << 5 | n])
    for code, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | code]) + n.to_bytes(width, "big")
    raise ValueError(f"CBOR argument {n} does not fit in 64 bits")


def encode_tokens_cbor(token_ids: Sequence[int]) -> tuple[bytes, np.ndarray] | None:
    """Canonical CBOR items of all token ids, concatenated, and the byte offset of each.

    ``offsets`` has ``len(token_ids) + 1`` entries. cbor2 encodes the whole list in C;
    numpy recovers the item boundaries from each id's CBOR width. Returns None for ids
    outside int64 so callers can fall back to per-block cbor2.
    """
    try:
        if isinstance(token_ids, np.ndarray):
            arr = token_ids.astype(np.int64, copy=False)
            items = cbor2.dumps(arr.tolist(), canonical=True)
        else:
            arr = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
            items = cbor2.dumps(list(token_ids), canonical=True)
    except (OverflowError, TypeError):
        return None
    arg = np.where(arr < 0, -1 - arr, arr)  # CBOR negative ints carry -1-n
    widths = 1 + (arg >= 24) + (arg >= 256) + 2 * (arg >= 65536) + 4 * (arg >= 1 << 32)
    offsets = np.zeros(arr.size + 1, dtype=np.int64)
    np.cumsum(widths, out=offsets[1:])
    # Skip the list's own CBOR head; only the items are wanted.
    return items[len(items) - int(offsets[-1]) :], offsets


def pack_tokens_i64(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (the ``fast`` algo's input)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i8").tobytes()
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


@dataclass(slots=True)
class BlockHasher:
    """Hashes full blocks of a token list into a parent-chained list of BlockHash.

    ``extra_keys`` (LoRA name, multimodal ids, cache salt...) are per block: a sequence
    whose i-th entry is the extra-keys tuple (or None) of the i-th full block of the
    ``token_ids`` passed in, exactly what vLLM feeds ``hash_block_tokens``.
    """

    algo: str = "sha256_cbor"
    block_size: int = 16
    seed: str | None = None
    none_hash: BlockHash = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        self.none_hash = none_hash(self.algo, self.seed)  # also validates algo

    def hash_block(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None
    ) -> BlockHash:
        """One block's hash given its parent (None/b"" for the first block)."""
        return self._hash_run(parent, token_ids, 1, [extra_keys])[0]

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        parent: BlockHash | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``; a trailing partial block is skipped."""
        n = len(token_ids) // self.block_size
        return self._hash_run(parent, token_ids[: n * self.block_size], n, extra_keys)

    def extend(
        self,
        existing: list[BlockHash],
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKeys] | None = None,
    ) -> None:
        """Append hashes for blocks of ``token_ids`` (the whole request) completed since.

        ``existing`` holds the hashes of the first ``len(existing)`` blocks; it is mutated.
        ``extra_keys`` is indexed by absolute block number.
        """
        bs = self.block_size
        start, end = len(existing), len(token_ids) // bs
        if end <= start:
            return
        parent = existing[-1] if existing else None
        extras = None if extra_keys is None else extra_keys[start:end]
        new = self._hash_run(parent, token_ids[start * bs : end * bs], end - start, extras)
        existing.extend(new)

    def _hash_run(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        n: int,
        extra_keys: Sequence[ExtraKeys] | None,
    ) -> list[BlockHash]:
        if len(token_ids) != n * self.block_size:
            raise ValueError(
                f"expected {n} full blocks of {self.block_size} tokens, got {len(token_ids)} tokens"
            )
        if extra_keys is not None and len(extra_keys) < n:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n} blocks")
        if n == 0:
            return []
        parent = parent or self.none_hash  # vLLM: `if not parent_block_hash`
        if self.algo == "fast":
            return _chain_fast(parent, token_ids, n, self.block_size, extra_keys)
        return _chain_sha256_cbor(parent, token_ids, n, self.block_size, extra_keys)


def _extra_cbor(extra_keys: Sequence[ExtraKeys] | None, i: int) -> bytes:
    if extra_keys is None or extra_keys[i] is None:
        return _CBOR_NONE
    return cbor2.dumps(extra_keys[i], canonical=True)


def _chain_sha256_cbor(
    parent: BlockHash,
    token_ids: Sequence[int],
    n: int,
    bs: int,
    extra_keys: Sequence[ExtraKeys] | None,
) -> list[BlockHash]:
    # Hand-built CBOR of (parent, tokens, extra): array(3), bytes(parent), array(bs) of
    # ints, extra. CBOR is compositional, so concatenating canonical parts is canonical.
    encoded = encode_tokens_cbor(token_ids) if n >= _VECTOR_MIN_BLOCKS else None
    if encoded is None:
        return _chain_cbor2(parent, token_ids, n, bs, extra_keys)
    data, offsets = encoded
    cuts = offsets[::bs].tolist()
    arr_head = _cbor_uint_header(4, bs)
    head = b"\x83" + _cbor_uint_header(2, len(parent))
    sha256 = hashlib.sha256
    out: list[BlockHash] = []
    for i in range(n):
        if i == 1:  # NONE_HASH and our digests are both 32 bytes, but a caller's may not be
            head = b"\x83" + _cbor_uint_header(2, len(parent))
        parent = sha256(
            head + parent + arr_head + data[cuts[i] : cuts[i + 1]] + _extra_cbor(extra_keys, i)
        ).digest()
        out.append(parent)
    return out


def _chain_cbor2(
    parent: BlockHash,
    token_ids: Sequence[int],
    n: int,
    bs: int,
    extra_keys: Sequence[ExtraKeys] | None,
) -> list[BlockHash]:
    if isinstance(token_ids, np.ndarray):
        token_ids = token_ids.tolist()  # cbor2 cannot encode numpy scalars
    out: list[BlockHash] = []
    for i in range(n):
        extra = None if extra_keys is None else extra_keys[i]
        key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra)
        parent = hashlib.sha256(cbor2.dumps(key, canonical=True)).digest()
        out.append(parent)
    return out


def _chain_fast(
    parent: BlockHash,
    token_ids: Sequence[int],
    n: int,
    bs: int,
    extra_keys: Sequence[ExtraKeys] | None,
) -> list[BlockHash]:
    data = pack_tokens_i64(token_ids)
    width = 8 * bs
    # The length prefix and fixed-width tokens keep the byte string unambiguous.
    count = bs.to_bytes(4, "little")
    blake2b = hashlib.blake2b
    out: list[BlockHash] = []
    for i in range(n):
        parent = blake2b(
            parent + count + data[i * width : (i + 1) * width] + _extra_cbor(extra_keys, i),
            digest_size=16,
        ).digest()
        out.append(parent)
    return out


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
    *,
    algo: str = "sha256_cbor",
    seed: str | None = None,
) -> BlockHash:
    """``H((parent or NONE_HASH, tuple(token_ids), extra_keys))`` for one full block."""
    return BlockHasher(algo, len(token_ids) or 1, seed).hash_block(parent, token_ids, extra_keys)


def use_int_hashes() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default "1", vllm/envs.py:2033)."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


def to_external(h: BlockHash, as_int: bool | None = None) -> int | bytes:
    """The value vLLM 0.32 puts in KV events for a block hash.

    By default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) the low 64 bits, i.e. the last
    8 bytes read big-endian (kv_cache_utils.py:96 ``maybe_convert_block_hash``);
    with the env var set to 0, the raw bytes.
    """
    if as_int is None:
        as_int = use_int_hashes()
    if not as_int:
        return h
    return int.from_bytes(h[-8:], "big")
