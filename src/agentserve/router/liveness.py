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

It also estimates each session's request rate (`rate`), which the `rate` scorer and the
picker's rebalancing weigh (a session pausing 1 s between turns sends ten times the
requests of one pausing 10 s): one over the recent interval between its requests (EWMA),
or over the time since its last request when that is longer, so that a session whose
turn sits in a slow endpoint's queue, or that has gone quiet, counts less at once rather
than after its lifetime average catches up. A session seen once counts 1 / max(age, 10 s).
"""

from __future__ import annotations

from collections import deque

_MIN_SAMPLES = 16
_FLOOR_S = 1.0
_WINDOW = 512  # pauses kept for the quantile
_REFRESH = 16  # recompute the quantile every this many new pauses
_RATE_SPAN_S = 10.0  # a session seen once: 1 / max(age, this), no 1-turn spikes
_MIN_GAP_S = 1.0  # requests closer than this are a burst (fan-out), not a rate
_GAP_ALPHA = 0.5  # EWMA weight of the newest interval: two turns to follow a move


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
        # session -> (first seen, last request start, EWMA interval; 0: one request so far)
        self.turns: dict[str, tuple[float, float, float]] = {}

    def limit_s(self) -> float:
        """How long a paused session still counts as live."""
        return self._limit

    def rate(self, session: str, now: float) -> float:
        """Estimated requests per second of `session` (module docstring; 0: never seen)."""
        t = self.turns.get(session)
        if t is None:
            return 0.0
        first, last, gap = t
        if not gap:
            return 1.0 / max(now - first, _RATE_SPAN_S)
        return 1.0 / max(gap, now - last)

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
        t = self.turns.pop(session, None)
        if t is None:
            self.turns[session] = (now, now, 0.0)
        else:  # most recently active last
            first, last, gap = t
            step = max(now - last, _MIN_GAP_S)
            self.turns[session] = (first, now, step if not gap else
                                   (1 - _GAP_ALPHA) * gap + _GAP_ALPHA * step)
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
