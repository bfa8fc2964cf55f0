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

Chat prompts are also *rendered* incrementally (re-rendering a 240-message conversation
through Jinja costs ~2 ms). A cached entry remembers its messages (the objects are shared
with later turns) and the length of its rendering without the generation prompt. The
previous turn is found by a fingerprint of (tools, generation prompt, first message,
message count, last message) probed from the longest prefix down, then confirmed by
comparing the message lists (C-speed equality, no hashing of every message body). Only a
small window is rendered: the first message, one or two context messages before the new
ones (keeping index parity, for templates that check role alternation), and the new
ones. The window's rendering of the context messages must equal the tail of the cached
prefix text, and prefix/new and body/generation-prompt must nest; otherwise, and for the
first window of each role pattern seen (verified against a full render; a mismatch turns
incremental rendering off for the template), the whole conversation is rendered.
Counters: `renders` (full / incremental / fallback / verified).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from agentserve.prompt.tokenizer import Tokenizer
from agentserve.prompt.segments import Rope, Seq

if TYPE_CHECKING:
    from agentserve.prompt.rawprompt import RawEntry

logger = logging.getLogger(__name__)

_SELF_CHECK = ("def f(x):\n    return x  # ok", "héllo wörld, 1234 tokens\n\n  end",
               "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")
_ENC = msgspec.json.Encoder()


@dataclass(slots=True)
class Entry:
    """A tokenized prompt: text, ids, char end offset of each id, hashes by hasher id.

    ids and ends are `Seq`s of int32 (4 bytes a token instead of ~36 for a list of
    ints, and segments shared with the entry they extend).
    """

    text: str | Rope  # chat renderings are Ropes sharing the previous turn's text
    ids: Seq
    ends: Seq
    hashes: dict[Any, Any] = field(default_factory=dict)
    messages: list[Any] | None = None  # chat: the rendered messages (shared with later turns)
    body: int = -1  # chat: length of the rendering without the generation prompt (-1: unknown)


@dataclass(slots=True)
class Tokenized:
    """A prompt's ids; `base` shares its first `shared` ids with this prompt."""

    ids: Seq
    entry: Entry | RawEntry
    base: Entry | RawEntry | None = None
    shared: int = 0


def common_prefix_len(a: str | Rope, b: str | Rope, step: int = 8192, lo: int = 0) -> int:
    """Length of the common prefix of two strings (C-speed compares, then chars).

    `lo`: a length known to be common already (the scan starts there; with a `Rope`
    only the text from `lo` on is read).
    """
    if not isinstance(a, str) or not isinstance(b, str):
        lo = min(lo, len(a), len(b))
        return lo + common_prefix_len(a[lo:], b[lo:], step)
    if len(a) <= len(b):
        if b.startswith(a[lo:], lo) if lo else b.startswith(a):
            return len(a)
    elif a.startswith(b[lo:], lo) if lo else a.startswith(b):
        return len(b)
    n = min(len(a), len(b))
    lo = min(lo, n)
    while lo + step <= n and b.startswith(a[lo:lo + step], lo):
        lo += step
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


def _message_fp(m: Any) -> int:
    """Fingerprint of one message (role and content, or its JSON)."""
    if isinstance(m, dict):
        content = m.get("content")
        if isinstance(content, str) and len(m) <= 2:
            return hash((m.get("role"), content))
    return hash(_ENC.encode(m))


def _shape(m: Any) -> str:
    """A message's role, marked when it carries more than role and content (tool calls)."""
    if isinstance(m, dict):
        return f"{m.get('role')}{'+' if len(m) > 2 else ''}"
    return "?"


