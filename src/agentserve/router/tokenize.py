"""Incremental prompt tokenization: tokenize only what a turn adds.

An agent's next turn repeats every previous message and appends a few. We render the
chat template (cheap: string concatenation), find the cached prompt whose message list
is the longest prefix of this one (a chained fingerprint per message, looked up from the
longest prefix down), measure the common *text* prefix, keep the cached tokens that end
`backoff` tokens before the first differing character, and tokenize only the rest.

Byte-level BPE splits on pre-tokenizer boundaries whose decisions look at most a few
characters ahead, so re-tokenizing from a token boundary a few tokens back reproduces
the full tokenization exactly. A tokenizer for which that does not hold (e.g. one that
prepends a space to every input) is detected at construction by a self-check, and
incremental mode is then switched off (full tokenization, still correct).

Each cache entry also carries the prompt's block hashes per hasher (`PromptHashes`), so
the router hashes only new blocks as well. The cache is a bounded LRU of entries.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentserve.engine.tokenizer import Tokenizer

_SELF_CHECK = ("def f(x):\n    return x  # ok", "héllo wörld, 1234 tokens\n\n  end",
               "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")
_ENC = msgspec.json.Encoder()


@dataclass(slots=True)
class Entry:
    """A tokenized prompt: text, ids, char end offset of each id, hashes by hasher id.

    ids and ends are int32 arrays (4 bytes a token instead of ~36 for a list of ints).
    """

    text: str
    ids: array
    ends: array
    hashes: dict[Any, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Tokenized:
    """A prompt's ids; `base` shares its first `shared` ids with this prompt."""

    ids: array
    entry: Entry
    base: Entry | None = None
    shared: int = 0


def common_prefix_len(a: str, b: str, step: int = 8192) -> int:
    """Length of the common prefix of two strings (C-speed slice compares, then chars)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo = 0
    while lo + step <= n and a[lo:lo + step] == b[lo:lo + step]:
        lo += step
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


def _message_fp(parent: int, m: Any) -> int:
    if isinstance(m, dict):
        content = m.get("content")
        if isinstance(content, str) and len(m) <= 2:
            return hash((parent, m.get("role"), content))
    return hash((parent, _ENC.encode(m)))


class IncrementalTokenizer:
    """Chat and text prompts to token ids with a bounded LRU of tokenized prefixes."""

    def __init__(self, tokenizer: Tokenizer, max_entries: int = 256, backoff: int = 8) -> None:
        self.tok = tokenizer
        self.max_entries = max_entries
        self.backoff = backoff
        self._by_fp: OrderedDict[int, Entry] = OrderedDict()
        self.tokenized_chars = 0  # characters actually run through the tokenizer
        self.incremental = self._self_check()
        self.tokenized_chars = 0

    def _encode(self, text: str, add_special: bool, shift: int = 0) -> tuple[array, array]:
        enc = self.tok.hf.encode(text, add_special_tokens=add_special)
        self.tokenized_chars += len(text)
        return array("i", enc.ids), array("i", [e + shift for _, e in enc.offsets])

    def _self_check(self) -> bool:
        for s in _SELF_CHECK:
            full = list(self._encode(s, False)[0])
            for cut in range(1, len(s)):
                if self._extend(Entry(s[:cut], *self._encode(s[:cut], False)), s) != full:
                    return False
        return True

    def _extend(self, base: Entry, text: str) -> list[int]:
        """Ids of `text` reusing the ids of `base` up to the common prefix (minus backoff)."""
        keep = self._keep(base, text)
        start = base.ends[keep - 1] if keep else 0
        ids, _ = self._encode(text[start:], False)
        return list(base.ids[:keep] + ids)

    def _keep(self, base: Entry, text: str) -> int:
        """How many of base's ids to keep: never split the tokens of one character."""
        cut = common_prefix_len(base.text, text)
        keep, ends = max(0, bisect_right(base.ends, cut) - self.backoff), base.ends
        while 0 < keep < len(ends) and ends[keep] == ends[keep - 1]:
            keep -= 1  # byte-level BPE: several tokens of one multi-byte char share an end
        return keep

    def _tokenize_from(self, base: Entry | None, text: str,
                       add_special: bool) -> tuple[Entry, int]:
        if base is None or not self.incremental:
            ids, ends = self._encode(text, add_special)
            return Entry(text, ids, ends), 0
        keep = self._keep(base, text)
        start = base.ends[keep - 1] if keep else 0
        ids, ends = self._encode(text[start:], add_special and keep == 0, start)
        entry = Entry(text, base.ids[:keep] + ids, base.ends[:keep] + ends)
        return entry, keep

    def _remember(self, fp: int, entry: Entry) -> None:
        self._by_fp[fp] = entry
        self._by_fp.move_to_end(fp)
        while len(self._by_fp) > self.max_entries:
            self._by_fp.popitem(last=False)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True) -> Tokenized:
        """Render with the chat template and tokenize incrementally (no special tokens added)."""
        text = self.tok.apply_chat_template(messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt)
        fps, fp = [], hash((add_generation_prompt, _ENC.encode(tools) if tools else None))
        for m in messages:
            fp = _message_fp(fp, m)
            fps.append(fp)
        base = None
        for f in reversed(fps):
            base = self._by_fp.get(f)
            if base is not None:
                break
        entry, shared = self._tokenize_from(base, text, False)
        self._remember(fps[-1] if fps else fp, entry)
        return Tokenized(entry.ids, entry, base, shared)

    def text(self, prompt: str, add_special_tokens: bool = True,
             session: str | None = None) -> Tokenized:
        """Tokenize a completions prompt; incremental against the session's last prompt."""
        fp = hash(("text", session)) if session else hash(("text", prompt[:4096]))
        base = self._by_fp.get(fp)
        entry, shared = self._tokenize_from(base, prompt, add_special_tokens)
        self._remember(fp, entry)
        return Tokenized(entry.ids, entry, base, shared)
