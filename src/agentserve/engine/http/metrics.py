"""Prometheus metrics under vLLM's names, on a registry private to one server.

Gauges and counters are read from `engine.stats()` at scrape time by a custom
collector, so they can never drift from the engine's own counts. Latency
histograms are observed by the server per request (TTFT, inter-token latency,
end-to-end), with vLLM's bucket boundaries. Every series carries `model_name`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                   Metric)

from agentserve.gcpause import PAUSE_BUCKETS, pause_tracker
from agentserve.kv.offload.tiers import RESTORE_BUCKETS

# vLLM v1 bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# (stats field, metric name without _total, help)
COUNTERS = [
    ("prefix_queries_tokens", "vllm:prefix_cache_queries", "Prefix cache queries, in tokens."),
    ("prefix_hits_tokens", "vllm:prefix_cache_hits",
     "Prefix cache hits, in tokens (every tier, as usage.prompt_tokens_details.cached_tokens)."),
    ("num_preemptions", "vllm:num_preemptions", "Cumulative number of preemptions."),
    ("prompt_tokens", "vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "vllm:generation_tokens", "Number of generation tokens processed."),
    ("spec_num_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ("prefix_joined_tokens", "agentserve:prefix_joined_tokens",
     "Prompt tokens not computed: the request waited for another request in flight computing "
     "the same prefix, then hit it in the prefix cache."),
    ("attn_read_in_place_tokens", "agentserve:attn_read_in_place_tokens",
     "Cached context tokens attention read in place from the KV pool (runs of consecutive "
     "blocks; counted once a step, not per layer)."),
    ("attn_read_gathered_tokens", "agentserve:attn_read_gathered_tokens",
     "Cached context tokens attention gathered into a copy first (decode groups, short runs "
     "of blocks, a partly filled last block; once a step)."),
    ("attn_read_shared_tokens", "agentserve:attn_read_shared_tokens",
     "Cached context tokens attention did not read again: decodes that share a prefix read it "
     "once for all of them (counted once per decode beyond the first; once a step)."),
]
GAUGES = [
    ("num_running", "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("num_waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_usage", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
]


# Offload tiers: (stats key, metric name without _total, label, help); only when tiers are on.
TIER_COUNTERS = [
    ("hit_tokens", "agentserve:kv_tier_hit_tokens", "tier", "Prompt tokens served from each tier."),
    ("restore_bytes", "agentserve:kv_restore_bytes", "tier", "Bytes restored to the device."),
    ("restore_blocks", "agentserve:kv_restore_blocks", "tier", "Offload blocks restored."),
    ("store_bytes", "agentserve:kv_store_bytes", "tier", "Bytes stored into each tier."),
    ("store_blocks", "agentserve:kv_store_blocks", "tier", "Offload blocks stored."),
    ("evictions", "agentserve:kv_tier_evictions", "tier", "Offload blocks evicted per tier."),
    ("decisions", "agentserve:kv_restore_decisions", "choice",
     "Restore vs recompute (or, for a P/D decode leg, vs pull) decisions."),
    ("restore_outcome", "agentserve:kv_restore_outcome_blocks", "outcome",
     "Restored offload blocks by outcome: used, or wasted (repeat, device_held, aborted, failed)."),
    ("restore_sizes", "agentserve:kv_restore_size", "blocks", "Restores by size in offload blocks."),
    ("restore_device_age", "agentserve:kv_restore_device_age_blocks", "age",
     "Restored offload blocks by how long ago the device evicted them."),
    ("disk_segments_skipped", "agentserve:kv_disk_segments_skipped", "reason",
     "Disk segments the startup scan skipped: damaged (removed), foreign, unreadable, stray."),
]
TIER_SCALARS = [
    ("restore_failures", "agentserve:kv_restore_failures", True, "Restores that fell back to recompute."),
    ("disk_corrupt_blocks", "agentserve:kv_disk_corrupt_blocks", True, "Corrupt/truncated disk blocks."),
    ("restores_truncated", "agentserve:kv_restores_truncated", True,
     "Restores cut short at a corrupt block: the prefix before it kept, the rest recomputed."),
    ("restore_joined_blocks", "agentserve:kv_restore_joined_blocks", True,
     "Offload blocks not restored again: another request's restore in flight held them."),
    ("restore_preempted_blocks", "agentserve:kv_restore_preempted_blocks", True,
     "Restored blocks whose request was preempted before its first token."),
    ("stores_skipped", "agentserve:kv_stores_skipped", True, "Blocks not offloaded (tier pinned full, a failed copy; write-back: part of the group already evicted)."),
    ("disk_disabled", "agentserve:kv_disk_tier_disabled", False, "1 once the disk tier disabled itself."),
    ("last_restore_estimate_s", "agentserve:kv_restore_estimate_seconds", False,
     "Estimated restore time of the last decision."),
    ("last_recompute_estimate_s", "agentserve:kv_recompute_estimate_seconds", False,
     "Estimated recompute time of the last decision."),
    ("last_pull_estimate_s", "agentserve:kv_pull_estimate_seconds", False,
     "Estimated time to pull a decode leg's tier hit instead, at its last decision."),
    ("loads_in_flight", "agentserve:kv_restores_in_flight", False, "Restores in flight."),
    ("prefill_tokens_per_s", "agentserve:kv_prefill_tokens_per_second", False,
     "Measured prefill speed used by the restore/recompute estimate."),
]


def _scalars(series: list[tuple[str, str, bool, str]], t: dict, name: str) -> Iterator[Metric]:
    """One unlabelled (but for the model) counter or gauge per (key, metric, counter?, help)."""
    for key, metric, counter, doc in series:
        fam = CounterMetricFamily if counter else GaugeMetricFamily
        m = fam(metric, doc, labels=["model_name"])
        m.add_metric([name], float(t.get(key, 0)))
        yield m


def tier_metrics(t: dict, name: str) -> Iterator[Metric]:
    """Offload-tier series from ``EngineStats.tiers``."""
    for key, metric, label, doc in TIER_COUNTERS:
        c = CounterMetricFamily(metric, doc, labels=["model_name", label])
        for lv, v in t[key].items():
            c.add_metric([name, lv], float(v))
        yield c
    yield from _scalars(TIER_SCALARS, t, name)
    g = GaugeMetricFamily("agentserve:kv_tier_usage_perc", "Offload tier usage.",
                          labels=["model_name", "tier"])
    for tier, v in t["usage"].items():
        g.add_metric([name, tier], float(v))
    yield g
    h = HistogramMetricFamily("agentserve:kv_restore_latency_seconds", "Restore latency.",
                              labels=["model_name"])
    acc, buckets = 0, []
    for bound, n in zip([*map(str, RESTORE_BUCKETS), "+Inf"], t["restore_latency_buckets"]):
        acc += n
        buckets.append((bound, float(acc)))
    h.add_metric([name], buckets, float(t["restore_latency_sum"]))
    yield h


# P/D transfer (kv/remote/client.py): (stats key, metric, counter?, help); only when it is on.
TRANSFER_SERIES = [
    ("bytes_sent", "agentserve:kv_transfer_sent_bytes", True, "KV bytes served to decode engines."),
    ("bytes_received", "agentserve:kv_transfer_received_bytes", True, "KV bytes pulled from prefill engines."),
    ("pull_seconds", "agentserve:kv_transfer_pull_seconds", True, "Time spent in successful pulls."),
    ("pulls", "agentserve:kv_transfer_pulls", True, "Successful pulls."),
    ("blocks_pulled", "agentserve:kv_transfer_blocks_pulled", True, "Blocks pulled."),
    ("blocks_local", "agentserve:kv_transfer_blocks_local", True,
     "Decode-leg prompt blocks found locally (not pulled)."),
    ("blocks_joined", "agentserve:kv_transfer_blocks_joined", True,
     "Decode-leg prompt blocks not pulled again: another decode leg's pull in flight had them."),
    ("pull_failures", "agentserve:kv_transfer_failures", True, "Pulls that fell back to recompute."),
    ("pins_expired", "agentserve:kv_transfer_pins_expired", True, "Pinned prefills never pulled."),
    ("pins_released", "agentserve:kv_transfer_pins_released", True, "Pinned prefills released."),
    ("pinned_requests", "agentserve:kv_transfer_pinned_requests", False, "Prefills holding pinned KV."),
    ("pulls_in_flight", "agentserve:kv_transfer_pulls_in_flight", False, "Pulls in flight."),
    ("pull_bw_estimate", "agentserve:kv_transfer_pull_bandwidth_bytes_per_second", False,
     "Measured pull throughput (moving average) that decode legs weigh against restoring."),
]


def transfer_metrics(t: dict, name: str) -> Iterator[Metric]:
    """P/D transfer series from ``EngineStats.transfer``, plus the mean pull GB/s."""
    yield from _scalars(TRANSFER_SERIES, t, name)
    g = GaugeMetricFamily("agentserve:kv_transfer_pull_gbps", "Mean pull throughput (GB/s).",
                          labels=["model_name"])
    secs = t.get("pull_seconds", 0.0)
    g.add_metric([name], t.get("bytes_received", 0) / secs / 1e9 if secs else 0.0)
    yield g


def gc_metrics(snap: dict[str, Any], name: str) -> Iterator[Metric]:
    """The process's garbage-collector pauses (``agentserve.gcpause``): the core thread
    stops for them like for a step, so a long one shows up in inter-token latency."""
    h = HistogramMetricFamily("agentserve:gc_pause_seconds",
                              "Garbage collections by generation and how long each stopped Python.",
                              labels=["model_name", "generation"])
    for g in range(3):
        acc, buckets = 0, []
        for bound, n in zip([*map(str, PAUSE_BUCKETS), "+Inf"], snap["buckets"][g]):
            acc += n
            buckets.append((bound, float(acc)))
        h.add_metric([name, str(g)], buckets, snap["seconds"][g])
    yield h
    m = GaugeMetricFamily("agentserve:gc_pause_max_seconds", "Longest collection so far.",
                          labels=["model_name", "generation"])
    for g in range(3):
        m.add_metric([name, str(g)], snap["max_s"][g])
    yield m
    f = GaugeMetricFamily("agentserve:gc_frozen_objects",
                          "Objects frozen out of the collector's reach at startup.",
                          labels=["model_name"])
    f.add_metric([name], float(snap["frozen_objects"]))
    yield f


class StatsSource(Protocol):
    model_name: str
    block_size: int
    num_gpu_blocks: int

    def stats(self) -> Any: ...


class _EngineCollector:
    """Reads engine.stats() on every scrape."""

    def __init__(self, engine: StatsSource) -> None:
        self.engine = engine
        self.gc = pause_tracker()

    def collect(self) -> Iterator[Metric]:
        stats, name = self.engine.stats(), self.engine.model_name
        for field, metric, doc in GAUGES:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], float(getattr(stats, field)))
            yield g
        for field, metric, doc in COUNTERS:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], float(getattr(stats, field, 0)))
            yield c
        tiers = getattr(stats, "tiers", None)
        if tiers is not None:
            yield from tier_metrics(tiers, name)
        transfer = getattr(stats, "transfer", None)
        if transfer is not None:
            yield from transfer_metrics(transfer, name)
        yield from gc_metrics(self.gc.snapshot(), name)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([name, str(self.engine.block_size), str(self.engine.num_gpu_blocks)], 1.0)
        yield info


class ServerMetrics:
    """One server's registry: engine collector plus per-request latency histograms."""

    def __init__(self, engine: StatsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine))  # type: ignore[arg-type]
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(
                                  engine.model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(
                                 engine.model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(engine.model_name)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Observes one request's TTFT, inter-token gaps and end-to-end latency."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics, self.arrival, self.last = metrics, arrival, None

    def on_tokens(self, t: float) -> None:
        """A delta with new tokens was produced at monotonic time t."""
        if self.last is None:
            self.metrics.ttft.observe(max(t - self.arrival, 0.0))
        else:
            self.metrics.itl.observe(max(t - self.last, 0.0))
        self.last = t

    def on_finish(self, t: float) -> None:
        self.metrics.e2e.observe(max(t - self.arrival, 0.0))
