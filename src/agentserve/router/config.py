"""Router configuration: one YAML file, composed from named policy presets.

```yaml
policy: default            # default | round-robin | least-loaded | approx-prefix | precise-prefix
endpoints:
  - url: http://10.0.0.1:8000
    kv_events: tcp://10.0.0.1:5557   # ZMQ PUB of the engine (omit: approximate tracking)
    replay: tcp://10.0.0.1:5558      # optional replay ROUTER socket (gap recovery)
    role: both                       # both | prefill | decode
    model: tiny                      # optional; learned from /v1/models otherwise
    dp_ranks: 1                      # data-parallel ranks; rank r publishes on port + r
    block_size: 16                   # optional; scraped from vllm:cache_config_info
    hash_seed: "0"                   # the engine's PYTHONHASHSEED (None: unset)
    hash_algo: sha256_cbor
scorers: {prefix: 2.0, queue: 0.5}   # merged over the preset's weights
picker: {type: sticky, penalty_s: 0.5}
options: {speculative_ttl_s: 2.0, scrape_interval_s: 0.05}
```

A policy is a preset of (scorers with weights, picker, index mode, options); every key
given in the file overrides the preset's. Nothing here branches on the policy name
outside `PRESETS`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

PRESETS: dict[str, dict[str, Any]] = {
    "round-robin": {"scorers": {}, "picker": {"type": "round-robin"}, "index": "none",
                    "options": {"speculative_ttl_s": 0.0, "session_affinity": False}},
    "least-loaded": {"scorers": {"queue": 1.0, "inflight": 1.0, "kv_util": 0.5},
                     "picker": {"type": "max"}, "index": "none",
                     "options": {"speculative_ttl_s": 0.0}},
    "approx-prefix": {"scorers": {"prefix": 2.0, "queue": 0.5, "inflight": 0.5,
                                  "kv_util": 0.25},
                      "picker": {"type": "max"}, "index": "approx",
                      "options": {"speculative_ttl_s": 0.0}},
    "precise-prefix": {"scorers": {"prefix": 2.0, "queue": 0.5, "inflight": 0.5,
                                   "kv_util": 0.25},
                       "picker": {"type": "max"}, "index": "precise",
                       "options": {"speculative_ttl_s": 0.0}},
    # The best on benchmarks/router_captured_reuse.py (see docs/router.md): precise
    # prefix with speculative entries; "sticky until saturated" (keep the prefix holder
    # unless its estimated wait exceeds another's by more than penalty_s, and that other
    # has at least two fewer active sessions, so that moves balance and cannot cascade;
    # the wait is queued uncached prefill over the endpoint's learned prefill speed);
    # new sessions go where the estimated wait (queued prefill tokens over learned speed)
    # is shortest, the fewest sessions are active (balance) and the fewest requests went
    # recently (requests: sessions turn over at different speeds); momentary load breaks ties.
    "default": {"scorers": {"prefix": 2.0, "wait": 1.0, "balance": 0.5, "rate": 0.5,
                            "session": 0.1, "queue": 0.5, "inflight": 0.5, "kv_util": 0.25},
                "picker": {"type": "sticky", "penalty_s": 2.0, "min_share": 0.5,
                           "moves_must_balance": True, "rebalance_slack": 0.1},
                "index": "precise",
                "options": {"speculative_ttl_s": 2.0}},
}


_URL = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[^\s/:\[\]]+)(:\d+)?(/\S*)?$")
_ZMQ = re.compile(r"^(tcp://\S+:(\d+|\*)|ipc://\S+|inproc://\S+)$")


@dataclass(slots=True)
class EndpointConfig:
    """One backend engine (ours or vLLM)."""

    url: str
    kv_events: str | None = None
    replay: str | None = None
    role: str = "both"
    model: str | None = None
    dp_ranks: int = 1
    block_size: int | None = None
    hash_seed: str | None = None
    hash_algo: str = "sha256_cbor"
    capacity_blocks: int | None = None  # approximate index size; scraped num_gpu_blocks otherwise

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not _URL.match(self.url):
            raise ValueError(f"endpoint url must be http(s)://host[:port][/path], got {self.url!r}")
        self.url = self.url.rstrip("/")
        for name in ("kv_events", "replay"):
            zmq_ep = getattr(self, name)
            if zmq_ep is not None and (not isinstance(zmq_ep, str) or not _ZMQ.match(zmq_ep)):
                raise ValueError(f"endpoint {self.url}: {name} must be a ZMQ endpoint "
                                 f"(tcp://host:port, ipc://path), got {zmq_ep!r}")
        for name in ("dp_ranks", "block_size", "capacity_blocks"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ValueError(f"endpoint {self.url}: {name} must be a positive integer, "
                                 f"got {n!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"endpoint {self.url}: role must be both|prefill|decode, "
                             f"not {self.role!r}")
        if self.hash_seed is not None:
            self.hash_seed = str(self.hash_seed)


@dataclass(slots=True)
class Options:
    """Knobs shared by all policies (seconds unless named otherwise)."""

    speculative_ttl_s: float = 2.0
    session_affinity: bool = True
    scrape_interval_s: float = 0.05
    metrics_stale_s: float = 1.0
    health_interval_s: float = 2.0
    eject_after_failures: int = 3
    eject_for_s: float = 5.0
    # Panic routing (Envoy's panic threshold): when outlier ejection leaves fewer than this
    # share of a role's endpoints available, its ejected ones take traffic again. 0: only
    # when none is left (never eject the last one); Envoy's default is 0.5.
    panic_threshold: float = 0.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_inflight: int = 1024
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_body_mb: float = 64.0
    # HTTP bounds (agentserve/api/httpbounds.py; `route` flags override them): a request head
    # within header_timeout_s of connecting or of the last response, no body silent for
    # body_timeout_s, at most max_connections open; on SIGTERM in-flight requests get
    # drain_timeout_s to finish
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 2048
    drain_timeout_s: float = 30.0
    prefill_tok_per_s: float = 20000.0  # for wait estimates before the engine tells us
    block_size: int = 16  # until an endpoint says otherwise
    tokenizer_cache_entries: int = 128
    raw_prompt_cache_mb: float = 256.0  # token-id bodies read incrementally (0: off)
    hash_cache_chunks: int = 8192  # ~14 KB each (2048 tokens at block 16)
    session_entries: int = 100000
    session_active_s: float = 60.0  # longest a paused session counts as active (router/liveness.py)
    session_pause_quantile: float | None = 0.9  # of observed pauses: how long one counts (None: session_active_s)
    recent_requests_s: float = 60.0  # time constant of the decayed request count (`requests`)
    exact_match: bool = False  # scan every block (sees holes) instead of bisecting
    pd_threshold: int = 256  # P/D: split a request when the decode endpoint lacks >= this many tokens
    tier_weights: dict[str, float] = field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "STORAGE": 0.5})


@dataclass(slots=True)
class RouterConfig:
    """The whole router configuration after preset merging."""

    policy: str = "default"
    endpoints: list[EndpointConfig] = field(default_factory=list)
    scorers: dict[str, float] = field(default_factory=dict)
    picker: dict[str, Any] = field(default_factory=dict)
    index: str = "precise"  # precise | approx | none
    options: Options = field(default_factory=Options)
    tokenizer: str | None = None
    api_key: str | None = None
    kv_transfer_token: str | None = None  # the engines' secret: P/D legs are signed with it
    operator_key: str | None = None  # callers sending it keep their kv_transfer_params (trust.py)


def _options(d: dict[str, Any]) -> Options:
    known = {f.name for f in fields(Options)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown router options: {sorted(unknown)}; known: {sorted(known)}")
    o = Options(**d)
    for name in ("recent_requests_s", "session_active_s", "header_timeout_s", "body_timeout_s",
                 "max_connections", "drain_timeout_s"):
        v = getattr(o, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"router option {name} must be a number > 0, got {v!r}")
    t = o.panic_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
        raise ValueError(f"router option panic_threshold must be in [0, 1], got {o.panic_threshold!r}")
    q = o.session_pause_quantile
    if q is not None and not 0 < q <= 1:
        raise ValueError(f"router option session_pause_quantile must be in (0, 1] or null, got {q!r}")
    return o


def build_config(raw: dict[str, Any] | None) -> RouterConfig:
    """Merge a parsed YAML mapping over its policy preset; validate names."""
    raw = dict(raw or {})
    policy = raw.pop("policy", "default")
    if policy not in PRESETS:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(PRESETS)}")
    preset = copy.deepcopy(PRESETS[policy])
    scorers = {**preset["scorers"], **(raw.pop("scorers", None) or {})}
    picker = {**preset["picker"], **(raw.pop("picker", None) or {})}
    options = _options({**preset["options"], **(raw.pop("options", None) or {})})
    eps = [EndpointConfig(**e) if isinstance(e, dict) else EndpointConfig(url=str(e))
           for e in raw.pop("endpoints", None) or []]
    index = raw.pop("index", preset["index"])
    tokenizer = raw.pop("tokenizer", None)
    api_key = raw.pop("api_key", None)
    secrets = {k: raw.pop(k, None) for k in ("kv_transfer_token", "operator_key")}
    if raw:
        raise ValueError(f"unknown router config keys: {sorted(raw)}")
    return RouterConfig(policy=policy, endpoints=eps, scorers=scorers, picker=picker,
                        index=index, options=options, tokenizer=tokenizer, api_key=api_key,
                        **secrets)


def load_config(path: str | Path | None) -> RouterConfig:
    """Read a YAML file (None: the default policy with no endpoints)."""
    if path is None:
        return build_config({})
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the router config must be a YAML mapping")
    return build_config(data)
