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

Keys are `index.block_key(to_external(hash))`: what the engines publish in KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from dataclasses import dataclass

import msgspec

from agentserve.kv.hashing import BlockHasher
from agentserve.router.index import block_key

_ENC = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class PromptHashes:
    """Full-block hashes of one prompt: raw (chain parents) and index keys."""

    raw: list[bytes]
    keys: list[int]


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

    def _hash(self, tokens: list[int], parent: bytes | None) -> PromptHashes:
        raw = self.hasher.hash_blocks(tokens, parent=parent)
        self.hashed_blocks += len(raw)
        return PromptHashes(raw, [block_key(h) for h in raw])

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
            parent = node.raw[-1]
        tail = tokens[n_full * ct:]
        if len(tail) >= self.block_size:
            nodes.append(self._tail(fp, tail, parent))
        # One C-level concatenation instead of growing two lists chunk by chunk.
        return PromptHashes(list(chain.from_iterable(n.raw for n in nodes)),
                            list(chain.from_iterable(n.keys for n in nodes)))

    def _tail(self, fp: int, tail: list[int], parent: bytes | None) -> PromptHashes:
        """Blocks of a partial last chunk; a grown tail reuses the last one's blocks."""
        prev = self._tails.get(fp)
        bs = self.block_size
        if prev is not None:
            old_tokens, old = prev
            n = min(len(old_tokens), len(tail)) // bs * bs
            if n and tail[:n] == old_tokens[:n]:
                keep = n // bs
                rest = self._hash(tail[n:], old.raw[keep - 1])
                node = PromptHashes(old.raw[:keep] + rest.raw, old.keys[:keep] + rest.keys)
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
        keep = min(shared_tokens // self.block_size, len(prev.raw))
        raw, keys = prev.raw[:keep], prev.keys[:keep]
        rest = tokens[keep * self.block_size:]
        if len(rest) >= self.block_size:
            node = self._hash(rest, raw[-1] if raw else None)
            raw += node.raw
            keys += node.keys
        return PromptHashes(raw, keys)

    def __len__(self) -> int:
        return len(self._chunks)
