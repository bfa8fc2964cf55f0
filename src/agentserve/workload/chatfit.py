"""Chat prompts of an exact token count, fitted to the tokenizer the server uses.

A completions prompt is token ids, so its length is exact. A chat prompt is text the
server tokenizes after its chat template wraps it, so we build the text from words
that are one token each in that vocabulary (" ab", " cat", ...): with a byte-level BPE
(or SentencePiece) a space starts a new pre-token, so n such words are exactly n
tokens, whatever their order, and equal hash ids still give equal text (prefix caching
hits as with token ids). The template's own tokens (roles, a default system prompt)
are measured once and subtracted from every request.

The tokenizer is the server's (`POST /tokenize`, which our engine, our router and vLLM
answer) unless `--tokenizer` names a local one (an HF model folder or a .gguf file).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np

MIN_WORDS = 64  # fewer one-token words than this: refuse rather than send odd prompts
_CHUNK = 1024  # candidate words per /tokenize call (a few thousand tokens: below any max_model_len)
_WORD_START = (" ", "\u0120", "\u2581")  # a space as text, as byte-level BPE writes it, as SentencePiece


def candidates() -> list[str]:
    """Every lowercase word of 2-3 letters, in a fixed order (English vocabularies hold ~1.4K
    of them as one token with a leading space; our tiny code-trained one ~270)."""
    a = string.ascii_lowercase
    return [x + y for x in a for y in a] + [x + y + z for x in a for y in a for z in a]


class TokenSource(Protocol):
    """What fitting needs from a tokenizer: token strings of a text, and a chat's length."""

    async def pieces(self, text: str) -> list[str]: ...

    async def chat_count(self, messages: list[dict[str, Any]]) -> int: ...


class ServerTokens:
    """The server's tokenizer through its `/tokenize` endpoint (vLLM's shape)."""

    def __init__(self, session: aiohttp.ClientSession, base: str, model: str,
                 headers: dict[str, str] | None = None) -> None:
        self.session, self.base, self.model, self.headers = session, base, model, headers or {}

    async def _post(self, body: dict) -> dict:
        url = f"{self.base}/tokenize"
        async with self.session.post(url, json=dict(body, model=self.model), headers=self.headers,
                                     timeout=aiohttp.ClientTimeout(total=60)) as r:
            if r.status in (404, 405):
                raise RuntimeError(
                    f"{self.base} has no /tokenize (HTTP {r.status}), so chat prompts cannot be sized "
                    "to its tokenizer; pass --tokenizer (an HF model folder or a .gguf file)")
            if r.status != 200:
                raise RuntimeError(f"POST {url} answered {r.status}: {(await r.text())[:200]}")
            return await r.json()

    async def pieces(self, text: str) -> list[str]:
        data = await self._post({"prompt": text, "add_special_tokens": False,
                                 "return_token_strs": True})
        strs = data.get("token_strs")
        if strs is None:
            raise RuntimeError(f"{self.base}/tokenize returns no token_strs; pass --tokenizer")
        return [str(s) for s in strs]

    async def chat_count(self, messages: list[dict[str, Any]]) -> int:
        return int((await self._post({"messages": messages}))["count"])


class LocalTokens:
    """A local tokenizer (`prompt.Tokenizer`): an HF model folder or a GGUF file."""

    def __init__(self, path: str) -> None:
        from pathlib import Path

        from agentserve.prompt.tokenizer import Tokenizer

        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            self.tok = Tokenizer.from_gguf(p)
        elif (p / "tokenizer.json").is_file():
            self.tok = Tokenizer.from_dir(p)
        else:
            raise ValueError(f"--tokenizer {path}: neither a .gguf file nor a folder with "
                             "tokenizer.json (for a preset name pass its .gguf path, or leave "
                             "--tokenizer out to use the server's /tokenize)")

    async def pieces(self, text: str) -> list[str]:
        return [self.tok.token_bytes(i).decode("utf-8", errors="replace")
                for i in self.tok.encode(text)]

    async def chat_count(self, messages: list[dict[str, Any]]) -> int:
        # as the engine renders a chat (the template writes its own BOS)
        return len(self.tok.encode(self.tok.apply_chat_template(messages)))


@dataclass(slots=True)
class ChatFit:
    """One-token words and the chat template's overhead, for one served tokenizer."""

    words: np.ndarray  # object array of " word" strings, each one token
    overhead: int  # tokens of a one-user-message chat beyond its content

    def content_tokens(self, n_tokens: int) -> int:
        """Content words for a chat of `n_tokens` served tokens (at least one)."""
        return max(1, n_tokens - self.overhead)

    def text(self, token_ids: np.ndarray) -> str:
        """The content for these (deterministic) ids: one word each."""
        return "".join(self.words[token_ids % len(self.words)])


def _group(pieces: list[str]) -> list[int]:
    """Tokens per word of a text of space-led words (a word starts at a space-led piece)."""
    sizes: list[int] = []
    for p in pieces:
        if p.startswith(_WORD_START) or not sizes:
            sizes.append(1)
        else:
            sizes[-1] += 1
    return sizes


async def one_token_words(src: TokenSource) -> list[str]:
    """The candidates that the tokenizer keeps as one token after a space."""
    words: list[str] = []
    cands = candidates()
    for i in range(0, len(cands), _CHUNK):
        chunk = cands[i:i + _CHUNK]
        sizes = _group(await src.pieces("".join(" " + w for w in chunk)))
        if len(sizes) == len(chunk):  # else this tokenizer's pieces do not mark spaces: skip
            words += [" " + w for w, n in zip(chunk, sizes) if n == 1]
    return words


async def fit_chat(src: TokenSource, seed: int = 0) -> ChatFit:
    """Find one-token words, check that n of them are n tokens in a chat, measure the overhead."""
    words = await one_token_words(src)
    if len(words) < MIN_WORDS:
        raise RuntimeError(f"the served tokenizer keeps only {len(words)} short words as one token "
                           f"(need {MIN_WORDS}); chat prompts of exact length cannot be built")
    arr = np.array(words, dtype=object)
    rng = np.random.default_rng(seed)
    k1, k2 = 8, min(256, len(words))
    c1 = await src.chat_count([{"role": "user", "content": "".join(rng.choice(arr, k1))}])
    c2 = await src.chat_count([{"role": "user", "content": "".join(rng.choice(arr, k2))}])
    if c2 - c1 != k2 - k1:
        raise RuntimeError(f"{k2 - k1} more one-token words made {c2 - c1} more chat tokens: this "
                           "tokenizer merges across words; use --api completions (token ids)")
    return ChatFit(arr, c1 - k1)
