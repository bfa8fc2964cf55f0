"""What the router books on its endpoints itself, from a decision to the request's end.

Scraped metrics lag by a scrape interval, so the router counts what it sent in the
meantime: requests and tokens in flight, uncached prefill queued (for the estimated wait),
recent requests, the prefill speed learned at first byte, and where each live session
lives. `Router` books through a `Ledger` on wall-clock time; the simulator's `PolicyRouter`
books through the same class on its simulated clock, so the scorers see the same
bookkeeping in both.
"""

from __future__ import annotations

from collections import OrderedDict

from agentserve.router.config import Options
from agentserve.router.endpoints import Endpoint
from agentserve.router.liveness import SessionLiveness

__all__ = ["MAX_OUTPUT_CHARGE", "MIN_LEARN_TOKENS", "Ledger"]

MAX_OUTPUT_CHARGE = 4096  # output tokens charged to an endpoint's in-flight load, at most
MIN_LEARN_TOKENS = 512  # smaller prefills: time to first byte is mostly overhead


class Ledger:
    """Per-endpoint load booked by routing, and session placement.

    `endpoints` is the owner's url -> `Endpoint` map (shared, not copied: the router adds
    and removes endpoints in it). Every method takes `now` from the caller's clock."""

    def __init__(self, endpoints: dict[str, Endpoint], opts: Options) -> None:
        self.endpoints = endpoints
        self.opts = opts
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session -> url of its latest turn
        self.liveness = SessionLiveness(opts.session_active_s, opts.session_pause_quantile,
                                        opts.session_entries)

    def book(self, ep: Endpoint, uncached: int, charged: int, session: str | None,
             now: float) -> int:
        """Count a request sent to `ep` (`uncached` prompt tokens to prefill, `charged`
        tokens of load); returns the uncached prefill queued there before it."""
        ahead = ep.pending_prefill
        ep.inflight += 1
        ep.count_request(now, self.opts.recent_requests_s)
        ep.inflight_tokens += charged
        ep.pending_prefill += uncached
        if session is not None:
            self._place(session, ep, now)
        return ahead

    def _place(self, session: str, ep: Endpoint, now: float) -> None:
        """`session`'s turn went to `ep`: it is busy, and lives there from now on."""
        self.liveness.start(session, now)
        eps, sessions = self.endpoints, self.sessions
        prev = sessions.get(session)
        if prev is not None and prev != ep.url and prev in eps:
            eps[prev].active.pop(session, None)  # the session moved
        ep.active[session] = now
        ep.active.move_to_end(session)
        sessions[session] = ep.url
        sessions.move_to_end(session)
        if len(sessions) > self.opts.session_entries:  # bounded: forget the longest idle
            s, u = sessions.popitem(last=False)
            if u in eps:
                eps[u].active.pop(s, None)

    def first_byte(self, url: str, uncached: int, ahead: int, sent_at: float | None,
                   now: float) -> None:
        """The endpoint answered: this request's prefill left its queue. The time since
        `sent_at` (None: unknown) for `ahead + uncached` tokens teaches its prefill speed."""
        ep = self.endpoints.get(url)
        if ep is None:
            return
        ep.pending_prefill = max(0, ep.pending_prefill - uncached)
        work = ahead + uncached
        if work >= MIN_LEARN_TOKENS and sent_at is not None and now > sent_at:
            ep.learn_prefill(work, now - sent_at)

    def finish(self, url: str, charged: int, session: str | None, now: float) -> None:
        """The request ended (success or not): release what `book` counted. A session's
        pause starts now, not when its turn was sent."""
        ep = self.endpoints.get(url)
        if ep is not None:
            ep.inflight = max(0, ep.inflight - 1)
            ep.inflight_tokens = max(0, ep.inflight_tokens - charged)
        if session is not None:
            self.liveness.end(session, now)
            if ep is not None and self.sessions.get(session) == url:
                ep.active[session] = now
                ep.active.move_to_end(session)

    def forget(self, url: str) -> None:
        """An endpoint left: no session lives there any more."""
        for s in [s for s, u in self.sessions.items() if u == url]:
            del self.sessions[s]
