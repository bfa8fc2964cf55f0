"""A request's block keys, computed once per distinct prefix and reused across turns.

Hashing a 200K-token prompt with sha256_cbor costs ~12 ms (12,500 blocks of 16); an
agent's next turn repeats the previous prompt and appends ~600 tokens, so the router
must hash only the new blocks. Two ways in:

- `keys_for_tokens` (token-id prompts): a trie of *chunks* of `chunk_blocks` blocks.
  A chunk's node is found by a chained fingerprint ``hash((parent_fp, msgpack(chunk)))``
  (msgspec encodes ~4 ns per token; faster than hashing a tuple of ints), and holds the
  chunk's block hashes. Walking 200K tokens is ~200 dict hits; only the chunks past the shared prefix
  (and the trailing partial chunk) are hashed. The trie is an LRU of chunks.
- `extend` (chat prompts): the tokenizer cache already knows how many leading tokens a
  prompt shares with a cached one; reuse that many full blocks and hash the rest.

Keys are `index.block_key(hash)` (the digest's low 64 bits, `to_external`): what the
engines publish in KV events.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from agentserve.kv.hashing import BlockHasher

_ENC = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class PromptHashes:
    """Full-block hashes of one prompt: raw digests back to back (chain parents) and the
    index keys as an unsigned 64-bit array.

    Flat buffers rather than lists of objects: 40 bytes a block instead of ~110, and
    nothing for the garbage collector to walk (a young list of 12,500 hashes per 200K-token
    turn made gen-0 collections take up to 10 ms inside a decision)."""

    raw: bytes
    keys: array
    size: int = 32  # digest bytes

    def __len__(self) -> int:
        return len(self.keys)

    def parent(self, i: int) -> bytes:
        """Digest of block `i` (the chain parent of block i + 1)."""
        return self.raw[i * self.size:(i + 1) * self.size]

    def prefix(self, k: int) -> PromptHashes:
        return PromptHashes(self.raw[:k * self.size], self.keys[:k], self.size)

    def __add__(self, other: PromptHashes) -> PromptHashes:
        return self.prefix_plus(len(self), other)

    def prefix_plus(self, k: int, other: PromptHashes) -> PromptHashes:
        """The first `k` blocks followed by `other`'s, copying each byte once (a 200K-token
        prompt's hashes are ~500 KB: slicing then concatenating copied them twice)."""
        raw = b"".join((memoryview(self.raw)[:k * self.size], other.raw))
        keys = self.keys[:k] if k < len(self.keys) else array("Q", self.keys)
        keys += other.keys
        return PromptHashes(raw, keys, self.size)

    @classmethod
    def of(cls, digests: list[bytes]) -> PromptHashes:
        """From the hasher's digests; keys are `index.block_key`: the low 64 bits."""
        if not digests:
            return cls(b"", array("Q"))
        size = len(digests[0])
        raw = b"".join(digests)
        low = np.frombuffer(raw, np.uint8).reshape(-1, size)[:, size - 8:]
        keys = array("Q", np.ascontiguousarray(low).view(">u8").astype(np.uint64).tobytes())
        return cls(raw, keys, size)

    @classmethod
    def join(cls, parts: list[PromptHashes]) -> PromptHashes:
        if not parts:
            return cls(b"", array("Q"))
        keys = array("Q")
        for p in parts:
            keys += p.keys
        return cls(b"".join(p.raw for p in parts), keys, parts[0].size)


def hasher_id(algo: str, block_size: int, seed: str | None) -> tuple[str, int, str | None]:
    return (algo, block_size, seed)


class HashCache:
    """Chunk trie of block hashes for one hasher (algo, block size, seed)."""

    def __init__(self, hasher: BlockHasher, chunk_blocks: int = 128,
                 max_chunks: int = 65536) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.chunk_blocks = chunk_blocks
        self.chunk_tokens = chunk_blocks * hasher.block_size
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, PromptHashes] = OrderedDict()
        self._tails: OrderedDict[int, tuple[list[int], PromptHashes]] = OrderedDict()
        self.hashed_blocks = 0  # blocks actually hashed (cache misses), for tests/metrics

    def _hash(self, tokens: Sequence[int], parent: bytes | None) -> PromptHashes:
        raw = self.hasher.hash_blocks(tokens, parent=parent)
        self.hashed_blocks += len(raw)
        return PromptHashes.of(raw)

    def keys_for_tokens(self, tokens: Sequence[int]) -> PromptHashes:
        """Hashes of every full block of `tokens`, reusing cached chunks."""
        if not isinstance(tokens, list):  # the tokenizer's int32 Seq/array: msgpack needs a list
            tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        ct, chunks = self.chunk_tokens, self._chunks
        nodes: list[PromptHashes] = []
        parent: bytes | None = None
        fp, enc = 0, _ENC.encode
        n_full = len(tokens) // ct
        for c in range(n_full):
            piece = tokens[c * ct:(c + 1) * ct]
            fp = hash((fp, enc(piece)))
            node = chunks.get(fp)
            if node is None:
                node = self._hash(piece, parent)
                chunks[fp] = node
                if len(chunks) > self.max_chunks:
                    chunks.popitem(last=False)
            else:
                chunks.move_to_end(fp)
            nodes.append(node)
            parent = node.parent(len(node) - 1)
        tail = tokens[n_full * ct:]
        if len(tail) >= self.block_size:
            nodes.append(self._tail(fp, tail, parent))
        return PromptHashes.join(nodes)

    def _tail(self, fp: int, tail: list[int], parent: bytes | None) -> PromptHashes:
        """Blocks of a partial last chunk; a grown tail reuses the last one's blocks."""
        prev = self._tails.get(fp)
        bs = self.block_size
        if prev is not None:
            old_tokens, old = prev
            n = min(len(old_tokens), len(tail)) // bs * bs
            if n and tail[:n] == old_tokens[:n]:
                keep = n // bs
                node = old.prefix_plus(keep, self._hash(tail[n:], old.parent(keep - 1)))
                self._tails[fp] = (tail, node)
                return node
        node = self._hash(tail, parent)
        self._tails[fp] = (tail, node)
        self._tails.move_to_end(fp)
        if len(self._tails) > self.max_chunks // 8:
            self._tails.popitem(last=False)
        return node

    def extend(self, prev: PromptHashes | None, shared_tokens: int,
               tokens: list[int]) -> PromptHashes:
        """Hashes of `tokens` given that its first `shared_tokens` equal `prev`'s prompt."""
        if prev is None:
            return self.keys_for_tokens(tokens)
        keep = min(shared_tokens // self.block_size, len(prev))
        rest = tokens[keep * self.block_size:]
        if len(rest) < self.block_size:
            return prev.prefix(keep)
        return prev.prefix_plus(keep, self._hash(rest, prev.parent(keep - 1) if keep else None))

    def __len__(self) -> int:
        return len(self._chunks)
