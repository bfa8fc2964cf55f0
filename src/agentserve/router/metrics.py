"""The router's Prometheus metrics (`/metrics`), one registry per gateway.

Names are `agentserve_router_*`. Predicted vs actual cached tokens compare the router's
prediction with `usage.prompt_tokens_details.cached_tokens` of the response (when the
response carries usage), so their ratio is the prediction accuracy.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class RouterMetrics:
    """Counters, gauges and histograms the gateway updates."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "agentserve_router_"
        self.decisions = Counter(p + "decisions", "Routing decisions", ["endpoint", "reason"],
                                 registry=r)
        self.decision_seconds = Histogram(p + "decision_seconds", "Time to decide (parse the "
                                          "body, tokenize, hash, look up, score, pick)",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter(p + "requests", "Requests answered", ["code"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens routed", registry=r)
        self.predicted_cached = Counter(p + "predicted_cached_tokens",
                                        "Cached tokens the router predicted (responses with "
                                        "usage)", registry=r)
        self.actual_cached = Counter(p + "actual_cached_tokens", "Cached tokens engines "
                                     "reported (usage.prompt_tokens_details)", registry=r)
        self.prediction_exact = Counter(p + "prediction_exact", "Responses whose cached "
                                        "tokens equal the prediction", registry=r)
        self.prediction_total = Counter(p + "prediction_checked", "Responses with usage",
                                        registry=r)
        self.token_id_parses = Gauge(p + "token_id_parses", "Token-id prompt bodies by parse "
                                     "mode (full decode, incremental: shared bytes with a "
                                     "cached body); counts since start", ["mode"], registry=r)
        self.retries = Counter(p + "retries", "Requests retried on another endpoint",
                               registry=r)
        self.ejections = Counter(p + "ejections", "Endpoint ejections", ["endpoint"],
                                 registry=r)
        self.panic_routing = Gauge(p + "panic_routing", "Routing decisions that sent traffic "
                                   "to outlier-ejected endpoints because too few of a role "
                                   "were left (options.panic_threshold); since start",
                                   registry=r)
        self.rejected = Counter(p + "rejected", "Requests refused by admission control",
                                registry=r)
        self.index_blocks = Gauge(p + "index_blocks", "Blocks in the prefix index", registry=r)
        self.event_lag = Gauge(p + "event_lag_seconds", "Age of the last applied KV event "
                               "batch when applied", ["endpoint"], registry=r)
        self.event_gaps = Gauge(p + "event_gaps", "KV event sequence gaps seen",
                                ["endpoint"], registry=r)
        self.inflight = Gauge(p + "inflight", "Requests in flight", ["endpoint"], registry=r)
        self.healthy = Gauge(p + "endpoint_healthy", "1 if the endpoint takes traffic",
                             ["endpoint"], registry=r)
        self.queue = Gauge(p + "queue_depth", "Requests waiting for admission", registry=r)
        self.chat_renders = Gauge(p + "chat_renders", "Chat template renders by mode (full, "
                                  "incremental, fallback: not append-only, verified: checked "
                                  "against a full render); counts since start", ["mode"],
                                  registry=r)

    def observe_cached(self, predicted: int, actual: int) -> None:
        self.predicted_cached.inc(predicted)
        self.actual_cached.inc(actual)
        self.prediction_total.inc()
        if predicted == actual:
            self.prediction_exact.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
