"""Filters and scorers: the plugins of the routing pipeline (as llm-d's EPP).

A decision is filters -> scorers -> weighted sum -> picker. Every scorer returns one
value in [0, 1] per candidate; the YAML `scorers:` mapping names them with weights.
Adding a policy is adding a class with `@scorer("name")`, never an `if` elsewhere.

Every scorer sees `Candidate`s, which the router fills in before scoring (prefix match,
predicted cached tokens, scraped and router-known load), so scorers need no network.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

SCORERS: dict[str, type] = {}
FILTERS: dict[str, type] = {}


@dataclass(slots=True)
class Candidate:
    """One endpoint as seen by one decision."""

    url: str
    rank: int = 0  # data-parallel rank holding the longest prefix
    matched_blocks: int = 0  # leading blocks held in GPU (incl. speculative)
    weighted_blocks: float = 0.0  # leading blocks weighted by tier (GPU 1.0, CPU 0.8 ...)
    total_blocks: int = 0  # cacheable blocks of the prompt: (prompt_len - 1) // block_size
    predicted_cached: int = 0  # tokens the engine will report as cached
    uncached_tokens: int = 0  # prompt tokens to prefill there
    waiting: int = 0  # vllm:num_requests_waiting (0 when stale)
    running: int = 0
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc in [0, 1]
    inflight: int = 0  # requests the router has sent and not seen finish
    inflight_tokens: int = 0  # their prompt + max output tokens
    pending_prefill: int = 0  # uncached prompt tokens routed there, before first byte
    est_wait_s: float = 0.0  # estimated time to first token if routed there
    session_match: bool = False
    role: str = "both"
    model_ok: bool = True
    active_sessions: int = 0  # live sessions whose latest turn went here (router/liveness.py)
    active_tokens: int = 0  # their latest prompts' tokens, the request's own session not counted
    recent_requests: float = 0.0  # requests routed here, decayed (options.recent_requests_s)
    active_rate: float = 0.0  # requests/s of its live sessions, the request's own not counted
    session_rate: float = 0.0  # requests/s of the request's own session (same for all)


def _fewest_best(n: list[float] | list[int]) -> list[float]:
    """1 for the lowest value, 0 for the highest, linear between; all 1 when equal."""
    lo, hi = min(n, default=0.0), max(n, default=0.0)
    if hi - lo < 1e-9:
        return [1.0] * len(n)
    return [(hi - x) / (hi - lo) for x in n]


class Scorer(Protocol):
    def score(self, cands: list[Candidate]) -> list[float]: ...


class Filter(Protocol):
    def keep(self, c: Candidate) -> bool: ...


def scorer(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        SCORERS[name] = cls
        return cls
    return deco


def filter_(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        FILTERS[name] = cls
        return cls
    return deco


@scorer("prefix")
class PrefixScorer:
    """Share of the prompt's cacheable blocks the endpoint already holds, tier-weighted.

    A block in GPU memory counts 1.0, one in the CPU tier 0.8, disk 0.5 (options.
    tier_weights). Only the leading run counts: a hole ends the reusable prefix.
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        return [min(1.0, c.weighted_blocks / c.total_blocks) if c.total_blocks else 0.0
                for c in cands]


@scorer("gpu_prefix")
class GPUPrefixScorer:
    """Share of the prompt's cacheable blocks held in GPU memory (the leading run), no tier
    credit: the first of the two prefix scorers of llm-d's GLM-5.2 P/D configuration
    (`gpu-prefix-cache-scorer`, weight 5, beside a GPU-or-CPU one at weight 2)."""

    def score(self, cands: list[Candidate]) -> list[float]:
        return [min(1.0, c.matched_blocks / c.total_blocks) if c.total_blocks else 0.0
                for c in cands]


@scorer("active")
class ActiveRequestsScorer:
    """Fewest requests in flight: `(most - mine) / most` over the candidates (1 for all
    when none has any), llm-d's `active-request-scorer`. It counts requests, not tokens
    (`inflight` weighs tokens): a 200K-token prompt and a 2K one count alike."""

    def score(self, cands: list[Candidate]) -> list[float]:
        top = max((c.inflight for c in cands), default=0)
        return [(top - c.inflight) / top if top else 1.0 for c in cands]


@scorer("kv_util")
class KVUtilScorer:
    """Free KV cache: 1 - vllm:kv_cache_usage_perc (a full cache evicts someone's prefix)."""

    def score(self, cands: list[Candidate]) -> list[float]:
        return [max(0.0, 1.0 - c.kv_usage) for c in cands]


@scorer("queue")
class QueueScorer:
    """Short queues: 1 / (1 + vllm:num_requests_waiting)."""

    def score(self, cands: list[Candidate]) -> list[float]:
        return [1.0 / (1.0 + c.waiting) for c in cands]