class IncrementalTokenizer:
    """Chat and text prompts to token ids with a bounded LRU of tokenized prefixes."""

    def __init__(self, tokenizer: Tokenizer, max_entries: int = 256, backoff: int = 8,
                 max_probe: int = 64, verify_shapes: int = 256) -> None:
        self.tok = tokenizer
        self.max_entries = max_entries
        self.backoff = backoff
        self.max_probe = max_probe  # messages a turn may add and still find its base
        self._by_fp: OrderedDict[int, Entry] = OrderedDict()
        self.tokenized_chars = 0  # characters actually run through the tokenizer
        self.incremental = self._self_check()
        self.tokenized_chars = 0
        self.incremental_render = True  # off once a verification finds a non-local template
        self._verified: set[tuple[str, ...]] = set()  # window role patterns checked
        self._verify_shapes = verify_shapes
        self.renders = {"full": 0, "incremental": 0, "fallback": 0, "verified": 0}
        # head key -> (rendering of the first message alone, the generation prompt the
        # template appends to it, or None): rendered once per conversation head
        self._heads: OrderedDict[int, tuple[str, str | None]] = OrderedDict()
        self._derive_body = True  # off once a window's body != its rendering minus gen

    def _encode(self, text: str, add_special: bool, shift: int = 0) -> tuple[array, array]:
        enc = self.tok.hf.encode(text, add_special_tokens=add_special)
        self.tokenized_chars += len(text)
        return array("i", enc.ids), array("i", [e + shift for _, e in enc.offsets])

    def _self_check(self) -> bool:
        for s in _SELF_CHECK:
            full = list(self._encode(s, False)[0])
            for cut in range(1, len(s)):
                ids, ends = self._encode(s[:cut], False)
                if self._extend(Entry(s[:cut], Seq([ids]), Seq([ends])), s) != full:
                    return False
        return True

    def _extend(self, base: Entry, text: str) -> list[int]:
        """Ids of `text` reusing the ids of `base` up to the common prefix (minus backoff)."""
        keep = self._keep(base, text)
        start = base.ends[keep - 1] if keep else 0
        ids, _ = self._encode(text[start:], False)
        return list(base.ids[:keep] + ids)

    def _keep(self, base: Entry, text: str, common: int = 0) -> int:
        """How many of base's ids to keep: never split the tokens of one character."""
        cut = common_prefix_len(base.text, text, lo=common)
        keep, ends = max(0, base.ends.bisect_right(cut) - self.backoff), base.ends
        while 0 < keep < len(ends) and ends[keep] == ends[keep - 1]:
            keep -= 1  # byte-level BPE: several tokens of one multi-byte char share an end
        return keep

    def _tokenize_from(self, base: Entry | None, text: str | Rope, add_special: bool,
                       common: int = 0) -> tuple[Entry, int]:
        if base is None or not self.incremental:
            ids, ends = self._encode(str(text), add_special)
            return Entry(text, Seq([ids]), Seq([ends])), 0
        keep = self._keep(base, text, common)
        start = base.ends[keep - 1] if keep else 0
        ids, ends = self._encode(text[start:], add_special and keep == 0, start)
        return Entry(text, base.ids.prefix_plus(keep, ids), base.ends.prefix_plus(keep, ends)), keep

    def _remember(self, fp: int, entry: Entry) -> None:
        self._by_fp[fp] = entry
        self._by_fp.move_to_end(fp)
        while len(self._by_fp) > self.max_entries:
            self._by_fp.popitem(last=False)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True) -> Tokenized:
        """Render with the chat template and tokenize incrementally (no special tokens added)."""
        agp = add_generation_prompt
        head = hash(("chat", agp, _ENC.encode(tools) if tools else None,
                     _message_fp(messages[0]) if messages else None))
        base, k = self._find_base(head, messages)
        text, body, common = None, -1, 0
        if base is not None:
            text, body, common = self._render_incremental(base, k, messages, tools, agp, head)
        if text is None:
            text = self._render(messages, tools, agp)
            body = self._body_len(text, messages, tools, agp)
            self.renders["full"] += 1
        entry, shared = self._tokenize_from(base, text, False, common)
        entry.messages = base.messages[:k] + messages[k:] if base is not None \
            and base.messages is not None else list(messages)
        entry.body = body
        if messages:
            self._remember(self._conv_key(head, messages, len(messages)), entry)
        return Tokenized(entry.ids, entry, base, shared)

    @staticmethod
    def _conv_key(head: int, messages: list[Any], k: int) -> int:
        return hash((head, k, _message_fp(messages[k - 1])))

    def _find_base(self, head: int, messages: list[Any]) -> tuple[Entry | None, int]:
        """The cached conversation that is the longest prefix of `messages` (probed from
        the full list down `max_probe` messages; confirmed by list equality)."""
        n = len(messages)
        for k in range(n, max(0, n - self.max_probe), -1):
            e = self._by_fp.get(self._conv_key(head, messages, k))
            if e is not None and e.messages is not None and len(e.messages) == k \
                    and e.messages == messages[:k]:
                return e, k
        return None, 0

    def _render(self, messages: list[Any], tools: Any, agp: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp)

    def _body_len(self, text: str, messages: list[Any], tools: Any, agp: bool) -> int:
        """Length of `text` without the generation prompt (-1 if that cannot be told)."""
        if not agp:
            return len(text)
        if not messages:
            return -1
        try:
            bare = self._render(messages[:1], tools, False)
            gen = self._render(messages[:1], tools, True)
        except ValueError:
            return -1
        if not gen.startswith(bare):
            return -1
        g = len(gen) - len(bare)
        return len(text) - g if text.endswith(gen[len(bare):]) else -1

    def _head_render(self, key: int, head: list[Any], tools: Any) -> tuple[str, str | None]:
        """The first message rendered alone, and the generation prompt the template adds
        after it (None when the two renderings do not nest), cached per head."""
        hit = self._heads.get(key)
        if hit is None:
            h = self._render(head, tools, False)
            g = self._render(head, tools, True)
            hit = self._heads[key] = (h, g[len(h):] if g.startswith(h) else None)
            while len(self._heads) > self.max_entries:
                self._heads.popitem(last=False)
        return hit

    def _render_incremental(self, base: Entry, k: int, messages: list[Any], tools: Any,
                            agp: bool, head_key: int) -> tuple[str | Rope | None, int, int]:
        """(text, body, chars known common with base.text) of `messages` rendered from
        `base` (its first k messages), or (None, -1, 0): render the whole conversation.

        Two renders per turn: the context window (d) and window + new messages with the
        generation prompt (c); the window without it (b) is c minus the head's cached
        generation prompt, checked against a real render with each new role pattern."""
        n = len(messages)
        if k == n:  # the same conversation again (a retry): same text
            return base.text, base.body, len(base.text)
        s = k - 1 if (k - 1) % 2 else k - 2  # first context message, at an odd index
        if s <= 1 or not self.incremental_render:
            return None, -1, 0  # short conversation (a full render is cheap) or disabled
        if base.body < 0:
            self.renders["fallback"] += 1
            return None, -1, 0
        head = messages[:1]
        try:
            h, g = self._head_render(head_key, head, tools)
            d = self._render(head + messages[s:k], tools, False)
            c = self._render(head + messages[s:], tools, agp)
            if not agp:
                b_len = len(c)
            elif g is not None and self._derive_body and c.endswith(g):
                b_len = len(c) - len(g)
            else:
                b_len = len(self._render(head + messages[s:], tools, False))
        except ValueError:
            self.renders["fallback"] += 1
            return None, -1, 0
        if not (d.startswith(h) and len(d) <= b_len and c.startswith(d)
                and base.text.endswith(d[len(h):], 0, base.body)):
            self.renders["fallback"] += 1  # the template is not append-only here
            return None, -1, 0
        prev = base.text if isinstance(base.text, Rope) else Rope([base.text])
        gen = prev[base.body:]  # base's generation prompt: often the new text has it too
        if c.startswith(gen, len(d)):  # then one copy of the prefix instead of two
            text = prev.prefix_plus(len(prev), c[len(d) + len(gen):])
        else:
            text = prev.prefix_plus(base.body, c[len(d):])
        body = base.body + b_len - len(d)
        shape = tuple(_shape(m) for m in messages[s:])
        if shape not in self._verified and len(self._verified) < self._verify_shapes:
            full = self._render(messages, tools, agp)
            self.renders["verified"] += 1
            text_s = str(text)
            if agp and self._render(head + messages[s:], tools, False) != c[:b_len]:
                self._derive_body = False  # the generation prompt depends on the window
                body = self._body_len(full, messages, tools, agp)
            if full != text_s:
                self.incremental_render = False
                self.renders["fallback"] += 1
                logger.warning("chat template is not append-only for messages shaped %s: "
                               "incremental rendering turned off", shape)
                return full, self._body_len(full, messages, tools, agp), 0
            self._verified.add(shape)
        self.renders["incremental"] += 1
        return text, body, base.body

    def text(self, prompt: str, add_special_tokens: bool = True,
             session: str | None = None) -> Tokenized:
        """Tokenize a completions prompt; incremental against the session's last prompt."""
        fp = hash(("text", session)) if session else hash(("text", prompt[:4096]))
        base = self._by_fp.get(fp)
        entry, shared = self._tokenize_from(base, prompt, add_special_tokens)
        self._remember(fp, entry)
        return Tokenized(entry.ids, entry, base, shared)
