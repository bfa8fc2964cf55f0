"""Token-id prompts read incrementally from the request body's bytes.

Decoding a 200K-token prompt from JSON costs ~10 ms of Python int objects (msgspec, 2
cores of this sandbox), five times the router's whole decision budget. An agent's next
turn repeats the previous body byte for byte up to the end of the previous prompt and
appends a few hundred tokens, so the router compares bytes instead of parsing them:

1. Find the cached body that shares the longest byte prefix with this one (candidates:
   the session's last body, and recent bodies with the same first 4 KiB / 64 KiB;
   ~50 us per 1 MB compared, word-wise with numpy).
2. The tokens whose *delimiter* (the `,` after them) lies inside the shared bytes are
   known: their ids and offsets come from the cached entry (`Seq`s, shared, O(1)).
3. Splice those tokens out - `body[:prompt_open + 1] + body[after_last_shared_comma:]` is
   a valid JSON object iff the body is, since only complete `int,` elements are removed -
   and decode the small remainder as usual (every other field validated as before; the
   removed ids were validated in an earlier body with the same bytes).
4. The new entry's ids are the cached prefix plus the decoded tail; its block hashes are
   extended from the cached entry's (`HashCache.extend`), so only new blocks are hashed.

A first body (nothing shared) is decoded whole, once. Bodies whose prompt is not a flat
list of ints, or whose bytes before the prompt differ from the cached body (another
field order or value), take the full path: always correct, just slower.
The cache is an LRU bounded by the bytes of the bodies it keeps (~6 bytes per prompt
token; int32 ids and offsets add 8 per *new* token, segments are shared between turns).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from agentserve.prompt.segments import Seq

_GENERIC = msgspec.json.Decoder()
_HEADS = (4096, 65536)  # fingerprinted body prefixes: system prompt, a first turn
_MAX_CANDIDATES = 4
_COMMA, _CLOSE = ord(","), ord("]")


class _PromptSpan(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.UNSET


_SPAN = msgspec.json.Decoder(_PromptSpan)


@dataclass(slots=True, eq=False)
class RawEntry:
    """A body whose prompt is a flat list of token ids.

    `open` is the offset of the prompt's `[`; `ends[i]` the offset of the delimiter
    (`,` or the closing `]`) after token i; `hashes` the prompt's block hashes by hasher
    id, filled by the router (`core.Router.keys_for`)."""

    body: bytes
    open: int
    ids: Seq
    ends: Seq
    hashes: dict[Any, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RawParse:
    """One body's decoded fields (prompt = only the ids not shared with `base`) and its
    entry; `shared` leading ids equal `base`'s."""

    req: dict[str, Any]
    entry: RawEntry | None
    base: RawEntry | None = None
    shared: int = 0


def _addr(buf: Any) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data if len(buf) else 0


