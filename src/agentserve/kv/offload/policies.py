"""Retention policies for an offload tier: which stored block to evict next.

Every policy tracks the keys (chained block hashes) its tier holds and answers one
question, ``victim(pinned)``: the key to evict next, skipping keys the tier cannot
drop right now (a load or a disk write is reading them). The tier calls ``remove``
once it has actually evicted the key, so a policy never mutates on a question.

- ``lru``: least recently stored-or-hit first (the reference deployment's policy).
- ``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST'03): recency list T1,
  frequency list T2, ghost lists B1/B2 steer the target size ``p`` of T1. Blocks hit
  once by a resumed turn move to T2 and survive a scan of one-shot blocks.
- ``session``: agent-session aware, see ``SessionPolicy``.
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

Key = bytes


class PinCounts(dict):
    """Key -> number of pins held (a key is pinned while its count is positive)."""

    def pin(self, key: Key) -> None:
        self[key] = self.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        n = self.get(key, 0) - 1
        if n <= 0:
            self.pop(key, None)
        else:
            self[key] = n
Pinned = Callable[[Key], bool]


@dataclass(slots=True)
class BlockInfo:
    """What the engine knows about a block when it is stored or hit."""

    session: str | None = None  # x-session-id / user, else None
    pos: int = 0  # offload-block index in its request's chain (0 = first)


class RetentionPolicy(ABC):
    """One tier's eviction order. ``insert``/``touch``/``remove`` keep it in sync."""

    name = "base"

    @abstractmethod
    def insert(self, key: Key, info: BlockInfo) -> None:
        """A block was stored in the tier."""

    @abstractmethod
    def touch(self, key: Key, info: BlockInfo | None = None) -> None:
        """A stored block was hit (looked up and loaded) or offered again."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """The tier dropped the block (evicted, failed, or corrupt)."""

    @abstractmethod
    def victim(self, pinned: Pinned) -> Key | None:
        """The next key to evict among the unpinned ones; None if all are pinned."""

    def on_request(self, session: str | None, keys: list[Key], now: float | None = None) -> None:
        """A request of ``session`` arrived whose chain is ``keys`` (hint; default: ignored)."""

    def on_finish(self, session: str | None, now: float | None = None) -> None:
        """A request of ``session`` ended: the session pauses (hint; default: ignored)."""


class LRUPolicy(RetentionPolicy):
    """Least recently used first; the oldest stored chain head goes first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: Key, info: BlockInfo) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key, info: BlockInfo | None = None) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Pinned) -> Key | None:
        return next((k for k in self._order if not pinned(k)), None)


