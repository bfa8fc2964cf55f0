"""Our router's own routing policy for the simulator's aggregated engines.

`agentserve up` starts the router with its `default` policy (router/config.py): a precise
prefix index with speculative entries, scorers for prefix, estimated wait, live sessions,
session request rates, queue, in-flight load and KV use, and the sticky picker (keep a
session's prefix holder unless saturated; place new sessions where sessions and requests
are fewest; rebalance by request rate). The small-scale check (`benchmarks/sim_vs_bench.py`)
replays a trace through that router, so the simulator's aggregated engines route with the
same scorer and picker objects, fed by the same bookkeeping (`router.ledger.Ledger`:
in-flight load, recent requests, live sessions, learned prefill speed), kept on the
simulated clock. The prefix index is each rank's pool (blocks stored) plus speculative
entries for blocks routed there in the last `speculative_ttl_s`, as the router's precise
index holds.

The P/D pools keep `cluster.Router` (the reference deployment's llm-d endpoint-picker weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.router.config import PRESETS, EndpointConfig, Options
from agentserve.router.endpoints import Endpoint
from agentserve.router.ledger import MAX_OUTPUT_CHARGE, Ledger
from agentserve.router.picker import build_picker
from agentserve.router.scorers import Candidate, build_scorers, weighted_scores
from agentserve.sim.cluster import CPU_TIER_WEIGHT, Rank, SimRequest

__all__ = ["PolicyRouter"]


@dataclass(slots=True)
class _Booked:
    url: str
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
        # simulated endpoints: the URL only names them (the picker reports it)
        self.eps = [Endpoint(EndpointConfig(url=f"http://rank-{r.idx}")) for r in ranks]
        self.ledger = Ledger({ep.url: ep for ep in self.eps}, self.opts)
        self.liveness = self.ledger.liveness
        self.spec: list[dict[int, float]] = [{} for _ in ranks]  # hash -> speculative until
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
        n = req.head_blocks(bs)
        session = req.rec.session_id or None
        mine = self.liveness.rate(session, now) if self.rates and session else 0.0
        window, busy, tau = self.liveness.limit_s(), self.liveness.busy, self.opts.recent_requests_s
        home = self.ledger.sessions.get(session) if session and self.opts.session_affinity else None
        cands = []
        for i, (r, ep) in enumerate(zip(self.ranks, self.eps)):
            g, c = self._held(i, req.hashes, n, now)
            uncached = req.n_in - g * bs
            cand = Candidate(
                ep.url, 0, g, min(g + CPU_TIER_WEIGHT * c, float(n)), n, g * bs, uncached,
                len(r.waiting), len(r.running), r.pool.usage, ep.inflight, ep.inflight_tokens,
                ep.pending_prefill,
                (ep.pending_prefill + uncached) / (ep.prefill_tok_s or self.opts.prefill_tok_per_s),
                home == ep.url, "both", True,
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
        charged = c.uncached_tokens + min(req.n_out, MAX_OUTPUT_CHARGE)
        ahead = self.ledger.book(ep, c.uncached_tokens, charged, session, now)
        self._booked[id(req)] = _Booked(ep.url, c.uncached_tokens, charged, ahead, now, session)
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
        self.ledger.first_byte(b.url, b.uncached, b.ahead, b.sent_at, now)

    def finish(self, req: SimRequest, now: float) -> None:
        """`req` ended (success or not): release what `route` booked."""
        self.first_byte(req, now)
        b = self._booked.pop(id(req), None)
        if b is not None:
            self.ledger.finish(b.url, b.charged, b.session, now)