def common_prefix(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two byte strings (word-wise with numpy)."""
    m = min(len(a), len(b))
    w = m // 8
    i = 0
    if w:
        ne = np.frombuffer(a, np.uint64, w) != np.frombuffer(b, np.uint64, w)
        j = int(ne.argmax())
        if not ne[j]:
            i = w * 8
        else:
            i = j * 8
    while i < m and a[i] == b[i]:
        i += 1
    return i


def _delimiters(body: bytes, start: int, n_tail: int) -> array:
    """Offsets of the delimiters after each of the `n_tail` ids that begin at `start`:
    the commas up to the prompt's closing bracket, then the bracket (ids are digits, so
    the first `]` after `start` closes the prompt)."""
    seg = np.frombuffer(body, np.uint8)[start:]
    close = int((seg == _CLOSE).argmax())
    commas = np.flatnonzero(seg[:close] == _COMMA)
    if len(commas) != max(0, n_tail - 1):  # not a plain int list after all
        raise ValueError("prompt delimiters do not match its ids")
    out = array("i", (commas + start).astype(np.int32).tobytes()) if len(commas) else array("i")
    if n_tail:
        out.append(start + close)
    return out


class RawPromptCache:
    """Bounded LRU of recent token-id bodies, keyed for lookup by session and body head."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0  # bodies held (ids and offsets add ~8 bytes per token, shared)
        self._entries: OrderedDict[int, RawEntry] = OrderedDict()  # id(entry) -> entry
        self._by_session: OrderedDict[str, RawEntry] = OrderedDict()
        self._by_head: dict[tuple[int, int], RawEntry] = {}
        self.parses = {"full": 0, "incremental": 0}

    def __len__(self) -> int:
        return len(self._entries)

    # ---- lookup -----------------------------------------------------------------
    def _heads(self, body: bytes) -> list[tuple[int, int]]:
        return [(n, hash(body[:n])) for n in _HEADS if len(body) >= n]

    def _candidates(self, body: bytes, session: str | None) -> list[RawEntry]:
        out: list[RawEntry] = []
        if session is not None and (e := self._by_session.get(session)) is not None:
            out.append(e)
        for key in reversed(self._heads(body)):  # the deepest head first
            e = self._by_head.get(key)
            if e is not None and e not in out:
                out.append(e)
        return out[:_MAX_CANDIDATES]

    def _best_base(self, body: bytes, session: str | None) -> tuple[RawEntry | None, int]:
        best, best_k = None, 0
        for e in self._candidates(body, session):
            n = common_prefix(e.body, body)
            if n <= e.open:  # the bytes before the prompt differ
                continue
            k = e.ends.bisect_right(n - 1)  # ids whose delimiter is inside the shared bytes
            if k > best_k:
                best, best_k = e, k
        return best, best_k

    # ---- parse ------------------------------------------------------------------
    def parse(self, body: bytes, session: str | None) -> RawParse:
        """Decode `body`; for a flat token-id prompt, reuse a cached body's shared ids.

        Raises msgspec.DecodeError for invalid JSON (the caller turns it into a 400)."""
        base, k = self._best_base(body, session) if self._entries else (None, 0)
        if base is not None:
            last = base.ends[k - 1]  # the k-th id's delimiter: `,`, or `]` (same prompt)
            start = last + 1 if body[last] == _COMMA else last
            req = _GENERIC.decode(body[:base.open + 1] + body[start:])
            tail = req.get("prompt") if isinstance(req, dict) else None
            if isinstance(tail, list) and _ints(tail):
                try:
                    ends = base.ends.prefix_plus(k, _delimiters(body, start, len(tail)))
                    ids = base.ids.prefix_plus(k, array("i", tail))
                except (ValueError, OverflowError):
                    pass  # odd bytes or ids beyond int32: the full path decides
                else:
                    self.parses["incremental"] += 1
                    entry = RawEntry(body, base.open, ids, ends)
                    self._remember(entry, body, session)
                    return RawParse(req, entry, base, k)
        req = _GENERIC.decode(body)
        self.parses["full"] += 1
        return RawParse(req, self._full_entry(req, body, session))

    def _full_entry(self, req: Any, body: bytes, session: str | None) -> RawEntry | None:
        prompt = req.get("prompt") if isinstance(req, dict) else None
        if not (isinstance(prompt, list) and prompt and _ints(prompt)):
            return None
        raw = _SPAN.decode(body).prompt
        try:
            open_ = _addr(raw) - _addr(body)
            if not 0 <= open_ < len(body) or body[open_] != ord("["):
                return None
            ends = _delimiters(body, open_ + 1, len(prompt))
            ids = array("i", prompt)
        except (ValueError, OverflowError):
            return None
        entry = RawEntry(body, open_, Seq([ids]), Seq([ends]))
        self._remember(entry, body, session)
        return entry

    def _remember(self, entry: RawEntry, body: bytes, session: str | None) -> None:
        self._entries[id(entry)] = entry
        self.bytes += len(body)
        if session is not None:
            self._by_session[session] = entry
            self._by_session.move_to_end(session)
        for key in self._heads(body):
            self._by_head[key] = entry
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.bytes -= len(old.body)
            self._forget(old)

    def _forget(self, old: RawEntry) -> None:
        for s in [s for s, e in self._by_session.items() if e is old]:
            del self._by_session[s]
        for key in [k for k, e in self._by_head.items() if e is old]:
            del self._by_head[key]


def _ints(xs: list[Any]) -> bool:
    return all(type(x) is int for x in xs)  # bool is not a token id
