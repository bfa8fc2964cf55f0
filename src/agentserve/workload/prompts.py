"""Deterministic prompts from hash ids: equal ids give equal tokens, so prefix reuse survives.

A trace lists each input as hash ids, one per `block_size` tokens. We map every
(scope, hash id) to a fixed block of token ids with a counter-based generator
(splitmix64), so no state or cache is needed and any process rebuilds the same prompt.
The scope is the session id for `hash_id_scope: local` traces (ids repeat across
sessions but mean different content) and a shared scope otherwise.

Token scaling: `--token-scale K` sends K tokens per trace block instead of `block_size`,
so a CPU engine replays a 100K-token session with the same block-reuse structure;
input lengths scale by K / block_size. The last block is cut so that the prompt has
exactly the scaled input length.

Chat prompts are words that are one token each in the served vocabulary, fewer by the
chat template's own tokens (`workload.chatfit`), so the server counts the same length.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from agentserve.workload.chatfit import ChatFit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
SPECIAL_MARGIN = 16  # ids [0, 16) and [vocab-16, vocab) hold BOS/EOS/pad in most vocabularies


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over a uint64 array (wraps modulo 2**64 by design)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _key(text: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def scaled_length(tokens: int, block_size: int, block_tokens: int) -> int:
    """Input length after shrinking each `block_size` block to `block_tokens` tokens (>= 1)."""
    if block_tokens == block_size:
        return tokens
    return max(1, round(tokens * block_tokens / block_size))


class PromptBuilder:
    """Builds token-id prompts (for /v1/completions) or chat text (fitted words) from hash ids."""

    def __init__(self, vocab_size: int = 4000, seed: int = 0) -> None:
        if vocab_size <= 2 * SPECIAL_MARGIN:
            raise ValueError(f"vocab_size {vocab_size} leaves no safe token range; use > {2 * SPECIAL_MARGIN}")
        self.vocab_size = vocab_size
        self.seed = seed
        self._lo = SPECIAL_MARGIN
        self._span = np.uint64(vocab_size - 2 * SPECIAL_MARGIN)
        self._scope_keys: dict[str, np.uint64] = {}

    def _scope_key(self, scope: str) -> np.uint64:
        k = self._scope_keys.get(scope)
        if k is None:
            k = self._scope_keys[scope] = _key(f"{self.seed}:{scope}")
        return k

    def _blocks(self, base: np.ndarray, block_tokens: int) -> np.ndarray:
        # base: [B] uint64 block keys -> [B, block_tokens] token ids in [lo, vocab - lo)
        offs = np.arange(block_tokens, dtype=np.uint64) * _GOLDEN
        return (_mix(base[:, None] ^ offs[None, :]) % self._span).astype(np.int64) + self._lo

    def token_array(self, scope: str, hash_ids: list[int], n_tokens: int, block_tokens: int,
                    uid: str = "") -> np.ndarray:
        """`n_tokens` ids: blocks of `block_tokens` per hash id, the last cut, padded if ids run short.

        Padding (a trace whose `in` exceeds its blocks) uses a key unique to `uid`, so
        it is never mistaken for shared content.
        """
        need = -(-n_tokens // block_tokens)
        ids = np.asarray(hash_ids[:need], dtype=np.int64).astype(np.uint64)
        toks = self._blocks(_mix(ids) ^ self._scope_key(scope), block_tokens).reshape(-1)
        if toks.size < n_tokens:
            pad_blocks = -(-(n_tokens - toks.size) // block_tokens)
            pad_base = _mix(np.arange(pad_blocks, dtype=np.uint64) ^ _key(f"{scope}#pad#{uid}"))
            toks = np.concatenate([toks, self._blocks(pad_base, block_tokens).reshape(-1)])
        return toks[:n_tokens]

    def tokens(self, scope: str, hash_ids: list[int], n_tokens: int, block_tokens: int,
               uid: str = "") -> list[int]:
        """Token-id prompt as a list (what `/v1/completions` takes)."""
        return self.token_array(scope, hash_ids, n_tokens, block_tokens, uid).tolist()

    def text(self, fit: ChatFit, scope: str, hash_ids: list[int], n_tokens: int, block_tokens: int,
             uid: str = "") -> str:
        """Chat content that the served tokenizer makes `n_tokens` tokens once its template
        wraps it: one one-token word per id of the first `n_tokens - overhead` (see chatfit.py)."""
        toks = self.token_array(scope, hash_ids, fit.content_tokens(n_tokens), block_tokens, uid)
        return fit.text(toks)


class ReuseTracker:
    """The reusable ceiling: what an infinite prefix cache could serve, given the order sent.

    For each request, the longest prefix of whole trace blocks (same scope) that any
    earlier request also sent, counted in sent tokens. Prefixes are keyed by a chained
    hash, so the lookup is one dict probe per block and stops at the first miss.
    """

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # chained prefix key -> tokens of it some request sent

    def observe(self, scope: str, hash_ids: list[int], n_tokens: int, block_tokens: int) -> int:
        """Return the reusable tokens of this request, then remember its prefixes."""
        seen = self._seen
        h = hash(scope)
        keys: list[int] = []
        for i, hid in enumerate(hash_ids):
            if i * block_tokens >= n_tokens:
                break  # blocks past the (scaled) input were never sent
            h = hash((h, hid))
            keys.append(h)
        reusable = 0
        for k in keys:
            cov = seen.get(k)
            if cov is None:
                break
            reusable = cov
        for i, k in enumerate(keys):
            cov = min((i + 1) * block_tokens, n_tokens)
            if seen.get(k, -1) < cov:
                seen[k] = cov
        return min(reusable, n_tokens)

    def __len__(self) -> int:
        return len(self._seen)
