"""vLLM's spellings of `serve` options, read into ours (docs/vllm_flags.md has the table).

A launch script written for `vllm serve` should start `agentserve serve` unchanged where
the meaning is the same. The JSON configs are read key by key: a key we honour maps to our
option, a key we cannot honour is an error naming it (never silently dropped), and a value
of the wrong type is an error naming the key.
"""

from __future__ import annotations

import json
from typing import Any

from agentserve.engine.builder import EngineConfigError

# vLLM's KVEventsConfig (vllm/config/kv_events.py, 0.32) -> KVEventPublisher's parameters.
_EVENT_KEYS = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str,
               "replay_endpoint": (str, type(None)), "topic": str, "buffer_steps": int, "hwm": int,
               "max_queue_size": int}
# vLLM's KVTransferConfig keys that we read; others are refused by name.
_TRANSFER_KEYS = {"kv_connector": str, "kv_role": str, "kv_ip": str, "kv_port": int,
                  "kv_connector_extra_config": dict, "engine_id": (str, type(None))}
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def _load(flag: str, text: str, keys: dict[str, Any]) -> dict[str, Any]:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineConfigError(f"{flag}: not JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(cfg, dict):
        raise EngineConfigError(f"{flag}: expected a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(keys))
    if unknown:
        raise EngineConfigError(f"{flag}: unsupported key(s) {', '.join(unknown)} (supported: "
                                f"{', '.join(sorted(keys))})")
    for k, v in cfg.items():
        want = keys[k]
        # bool is an int in Python: an int key given `true` is a mistake, not 1
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise EngineConfigError(f"{flag}: {k} has the wrong type ({type(v).__name__}: {v!r})")
    return cfg


def kv_events_config(text: str) -> dict[str, Any]:
    """`--kv-events-config JSON` -> {endpoint, replay_endpoint, topic, buffer_steps, hwm,
    max_queue} for the event publisher; {} when events are off (vLLM's default: disabled)."""
    cfg = _load("--kv-events-config", text, _EVENT_KEYS)
    publisher = cfg.get("publisher", "zmq" if cfg.get("enable_kv_cache_events") else "null")
    if publisher not in ("zmq", "null"):
        raise EngineConfigError(f"--kv-events-config: publisher must be zmq or null, got {publisher!r}")
    if not cfg.get("enable_kv_cache_events", False) or publisher == "null":
        return {}
    out: dict[str, Any] = {"endpoint": cfg.get("endpoint", "tcp://*:5557"),
                           "replay_endpoint": cfg.get("replay_endpoint"),
                           # vLLM's default topic is ""; a subscriber that filters on none gets both
                           "topic": cfg.get("topic", "")}
    for ours, theirs in (("buffer_steps", "buffer_steps"), ("hwm", "hwm"),
                         ("max_queue", "max_queue_size")):
        if theirs in cfg:
            if cfg[theirs] <= 0:
                raise EngineConfigError(f"--kv-events-config: {theirs} must be > 0, got {cfg[theirs]}")
            out[ours] = cfg[theirs]
    return out


def kv_transfer_config(text: str) -> dict[str, Any]:
    """`--kv-transfer-config JSON` -> our `serve` options (EngineArgs field names).

    NixlConnector (vLLM's P/D pull, what llm-d deploys) maps to our P/D pull over TCP with
    the same roles: kv_producer = prefill, kv_consumer = decode, kv_both = both with
    transfer on; kv_ip/kv_port are where it listens. OffloadingConnector maps to the CPU
    tier (cpu_bytes_to_use, eviction_policy lru/arc, store_threshold). Other connectors
    are refused by name."""
    cfg = _load("--kv-transfer-config", text, _TRANSFER_KEYS)
    conn = cfg.get("kv_connector")
    extra = cfg.get("kv_connector_extra_config", {})
    if conn == "NixlConnector":
        role = cfg.get("kv_role")
        if role not in _ROLES:
            raise EngineConfigError(f"--kv-transfer-config: kv_role must be one of "
                                    f"{', '.join(_ROLES)}, got {role!r}")
        if extra:
            raise EngineConfigError("--kv-transfer-config: NixlConnector's kv_connector_extra_config "
                                    f"({', '.join(sorted(extra))}) has no meaning here")
        out: dict[str, Any] = {"role": _ROLES[role], "kv_transfer_port": cfg.get("kv_port", 0)}
        if "kv_ip" in cfg:
            out["kv_transfer_host"] = cfg["kv_ip"]
        return out
    if conn == "OffloadingConnector":
        known = {"cpu_bytes_to_use", "eviction_policy", "store_threshold", "block_size"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise EngineConfigError(f"--kv-transfer-config: OffloadingConnector's {', '.join(unknown)} "
                                    "is not supported")
        size = extra.get("cpu_bytes_to_use")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise EngineConfigError("--kv-transfer-config: OffloadingConnector needs "
                                    "kv_connector_extra_config.cpu_bytes_to_use (bytes, > 0)")
        out = {"kv_cpu_gib": size / 2**30}
        if "eviction_policy" in extra:
            if extra["eviction_policy"] not in ("lru", "arc"):
                raise EngineConfigError("--kv-transfer-config: eviction_policy must be lru or arc, "
                                        f"got {extra['eviction_policy']!r}")
            out["kv_cpu_policy"] = extra["eviction_policy"]
        if "store_threshold" in extra:
            # vLLM's 0 and 1 both mean "store every block"
            out["kv_store_threshold"] = max(1, int(extra["store_threshold"]))
        if "block_size" in extra:
            out["kv_offload_block_tokens"] = int(extra["block_size"])
        return out
    raise EngineConfigError(f"--kv-transfer-config: kv_connector {conn!r} is not available; "
                            "supported: NixlConnector (P/D pull, over our TCP transport) and "
                            "OffloadingConnector (the CPU tier)")

