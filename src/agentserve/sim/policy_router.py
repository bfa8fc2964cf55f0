"""Our router's own routing policy for the simulator's aggregated engines.

`agentserve up` starts the router with its `default` policy (router/config.py): a precise
prefix index with speculative entries, scorers for prefix, estimated wait, live sessions,
session request rates, queue, in-flight load and KV use, and the sticky picker (keep a
session's prefix holder unless saturated; place new sessions where sessions and requests
are fewest; rebalance by request rate). The small-scale check (`benchmarks/sim_vs_bench.py`)
replays a trace through that router, so the simulator's aggregated engines route with the
same scorer and picker objects, fed by the same bookkeeping (`Endpoint`'s recent-request
count, live sessions and learned prefill speed; `SessionLiveness`), kept on the simulated
clock. The prefix index is each rank's pool (blocks stored) plus speculative entries for
blocks routed there in the last `speculative_ttl_s`, as the router's precise index holds.

The P/D pools keep `cluster.Router` (the reference deployment's llm-d-like presets).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.router.config import PRESETS, EndpointConfig, Options
from agentserve.router.endpoints import Endpoint
from agentserve.router.liveness import SessionLiveness
from agentserve.router.picker import build_picker
from agentserve.router.scorers import Candidate, build_scorers, weighted_scores
from agentserve.sim.cluster import CPU_TIER_WEIGHT, Rank, SimRequest

__all__ = ["PolicyRouter"]

_MIN_LEARN_TOKENS = 512  # as router/core.py: smaller prefills' first byte is mostly overhead
_MAX_OUTPUT_CHARGE = 4096  # as router/core.py


@dataclass(slots=True)
class _Booked:
    ep: int
    uncached: int
    charged: int
    ahead: int
    sent_at: float
    session: str | None
    started: bool = False


class PolicyRouter:
    """Routes requests over `ranks` with the router's `policy` preset, on simulated time."""

    def __init__(self, ranks: list[Rank], seed: int, policy: str = "default") -> None:
        preset = PRESETS[policy]
        self.ranks = ranks
        self.opts = Options(**preset.get("options", {}))
        self.scorers = build_scorers(preset["scorers"])
        self.picker = build_picker({**preset["picker"], "seed": seed})
        self.rates = bool(getattr(self.picker, "uses_rates", False) or preset["scorers"].get("rate"))
        self.liveness = SessionLiveness(self.opts.session_active_s,
                                        self.opts.session_pause_quantile, self.opts.session_entries)
        # simulated endpoints: the URL only names them (the picker reports it)
        self.eps = [Endpoint(EndpointConfig(url=f"http://rank-{r.idx}")) for r in ranks]
        self.spec: list[dict[int, float]] = [{} for _ in ranks]  # hash -> speculative until
        self.sessions: dict[str, int] = {}  # session -> endpoint of its latest turn
        self._booked: dict[int, _Booked] = {}  # id(request) -> what routing it booked

    def _held(self, i: int, hashes: list[int], n: int, now: float) -> tuple[int, int]:
        """(GPU, CPU-continuation) leading blocks rank i holds or was just sent."""
        g, c = self.ranks[i].prefix_blocks(hashes, n)
        spec, g0 = self.spec[i], g
        while spec and g < n and spec.get(hashes[g], -1.0) >= now:
            g += 1
        return g, (0 if g > g0 else c)  # CPU blocks continue only what the GPU holds

    def route(self, req: SimRequest, now: float) -> Rank:
        """Pick a rank for `req` and book it there (call `first_byte` and `finish`)."""
        bs = self.ranks[0].pool.block_size
        n = max(0, (req.n_in - 1) // bs)
        session = req.rec.session_id or None
        mine = self.liveness.rate(session, now) if self.rates and session else 0.0
        window, busy, tau = self.liveness.limit_s(), self.liveness.busy, self.opts.recent_requests_s
        home = self.sessions.get(session) if session and self.opts.session_affinity else None
        cands = []
        for i, (r, ep) in enumerate(zip(self.ranks, self.eps)):
            g, c = self._held(i, req.hashes, n, now)
            uncached = req.n_in - g * bs
            cand = Candidate(
                ep.url, 0, g, min(g + CPU_TIER_WEIGHT * c, float(n)), n, g * bs, uncached,
                len(r.waiting), len(r.running), r.pool.usage, ep.inflight, ep.inflight_tokens,
                ep.pending_prefill,
                (ep.pending_prefill + uncached) / (ep.prefill_tok_s or self.opts.prefill_tok_per_s),
                home == i, "both", True,
                ep.active_sessions(now, window, busy) if ep.active else 0, 0,
                ep.recent_requests(now, tau))
            if self.rates:
                cand.session_rate = mine
                cand.active_rate = sum(self.liveness.rate(s, now) for s in ep.active if s != session)
            cands.append(cand)
        scores = weighted_scores(self.scorers, cands) if self.scorers else [0.0] * len(cands)
        i, _ = self.picker.pick(cands, scores)
        self._book(i, req, cands[i], session, now)
        return self.ranks[i]

    def _book(self, i: int, req: SimRequest, c: Candidate, session: str | None, now: float) -> None:
        ep = self.eps[i]
        charged = c.uncached_tokens + min(req.n_out, _MAX_OUTPUT_CHARGE)
        self._booked[id(req)] = _Booked(i, c.uncached_tokens, charged, ep.pending_prefill, now, session)
        ep.inflight += 1
        ep.count_request(now, self.opts.recent_requests_s)
        ep.inflight_tokens += charged
        ep.pending_prefill += c.uncached_tokens
        if session is not None:
            self.liveness.start(session, now)
            prev = self.sessions.get(session)
            if prev is not None and prev != i:
                self.eps[prev].active.pop(session, None)  # the session moved
            ep.active[session] = now
            ep.active.move_to_end(session)
            self.sessions[session] = i
        if self.opts.speculative_ttl_s > 0:
            until = now + self.opts.speculative_ttl_s
            spec = self.spec[i]
            for h in req.hashes[c.matched_blocks:]:
                spec[h] = until
            if len(spec) > 4 * self.ranks[i].pool.num_blocks:  # bounded: drop expired entries
                self.spec[i] = {h: t for h, t in spec.items() if t >= now}

    def first_byte(self, req: SimRequest, now: float) -> None:
        """`req`'s first token: its prefill is done (and teaches the prefill speed)."""
        b = self._booked.get(id(req))
        if b is None or b.started:
            return
        b.started = True
        ep = self.eps[b.ep]
        ep.pending_prefill = max(0, ep.pending_prefill - b.uncached)
        work = b.ahead + b.uncached
        if work >= _MIN_LEARN_TOKENS and now > b.sent_at:
            ep.learn_prefill(work, now - b.sent_at)

    def finish(self, req: SimRequest, now: float) -> None:
        """`req` ended (success or not): release what `route` booked."""
        self.first_byte(req, now)
        b = self._booked.pop(id(req), None)
        if b is None:
            return
        ep = self.eps[b.ep]
        ep.inflight = max(0, ep.inflight - 1)
        ep.inflight_tokens = max(0, ep.inflight_tokens - b.charged)
        if b.session is not None:
            self.liveness.end(b.session, now)
            if self.sessions.get(b.session) == b.ep:
                ep.active[b.session] = now  # the pause starts now, not when the turn was sent
                ep.active.move_to_end(b.session)
