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
    """

    def __init__(self, penalty_s: float = 1.0, min_share: float = 0.5, eps: float = 1e-9,
                 seed: int | None = None, moves_must_balance: bool = True,
                 force_move_s: float | None = None, place_by: str = "score",
                 place_slack: int = 1) -> None:
        if place_by not in ("score", "requests"):
            raise ValueError(f"picker place_by must be score or requests, got {place_by!r}")
        self.penalty_s = penalty_s
        self.min_share = min_share
        self.moves_must_balance = moves_must_balance
        self.force_move_s = force_move_s
        self.place_by = place_by
        self.place_slack = place_slack
        self.fallback = MaxScorePicker(eps, seed)

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[int, str]:
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
            return h, _reason(c)
        j, _ = self.fallback.pick([cands[i] for i in others], [scores[i] for i in others])
        return others[j], "saturated"

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


def _sessions(c: Candidate) -> int:
    """Active sessions on the candidate, not counting the request's own."""
    return max(0, c.active_sessions - c.session_match)


def build_picker(spec: dict[str, Any]) -> Any:
    spec = dict(spec or {"type": "max"})
    kind = spec.pop("type", "max")
    if kind not in PICKERS:
        raise ValueError(f"unknown picker {kind!r}; known: {sorted(PICKERS)}")
    return PICKERS[kind](**spec)
