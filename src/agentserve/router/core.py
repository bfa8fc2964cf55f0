"""The routing decision, without HTTP: prompt -> block keys -> candidates -> scores -> pick.

`Router.decide` is what the gateway calls per request and what the simulator can drive
on its own clock. It

1. hashes the prompt's full blocks once per hasher (algo, block size, seed) in use,
   reusing the hashes of the prompt's cached prefix (`prefix.HashCache`);
2. looks the keys up in the index in one pass (`PrefixIndex.match`);
3. fills a `Candidate` per available endpoint: prefix run, predicted cached tokens,
   scraped load (if fresh), router-known load, active sessions, and the estimated wait
   (queued uncached prefill / the endpoint's prefill speed, learned at first byte);
4. filters, scores (weighted sum of plugins), picks;
5. books the decision: in-flight counts, session affinity, speculative index entries
   (precise mode) or LRU entries (approximate mode).

Predicted cached tokens model the engine exactly: matched full blocks, capped so the
last prompt token is always computed: `min(run, (prompt_len - 1) // block_size) * bs`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentserve.kv.hashing import BlockHasher
from agentserve.router.approx import ApproxTracker
from agentserve.router.config import EndpointConfig, RouterConfig
from agentserve.router.endpoints import Endpoint
from agentserve.router.index import Match, PrefixIndex
from agentserve.router.ledger import MAX_OUTPUT_CHARGE, Ledger
from agentserve.router.picker import build_picker
from agentserve.router.prefix import HashCache
from agentserve.router.scorers import (Candidate, ModelFilter, RoleFilter, build_scorers,
                                       weighted_scores)
from agentserve.prompt.incremental import Tokenized

HasherId = tuple[str, int, "str | None"]


class NoEndpoint(Exception):
    """No endpoint can take the request; the message says why (503, 404 or 400).
    `kind`, `param` and `code` fill the OpenAI error object as the engine fills its own."""

    def __init__(self, message: str, status: int = 503, kind: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or ("service_unavailable" if status == 503 else "invalid_request_error")


@dataclass(slots=True)
class RouteInput:
    """What the router needs to know about one request."""

    token_ids: Sequence[int]
    model: str | None = None
    session: str | None = None
    max_tokens: int = 256
    samples: int = 1  # the body's `n`: that many outputs are charged (the prompt once)
    tokenized: Tokenized | None = None  # text/chat/token-id bodies: the parse cache's entry
    parse_seconds: float = 0.0  # body decode + tokenization, part of the decision latency


@dataclass(slots=True)
class Decision:
    """The chosen endpoint and what the router booked for it."""

    url: str
    rank: int
    reason: str
    prompt_len: int
    predicted_cached: int
    charged_tokens: int
    uncached: int
    seconds: float
    scores: dict[str, float] = field(default_factory=dict)
    keys: Sequence[int] = field(default_factory=list)
    started: bool = False
    sent_at: float = 0.0  # monotonic time of booking
    ahead: int = 0  # uncached prompt tokens queued on the endpoint before this one
    session: str | None = None
    finished: bool = False


class Router:
    """Owns endpoints, the index and the pipeline; `decide` and `finish` per request."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.opts = cfg.options
        self.index = PrefixIndex(self.opts.tier_weights, self.opts.exact_match)
        self.endpoints: dict[str, Endpoint] = {}
        self.approx: dict[str, ApproxTracker] = {}
        self.caches: dict[HasherId, HashCache] = {}
        self.ledger = Ledger(self.endpoints, self.opts)  # booked load, session placement
        self.sessions = self.ledger.sessions  # session -> url of its latest turn
        self.liveness = self.ledger.liveness
        # session -> its latest prompt length, for Candidate.active_tokens (only kept
        # when a scorer uses it: the sum costs one lookup per active session)
        self.session_tokens: dict[str, int] = {}
        self._count_tokens = bool(cfg.scorers.get("session_tokens"))
        self.scorers = build_scorers(cfg.scorers)
        self.picker = build_picker(cfg.picker)
        # Candidate.active_rate / session_rate: only for rebalancing or the `rate` scorer
        self._count_rates = bool(getattr(self.picker, "uses_rates", False)
                                 or cfg.scorers.get("rate"))
        self.panics = 0  # decisions that routed to ejected endpoints (panic threshold)
        self.filters = [ModelFilter()]
        self.role_filter = RoleFilter()
        for e in cfg.endpoints:
            self.add_endpoint(e)

    # ---- endpoints ------------------------------------------------------------------
    def add_endpoint(self, e: EndpointConfig) -> Endpoint:
        ep = self.endpoints.get(e.url)
        if ep is None:
            ep = self.endpoints[e.url] = Endpoint(e)
        if self.cfg.index == "approx" or (self.cfg.index == "precise" and not e.kv_events):
            cap = e.capacity_blocks or 1 << 16
            self.approx[e.url] = ApproxTracker(self.index, (e.url, 0), cap)
        return ep

    def remove_endpoint(self, url: str) -> None:
        url = url.rstrip("/")
        self.endpoints.pop(url, None)
        self.approx.pop(url, None)
        self.index.drop_endpoint(url)
        self.ledger.forget(url)

    def hasher_id(self, ep: Endpoint) -> HasherId:
        return (ep.cfg.hash_algo, ep.block_size or self.opts.block_size, ep.cfg.hash_seed)

    def cache_for(self, hid: HasherId) -> HashCache:
        c = self.caches.get(hid)
        if c is None:
            hasher = BlockHasher(hid[0], hid[1], hid[2])
            c = self.caches[hid] = HashCache(hasher, max_chunks=self.opts.hash_cache_chunks)
        return c

    # ---- hashing ----------------------------------------------------------------------
    def keys_for(self, hid: HasherId, req: RouteInput) -> Sequence[int]:
        """The prompt's block keys for one hasher, hashing only blocks not seen before."""
        cache = self.cache_for(hid)
        tk = req.tokenized
        if tk is None:
            return cache.keys_for_tokens(req.token_ids).keys
        ph = tk.entry.hashes.get(hid)
        if ph is None:
            base = tk.base.hashes.get(hid) if tk.base is not None else None
            ph = cache.extend(base, tk.shared, tk.ids) if base is not None \
                else cache.keys_for_tokens(tk.ids)
            tk.entry.hashes[hid] = ph
        return ph.keys

    # ---- candidates -------------------------------------------------------------------
    def live(self, count: bool = True) -> list[Endpoint]:
        """Endpoints to route to: those available, plus, per role, the outlier-ejected
        ones whose health checks pass when ejection left fewer than `panic_threshold` of
        the role's endpoints (and never none) available: Envoy's panic routing, so that
        errors cannot take a role's last endpoint out. Counted in `panics`."""
        eps = self.endpoints.values()
        live = [ep for ep in eps if ep.healthy and not ep.ejected]
        if len(live) == len(eps):
            return live
        panic = False
        for role in {ep.cfg.role for ep in eps if ep.ejected and ep.healthy}:
            members = [ep for ep in eps if ep.cfg.role == role]
            up = sum(1 for ep in members if ep.healthy and not ep.ejected)
            if up == 0 or up < self.opts.panic_threshold * len(members):
                live += [ep for ep in members if ep.healthy and ep.ejected]
                panic = True
        self.panics += panic and count
        return live

    def candidates(self, req: RouteInput, now: float) -> tuple[list[Candidate], dict]:
        live = self.live()
        if not live:
            raise NoEndpoint("no healthy endpoint: all backends are down or ejected; "
                             "check the router's /health and the engines' logs")
        by_hid: dict[HasherId, list[Endpoint]] = {}
        default_bs = self.opts.block_size
        for ep in live:
            c = ep.cfg
            hid = (c.hash_algo, c.block_size or ep.scrape.block_size or default_bs, c.hash_seed)
            eps = by_hid.get(hid)
            if eps is None:
                by_hid[hid] = [ep]
            else:
                eps.append(ep)
        cands: list[Candidate] = []
        keys: dict[HasherId, Sequence[int]] = {}
        plen, model = len(req.token_ids), req.model
        sess_url = self.sessions.get(req.session) \
            if req.session is not None and self.opts.session_affinity else None
        stale, tok_s = self.opts.metrics_stale_s, self.opts.prefill_tok_per_s
        weights, window = self.opts.tier_weights, self.liveness.limit_s()
        busy = self.liveness.busy
        tau = self.opts.recent_requests_s
        rates, rate = self._count_rates, self.liveness.rate
        mine = rate(req.session, now) if rates and req.session is not None else 0.0
        add = cands.append
        for hid, eps in by_hid.items():
            k = keys[hid] = self.keys_for(hid, req) if self.cfg.index != "none" else []
            m = self.index.match(k, now) if k else Match(0, [], {})
            bs = hid[1]
            cacheable = max(0, (plen - 1) // bs)
            runs = m.runs
            for ep in eps:
                c = ep.cfg
                url = c.url
                rank, run, weighted = 0, 0, 0.0
                if runs:
                    for r in range(c.dp_ranks):
                        h = (url, r)
                        if h in runs:
                            w = m.weighted(h, weights)
                            if w > weighted:
                                rank, weighted, run = r, w, m.best_run(h)
                matched = min(run, cacheable)
                uncached = plen - matched * bs
                pending = ep.pending_prefill
                if now - ep.scraped_at <= stale:
                    sc = ep.scrape
                    waiting, running, kv = sc.waiting, sc.running, sc.kv_usage
                else:
                    waiting, running, kv = 0, 0, 0.0
                # Estimated time to first token there: queued uncached prefill plus this
                # request's, at the endpoint's learned prefill speed.
                add(Candidate(url, rank, matched, min(weighted, float(cacheable)), cacheable,
                              matched * bs, uncached, waiting, running, kv, ep.inflight,
                              ep.inflight_tokens, pending,
                              (pending + uncached) / (ep.prefill_tok_s or tok_s),
                              sess_url is not None and sess_url == url, c.role,
                              True if model is None else ep.serves(model),
                              ep.active_sessions(now, window, busy) if ep.active else 0, 0,
                              ep.recent_requests(now, tau)))
                if self._count_tokens and ep.active:
                    st = self.session_tokens
                    own = st.get(req.session, 0) if sess_url == url else 0
                    cands[-1].active_tokens = sum(st.get(s, 0) for s in ep.active) - own
                if rates:
                    cands[-1].session_rate = mine
                    cands[-1].active_rate = sum(rate(s, now) for s in ep.active
                                                if s != req.session)
        if self._count_tokens and req.session is not None:
            st = self.session_tokens
            st.pop(req.session, None)
            st[req.session] = plen
            if len(st) > self.opts.session_entries:
                del st[next(iter(st))]
        return cands, keys

    def _filter(self, cands: list[Candidate], model: str | None) -> list[Candidate]:
        for f in self.filters:
            cands = [c for c in cands if f.keep(c)]
        if not cands:
            raise NoEndpoint(f"model {model!r} is not served by any endpoint", 404,
                             param="model", code="model_not_found")
        whole = [c for c in cands if self.role_filter.keep(c)]
        return whole or cands

    def fits(self, cands: list[Candidate], plen: int) -> list[Candidate]:
        """Drop endpoints whose context limit (learned `max_model_len`) the prompt leaves
        no room under; if that is all of them, the request is the client's error (400, as
        vLLM answers it), not load: it never reaches a backend or counts as a decision."""
        eps = self.endpoints
        fit = [c for c in cands if (m := eps[c.url].max_model_len) is None or plen < m]
        if fit:
            return fit
        limit = max(eps[c.url].max_model_len or 0 for c in cands)
        raise NoEndpoint(f"This model's maximum context length is {limit} tokens. However, "
                         f"your prompt has {plen} tokens, leaving no room for output. Please "
                         "shorten the prompt.", 400, "invalid_request_error", "prompt",
                         "context_length_exceeded")

    # ---- decide -------------------------------------------------------------------
    def decide(self, req: RouteInput, exclude: set[str] | None = None) -> Decision:
        """Pick an endpoint for `req` and book it (call `finish` when it completes)."""
        t0 = time.perf_counter()
        now = time.monotonic()
        cands, keys = self.candidates(req, now)
        cands = self._filter(cands, req.model)
        cands = self.fits(cands, len(req.token_ids))
        if exclude:
            cands = [c for c in cands if c.url not in exclude] or cands
        return self.pick_and_book(req, cands, keys, now, t0)

    def pick_and_book(self, req: RouteInput, cands: list[Candidate],
                      keys: dict[HasherId, Sequence[int]], now: float, t0: float,
                      charge_output: bool = True) -> Decision:
        """Score and pick among `cands` (from `candidates`), book the choice. Without
        `charge_output` (a prefill leg) one output token is charged."""
        scores = weighted_scores(self.scorers, cands) if self.scorers else [0.0] * len(cands)
        i, reason = self.picker.pick(cands, scores)
        c = cands[i]
        ep = self.endpoints[c.url]
        out = min(req.max_tokens, MAX_OUTPUT_CHARGE) * req.samples if charge_output else 1
        d = Decision(url=c.url, rank=c.rank, reason=reason, prompt_len=len(req.token_ids),
                     predicted_cached=c.predicted_cached, charged_tokens=c.uncached_tokens + out,
                     uncached=c.uncached_tokens, seconds=0.0,
                     scores={x.url: s for x, s in zip(cands, scores)},
                     keys=keys.get(self.hasher_id(ep), []))
        self._book(ep, d, c, req, now)
        d.seconds = time.perf_counter() - t0
        return d

    def _book(self, ep: Endpoint, d: Decision, c: Candidate, req: RouteInput,
              now: float) -> None:
        d.sent_at, d.session = now, req.session
        d.ahead = self.ledger.book(ep, d.uncached, d.charged_tokens, req.session, now)
        tracker = self.approx.get(ep.url)
        if tracker is not None:
            tracker.touch(d.keys)
        elif self.opts.speculative_ttl_s > 0 and d.keys:
            self.index.speculate((ep.url, c.rank), d.keys[c.matched_blocks:],
                                 self.opts.speculative_ttl_s, now)

    def first_byte(self, d: Decision) -> None:
        """The endpoint started answering: its prefill of this request is done."""
        if not d.started:
            d.started = True
            self.ledger.first_byte(d.url, d.uncached, d.ahead, d.sent_at or None, time.monotonic())

    def finish(self, d: Decision) -> None:
        """The request ended (success or not): release what `decide` booked (once)."""
        if d.finished:
            return
        d.finished = True
        self.first_byte(d)
        self.ledger.finish(d.url, d.charged_tokens, d.session, time.monotonic())

    def stats(self) -> dict[str, Any]:
        return {"index_blocks": len(self.index), "endpoints": len(self.endpoints),
                "hash_chunks": sum(len(c) for c in self.caches.values())}