@scorer("inflight")
class InflightScorer:
    """Router-known load: 1 - tokens in flight / the most any candidate has.

    Updated at decision time, so concurrent decisions (a burst of sub-agents) see
    each other before any metrics scrape could.
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        top = max((c.inflight_tokens for c in cands), default=0)
        return [1.0 - c.inflight_tokens / top if top else 1.0 for c in cands]


@scorer("wait")
class WaitScorer:
    """Estimated time to first token (queued uncached prefill + this request's, at the
    endpoint's learned prefill speed), relative to the best: (1 + min) / (1 + wait_s).

    1 for the soonest endpoint; an endpoint twice as slow to start scores ~0.5 whether
    the waits are 10 and 20 s or 0.5 and 2 s (the 1 s keeps sub-second differences from
    counting as large). Unlike `queue` (requests waiting, scraped) it weighs queued work
    in tokens, so a new session's large first prefill avoids an endpoint already busy
    with one."""

    def score(self, cands: list[Candidate]) -> list[float]:
        lo = 1.0 + min((c.est_wait_s for c in cands), default=0.0)
        return [lo / (1.0 + c.est_wait_s) for c in cands]


@scorer("balance")
class BalanceScorer:
    """Spread sessions: 1 for the fewest active sessions, 0 for the most (linear between).

    Sessions, not instantaneous queues, are what future load follows: each active
    session sends its next turns where its prefix is. Placing new sessions (those with
    no prefix holder) on the endpoint with the fewest keeps request counts even.
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        # The request's own session does not count against the endpoint it is on.
        n = [max(0, c.active_sessions - c.session_match) for c in cands]
        return _fewest_best(n)


@scorer("requests")
class RecentRequestsScorer:
    """Spread requests: 1 for the fewest recently routed requests, 0 for the most.

    An exponentially decayed count of the requests routed to each endpoint (time
    constant `options.recent_requests_s`). Sessions differ in how fast they turn over
    (tool pauses of 1 s or of minutes), so equal session counts can still mean unequal
    request rates; placing new sessions where the recent rate is lowest evens out the
    requests each endpoint serves, which session counts alone leave to chance.

    It steers only requests whose session has no endpoint yet (no candidate matches
    it): a session's own past requests would otherwise count against its endpoint and
    outweigh affinity (placing a known session is the prefix and sticky picker's job).
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        if any(c.session_match for c in cands):
            return [1.0] * len(cands)
        n = [c.recent_requests for c in cands]
        return _fewest_best(n)


@scorer("rate")
class SessionRateScorer:
    """Spread request rate: 1 for the endpoint whose live sessions send the fewest
    requests per second (`Candidate.active_rate`), 0 for the most.

    The forward-looking counterpart of `requests`: what the sessions placed there now
    will send, not what was sent over the last minute. A session's rate comes from the
    recent intervals between its requests (router/liveness.py), so it folds in both how
    long its tool pauses are and how fast its endpoint answers: an endpoint slowed by
    large prefills has slow sessions, a low rate, and draws new sessions until its rate
    catches up. Like `requests` it steers only requests whose session has no endpoint yet.
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        if any(c.session_match for c in cands):
            return [1.0] * len(cands)
        n = [c.active_rate for c in cands]
        return _fewest_best(n)


@scorer("session_tokens")
class SessionTokensScorer:
    """Spread session work: 1 for the fewest active session tokens, 0 for the most.

    The active sessions' latest prompt lengths, summed per endpoint: what their next
    turns will keep resident in KV (and restore or recompute if it does not fit), where
    `balance` counts every session alike. Sessions of 25K and of 500 tokens differ 50x
    in KV and first-turn prefill; placing new sessions by count alone stacked the large
    ones on one endpoint in the captured-reuse benchmark (its live prompts reached 4x
    the others', and it served the fewest requests).
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        n = [c.active_tokens for c in cands]
        return _fewest_best(n)


@scorer("session")
class SessionScorer:
    """Session affinity: 1 for the endpoint that served this session's last turn.

    The session is the `x-session-id` header or the request's `user` field.
    """

    def score(self, cands: list[Candidate]) -> list[float]:
        return [1.0 if c.session_match else 0.0 for c in cands]


@filter_("model")
class ModelFilter:
    """Drop endpoints that do not serve the requested model."""

    def keep(self, c: Candidate) -> bool:
        return c.model_ok


@filter_("role")
class RoleFilter:
    """Keep endpoints that can serve a whole request (role both, or decode when no P/D)."""

    def __init__(self, roles: tuple[str, ...] = ("both",)) -> None:
        self.roles = roles

    def keep(self, c: Candidate) -> bool:
        return c.role in self.roles


def build_scorers(weights: dict[str, float]) -> list[tuple[float, Any]]:
    """Instantiate the configured scorers; unknown names are an error that lists the known."""
    out = []
    for name, w in weights.items():
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
        if w:
            out.append((float(w), SCORERS[name]()))
    return out


def weighted_scores(scorers: list[tuple[float, Any]], cands: list[Candidate]) -> list[float]:
    """Sum of weight * score per candidate (one pass per scorer)."""
    total = [0.0] * len(cands)
    for w, s in scorers:
        total = [t + w * v for t, v in zip(total, s.score(cands))]
    return total