class ARCPolicy(RetentionPolicy):
    """Adaptive Replacement Cache over a tier of ``capacity`` blocks."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.c, self.p = max(1, capacity), 0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def insert(self, key: Key, info: BlockInfo) -> None:
        # A ghost hit means we evicted it too early: grow the side it came from.
        if key in self.b1:
            self.p = min(self.c, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key, info: BlockInfo | None = None) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        # Evicted blocks become ghosts on their side; ghost lists are bounded by c.
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        self._trim_ghosts()

    def victim(self, pinned: Pinned) -> Key | None:
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        for lst in (first, second):
            k = next((k for k in lst if not pinned(k)), None)
            if k is not None:
                return k
        return None

    def _trim_ghosts(self) -> None:
        while len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while len(self.b2) > self.c:
            self.b2.popitem(last=False)


@dataclass(slots=True)
class _Session:
    last: float
    active: int = 0  # requests of this session now in the engine
    gen: int = 0  # bumped per main-agent turn: blocks it did not re-read go stale
    root: Key | None = None  # first chain key of the session's first request: the main agent
    heap: list[tuple[int, int, int, Key]] = field(default_factory=list)  # (gen, -pos, n, key)


class SessionPolicy(RetentionPolicy):
    """Keeps what a paused agent session will resume with; evicts chain tails first.

    Reasoning (agentic workloads: a turn re-reads its whole previous context):

    1. *Class of the owning session.* Sessions idle longer than ``ttl`` seconds count as
       finished (p99 idle gap is ~11 min), then paused sessions (a request ended, the
       tool is running), then active ones (a request is in the engine: its blocks are
       on the device anyway, but must survive until it pauses). Within a class, the
       session idle longest goes first.
    2. *Stale before live, across sessions.* Each main-agent turn of a session bumps its
       generation and re-touches the blocks of its chain; blocks it did not re-read (an
       abandoned branch, a compacted context, output that was never fed back, and the
       contexts of the sub-agents and side calls it waited for: the main agent resumes
       only once they have returned, and they are never resumed) are stale. Stale blocks
       of *every* session go before any live block of a paused session: a just-resumed
       session's finished sub-agents must not outlive another paused session's chain.
       The main agent is the chain root of the session's first request (its system
       prompt); a request under another root (a sub-agent, a side call under its own
       prompt) keeps its blocks live but does not make the main chain stale, so a paused
       main agent survives its own sub-agent group.
    3. *Tail first.* A lookup only serves a *consecutive* prefix, so losing block i
       makes blocks i+1.. worthless; LRU evicts the oldest-stored block, i.e. the
       chain head, and strands the rest. We evict the highest chain position, so a
       resumed session restores a shorter prefix and recomputes only the tail.
    4. *Reuse.* A block hit by several sessions (a shared system prompt) belongs to the
       most recent one and sits at a low position, so rules 1 and 3 keep it longest.
    """

    name = "session"

    def __init__(self, ttl: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self.sessions: dict[str, _Session] = {}
        self.blocks: dict[Key, tuple[str, int, int]] = {}  # key -> (session, pos, gen)
        self.reuse: dict[Key, int] = {}
        self._n = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def _sid(self, info: BlockInfo | None, key: Key) -> str:
        # No session id: each chain root stands for its own conversation.
        return info.session if info is not None and info.session else f"anon:{key.hex()[:16]}"

    def _session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = _Session(self.clock())
        return s

    def _place(self, key: Key, sid: str, pos: int) -> None:
        s = self._session(sid)
        self.blocks[key] = (sid, pos, s.gen)
        self._n += 1
        heapq.heappush(s.heap, (s.gen, -pos, self._n, key))

    def insert(self, key: Key, info: BlockInfo) -> None:
        self._place(key, self._sid(info, key), info.pos)
        self.reuse.setdefault(key, 0)

    def touch(self, key: Key, info: BlockInfo | None = None) -> None:
        old = self.blocks.get(key)
        if old is None:
            return
        self.reuse[key] = self.reuse.get(key, 0) + 1
        sid = self._sid(info, key) if info is not None else old[0]
        self._place(key, sid, info.pos if info is not None else old[1])

    def remove(self, key: Key) -> None:
        self.blocks.pop(key, None)
        self.reuse.pop(key, None)

    def on_request(self, session: str | None, keys: list[Key], now: float | None = None) -> None:
        if not session:
            return
        s = self._session(session)
        if keys and s.root is None:
            s.root = keys[0]
        if keys and keys[0] == s.root:
            s.gen += 1  # a main-agent turn: what it does not re-read goes stale
        s.active += 1
        s.last = self.clock() if now is None else now
        for pos, key in enumerate(keys):  # the new turn's chain is live again
            if key in self.blocks:
                self._place(key, session, pos)

    def on_finish(self, session: str | None, now: float | None = None) -> None:
        s = self.sessions.get(session) if session else None
        if s is not None:
            s.active = max(0, s.active - 1)
            s.last = self.clock() if now is None else now

    def _rank(self, s: _Session, now: float) -> tuple[int, float]:
        cls = 2 if s.active else (0 if now - s.last > self.ttl else 1)
        return cls, s.last

    def victim(self, pinned: Pinned) -> Key | None:
        now = self.clock()
        ranked = sorted(self.sessions.items(), key=lambda kv: self._rank(kv[1], now))
        # Pass 1: blocks of finished sessions, then stale blocks of any session.
        for sid, s in ranked:
            key = self._session_victim(sid, s, pinned)
            if key is not None and (self._rank(s, now)[0] == 0 or self.blocks[key][2] < s.gen):
                return key
        # Pass 2: live blocks, paused sessions before active ones, idle longest first.
        for sid, s in ranked:
            key = self._session_victim(sid, s, pinned)
            if key is not None:
                return key
            if not s.heap and not s.active:
                del self.sessions[sid]  # no blocks left: forget the session
        return None

    def _session_victim(self, sid: str, s: _Session, pinned: Pinned) -> Key | None:
        """Oldest generation, then highest position; skips stale heap entries and pins."""
        skipped: list[tuple[int, int, int, Key]] = []
        found = None
        while s.heap:
            gen, negpos, n, key = s.heap[0]
            cur = self.blocks.get(key)
            if cur is None or cur != (sid, -negpos, gen):
                heapq.heappop(s.heap)  # superseded entry (re-placed, moved or removed)
                continue
            if pinned(key):
                skipped.append(heapq.heappop(s.heap))
                continue
            found = key
            break
        for e in skipped:
            heapq.heappush(s.heap, e)
        return found


def make_policy(name: str, capacity: int, session_ttl: float = 600.0) -> RetentionPolicy:
    """The policy ``--kv-cpu-policy`` names."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    if name == "session":
        return SessionPolicy(ttl=session_ttl)
    raise ValueError(f"--kv-cpu-policy must be lru, arc or session, got {name!r}")
