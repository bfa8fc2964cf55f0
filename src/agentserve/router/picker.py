"""Pickers: turn scored candidates into one endpoint and a reason (for /metrics).

Configured by `picker: {type: ..., ...}` in the router YAML.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from agentserve.router.scorers import Candidate

PICKERS: dict[str, type] = {}


class Picker(Protocol):
    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]: ...


def picker(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        PICKERS[name] = cls
        return cls
    return deco


def _reason(c: Candidate) -> str:
    if c.session_match and c.matched_blocks:
        return "session"
    return "prefix" if c.matched_blocks else "load"


@picker("max")
class MaxScorePicker:
    """Highest weighted score; ties (within `eps`) broken at random."""

    def __init__(self, eps: float = 1e-9, seed: int | None = None) -> None:
        self.eps = eps
        self.rng = random.Random(seed)

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]:
        top = max(scores)
        best = [i for i, s in enumerate(scores) if s >= top - self.eps]
        i = best[0] if len(best) == 1 else self.rng.choice(best)
        return i, _reason(cands[i])


@picker("round-robin")
class RoundRobinPicker:
    """Each candidate in turn, ignoring scores (the baseline every router must beat)."""

    def __init__(self) -> None:
        self.next = 0

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]:
        i = self.next % len(cands)
        self.next += 1
        return i, "round-robin"


@picker("sticky")
class StickyPicker:
    """Sticky until saturated: stay with the prefix holder unless its wait is too long.

    The holder is the candidate with the longest (tier-weighted) prefix, ties broken by
    score. Stickiness applies only when the holder has at least `min_share` of the
    prompt's blocks (a shared system prompt alone must not pull every new session onto
    one endpoint); the holder is then kept unless its estimated time to first token
    (queued prefill plus this request's uncached prefill, `Candidate.est_wait_s`) exceeds
    another candidate's by more than `penalty_s`; then the highest-scoring such candidate
    wins ("saturated"). With no prefix anywhere it is the max-score picker.

    A move recomputes the whole prefix and takes the session's later turns along, so
    with `moves_must_balance` (the default) a session only moves to an endpoint with at
    least two fewer active sessions than its holder (the session itself not counted).
    Each move then strictly lowers the sum of squared session counts: moves cannot
    cascade (A's sessions fleeing to B, then B's back to A), and a holder that is only
    briefly busy (one large new-session prefill queued ahead) keeps its sessions, since
    the others have as many sessions as it has. A holder with more sessions than the
    others, and a long queue, still sheds them. With `force_move_s` set, a holder whose
    wait exceeds another's by more than that sheds the session to the fastest candidate
    regardless of balance (an endpoint far slower than the rest). It is off by default:
    the waits rest on learned prefill speeds, and on the captured-reuse benchmark a few
    outlier estimates (100K+ tok/s learned for ~1.5K tok/s engines, from requests whose
    queued work ahead was already partly done) made such forced moves cost 3% of reuse.

    Rebalancing (`rebalance_slack`, off unless set; on in the `default` preset): equal
    live sessions can still mean unequal requests, since sessions turn over at different
    rates and a slower endpoint's sessions send fewer turns. When the holder was sent more
    than (1 + slack) times the recent requests (`Candidate.recent_requests`) of the least
    loaded endpoint, the session moves there, under three guards: (1) after the move the
    holder's live sessions still send at least as many requests per second as the
    target's (`active_rate` + the session's own `session_rate`), so moves never overshoot
    or cascade, and a slow endpoint whose count is low only because it is slow gets
    sessions only while its live sessions' rates are lower; (2) the target's queue (not
    counting this request's recompute) is within `penalty_s` of the holder's; (3) the
    recompute a move costs (its extra uncached tokens) is paid from a budget of
    `rebalance_budget` times the prefix tokens this picker has reused so far, and one
    move takes at most half of what is left, so the budget goes to small sessions first.
    """

    def __init__(self, penalty_s: float = 1.0, min_share: float = 0.5, eps: float = 1e-9,
                 seed: int | None = None, moves_must_balance: bool = True,
                 force_move_s: float | None = None, place_by: str = "score",
                 place_slack: int = 1, rebalance_slack: float | None = None,
                 rebalance_budget: float = 0.015) -> None:
        if place_by not in ("score", "requests"):
            raise ValueError(f"picker place_by must be score or requests, got {place_by!r}")
        if rebalance_slack is not None and not rebalance_slack >= 0:
            raise ValueError("picker rebalance_slack must be >= 0 or null, "
                             f"got {rebalance_slack!r}")
        if not 0 <= rebalance_budget < 1:
            raise ValueError(f"picker rebalance_budget must be in [0, 1), got {rebalance_budget!r}")
        self.penalty_s = penalty_s
        self.min_share = min_share
        self.moves_must_balance = moves_must_balance
        self.force_move_s = force_move_s
        self.place_by = place_by
        self.place_slack = place_slack
        self.fallback = MaxScorePicker(eps, seed)
        self.rebalance_slack = rebalance_slack
        self.rebalance_budget = rebalance_budget
        self.uses_rates = rebalance_slack is not None  # the router fills in the rates
        self.reused = 0  # prefix tokens of every pick: what the rebalance budget is a share of
        self.spent = 0  # tokens recomputed by rebalancing moves

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]:
        i, reason = self._choose(cands, scores)
        self.reused += cands[i].predicted_cached
        return i, reason

    def _choose(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]:
        idx = range(len(cands))
        h = max(idx, key=lambda i: (cands[i].weighted_blocks, scores[i]))
        c = cands[h]
        if c.weighted_blocks <= 0 or c.weighted_blocks < self.min_share * c.total_blocks \
                or len(cands) == 1:
            return self._place(cands, scores)
        limit = c.est_wait_s - self.penalty_s
        others = [i for i in idx if i != h and cands[i].est_wait_s < limit]
        if self.moves_must_balance and others:
            n_h = _sessions(c)
            balancing = [i for i in others if _sessions(cands[i]) < n_h - 1]
            if not balancing and self.force_move_s is not None:
                fast = min(others, key=lambda i: cands[i].est_wait_s)
                if cands[fast].est_wait_s < c.est_wait_s - self.force_move_s:
                    return fast, "saturated"
            others = balancing
        if not others:
            t = self._rebalance(cands, h)
            return (h, _reason(c)) if t is None else (t, "rebalance")
        j, _ = self.fallback.pick([cands[i] for i in others], [scores[i] for i in others])
        return others[j], "saturated"

    def _rebalance(self, cands: list[Candidate], h: int) -> int | None:
        """The endpoint to move the holder `h`'s session to for request balance, or None
        (see the class docstring)."""
        if self.rebalance_slack is None:
            return None
        c = cands[h]
        if not c.session_match:  # only a session's own holder sheds it
            return None
        q_h = _queue_s(c)
        ok = [i for i in range(len(cands))
              if i != h and _queue_s(cands[i]) <= q_h + self.penalty_s]
        if not ok:
            return None
        t = min(ok, key=lambda i: (cands[i].recent_requests, cands[i].est_wait_s))
        o = cands[t]
        if c.recent_requests <= (1 + self.rebalance_slack) * o.recent_requests + 1:
            return None
        if c.active_rate < o.active_rate + c.session_rate:
            return None  # the move would just make the target the busier one
        cost = max(0, o.uncached_tokens - c.uncached_tokens)
        if cost > 0.5 * (self.rebalance_budget * self.reused - self.spent):
            return None
        self.spent += cost
        return t

    def _place(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]:
        """A request no endpoint holds the prefix of (a new session, a sub-agent).

        `place_by: score` takes the highest score. `place_by: requests` takes the
        endpoint that was sent the fewest requests recently (`Candidate.recent_requests`)
        among those within `place_slack` live sessions of the fewest, within `penalty_s`
        of the shortest wait and within 10% of the prompt of the longest prefix held
        among those; score breaks ties. When no endpoint meets both guards (those with
        the fewest sessions all have long queues), the highest score wins. The request count is what
        the session's future turns add to; the two guards keep an endpoint that serves
        few requests because it is slow from drawing every new session (more sessions
        would make it slower still) and keep a new session's first turn off a queue
        that is clogged right now."""
        if self.place_by == "score" or len(cands) == 1:
            return self.fallback.pick(cands, scores)
        n = [_sessions(c) for c in cands]
        lo_n, lo_w = min(n), min(c.est_wait_s for c in cands)
        ok = [i for i, c in enumerate(cands)
              if n[i] <= lo_n + self.place_slack and c.est_wait_s <= lo_w + self.penalty_s]
        if not ok:  # the fewest sessions are all behind a long queue: weigh both by score
            return self.fallback.pick(cands, scores)
        # A part of the prompt held somewhere (under `min_share`, e.g. a sub-agent's earlier
        # call) still saves its recompute: only endpoints within 10% of the prompt of the
        # best such prefix compete on requests (a system prompt held everywhere ties).
        top = max(cands[i].weighted_blocks for i in ok)
        ok = [i for i in ok if cands[i].weighted_blocks >= top - 0.1 * cands[i].total_blocks]
        least = min(cands[i].recent_requests for i in ok)
        ties = [i for i in ok if cands[i].recent_requests < least + 0.5]
        j, _ = self.fallback.pick([cands[i] for i in ties], [scores[i] for i in ties])
        return ties[j], _reason(cands[ties[j]])


def _queue_s(c: Candidate) -> float:
    """Estimated wait for the prefill queued ahead (`est_wait_s` less the request's own)."""
    work = c.pending_prefill + c.uncached_tokens
    return c.est_wait_s * c.pending_prefill / work if work else 0.0


def _sessions(c: Candidate) -> int:
    """Active sessions on the candidate, not counting the request's own."""
    return max(0, c.active_sessions - c.session_match)


def build_picker(spec: dict[str, Any]) -> Any:
    spec = dict(spec or {"type": "max"})
    kind = spec.pop("type", "max")
    if kind not in PICKERS:
        raise ValueError(f"unknown picker {kind!r}; known: {sorted(PICKERS)}")
    return PICKERS[kind](**spec)
