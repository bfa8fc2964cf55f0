"""Which sessions are live: in flight, or paused for less than the learned pause limit.

Placement balances *live* sessions (`Candidate.active_sessions`): a paused agent sends
its next turn to the endpoint that holds its prefix, a finished one sends nothing. The
router never hears that a session finished; it only sees the pause grow. Counting a
session for a fixed minute after its last turn (the earlier rule) counted every session
that had finished within that minute: on the captured-reuse benchmark (sessions of ~8
turns a few seconds apart) the endpoints' counts summed to 53 while 24 sessions were
live, so new sessions were spread by where sessions had *recently ended*.

The limit is learned from the pauses the router observes (time from a session's request
ending, with none other in flight, to its next request): the `session_pause_quantile`
of the most recent ones, at least `_FLOOR_S`, at most `session_active_s` (also the limit
until `_MIN_SAMPLES` pauses were seen). With production agent traffic (2 s median pause,
24 s p90) the 0.9 quantile keeps a session counted through 90% of its tool calls and
drops a finished one after ~24 s instead of 60.

It also keeps each session's turn count since it was first seen, for `rate`: how many
requests a session sends per second, which the picker's rebalancing weighs (a session
pausing 1 s between turns sends ten times the requests of one pausing 10 s).
"""

from __future__ import annotations

from collections import deque

_MIN_SAMPLES = 16
_FLOOR_S = 1.0
_WINDOW = 512  # pauses kept for the quantile
_REFRESH = 16  # recompute the quantile every this many new pauses
_RATE_SPAN_S = 10.0  # a session's rate is turns / max(age, this): no 1-turn spikes


class SessionLiveness:
    """Per-session in-flight counts and end times, and the learned pause limit."""

    def __init__(self, max_s: float, quantile: float | None, max_sessions: int) -> None:
        self.max_s = max_s
        self.quantile = quantile or None  # None or 0: a fixed window of max_s
        self.max_sessions = max_sessions
        self.inflight: dict[str, int] = {}
        self.ended: dict[str, float] = {}  # session -> when its last request ended
        self.pauses: deque[float] = deque(maxlen=_WINDOW)
        self._limit = max_s
        self._fresh = 0
        self.turns: dict[str, tuple[float, int]] = {}  # session -> (first seen, requests)

    def limit_s(self) -> float:
        """How long a paused session still counts as live."""
        return self._limit

    def rate(self, session: str, now: float) -> float:
        """Requests per second `session` has sent since first seen (0: never seen)."""
        t = self.turns.get(session)
        return t[1] / max(now - t[0], _RATE_SPAN_S) if t is not None else 0.0

    def busy(self, session: str) -> bool:
        return self.inflight.get(session, 0) > 0

    def start(self, session: str, now: float) -> None:
        """A request of `session` was booked; a paused session's pause is a sample."""
        n = self.inflight.get(session, 0)
        end = self.ended.pop(session, None)
        if n == 0 and end is not None and self.quantile is not None:
            self.pauses.append(max(0.0, now - end))
            self._fresh += 1
            if self._fresh >= _REFRESH and len(self.pauses) >= _MIN_SAMPLES:
                self._fresh = 0
                s = sorted(self.pauses)
                q = s[min(len(s) - 1, int(self.quantile * len(s)))]
                self._limit = min(self.max_s, max(_FLOOR_S, q))
        self.inflight[session] = n + 1
        first, turns = self.turns.pop(session, (now, 0))
        self.turns[session] = (first, turns + 1)  # most recently active last
        if len(self.turns) > self.max_sessions:
            del self.turns[next(iter(self.turns))]

    def end(self, session: str, now: float) -> None:
        """A request of `session` ended (success or not)."""
        n = self.inflight.get(session, 0) - 1
        if n > 0:
            self.inflight[session] = n
            return
        self.inflight.pop(session, None)
        self.ended[session] = now
        if len(self.ended) > self.max_sessions:  # bounded: forget the oldest end
            del self.ended[next(iter(self.ended))]
