"""vLLM's `serve` spellings: the model positional, --no-enable-prefix-caching, and the JSON
--kv-events-config / --kv-transfer-config read key by key (unknown keys are errors)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from agentserve.cluster.procs import free_port, start_engine
from agentserve.engine.builder import EngineConfigError, gpu_kv_bytes
from agentserve.engine.vllm_flags import kv_events_config, kv_transfer_config
from agentserve.kv.events import BlockStored
from agentserve.kv.zmq_events import KVEventSubscriber


def test_kv_events_config_maps_vllm_keys() -> None:
    cfg = kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                           '"endpoint": "tcp://*:6000", "topic": "t", "buffer_steps": 50, '
                           '"max_queue_size": 7}')
    assert cfg == {"endpoint": "tcp://*:6000", "replay_endpoint": None, "topic": "t",
                   "buffer_steps": 50, "max_queue": 7}
    # vLLM's defaults: endpoint tcp://*:5557, topic ""; disabled or the null publisher: no events
    assert kv_events_config('{"enable_kv_cache_events": true}')["endpoint"] == "tcp://*:5557"
    assert kv_events_config('{"publisher": "zmq"}') == {}
    assert kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') == {}


@pytest.mark.parametrize("text, msg", [
    ("{bad", "not JSON"), ("[1]", "JSON object"), ('{"enable_kv_cache_events": true, "port": 1}', "port"),
    ('{"enable_kv_cache_events": "yes"}', "wrong type"), ('{"enable_kv_cache_events": true, "hwm": true}',
                                                          "wrong type"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "zmq or null"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "> 0"),
])
def test_kv_events_config_errors_name_the_key(text: str, msg: str) -> None:
    with pytest.raises(EngineConfigError, match=msg):
        kv_events_config(text)


def test_kv_transfer_config_roles_and_offloading() -> None:
    nixl = '{"kv_connector": "NixlConnector", "kv_role": "%s"}'
    assert kv_transfer_config(nixl % "kv_producer") == {"role": "prefill", "kv_transfer_port": 0}
    assert kv_transfer_config(nixl % "kv_consumer")["role"] == "decode"
    both = kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                              '"kv_ip": "10.0.0.2", "kv_port": 14579}')
    assert both == {"role": "both", "kv_transfer_port": 14579, "kv_transfer_host": "10.0.0.2"}
    off = kv_transfer_config('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
                             '"kv_connector_extra_config": {"cpu_bytes_to_use": 2147483648, '
                             '"eviction_policy": "arc", "store_threshold": 0}}')
    assert off == {"kv_cpu_gib": 2.0, "kv_cpu_policy": "arc", "kv_store_threshold": 1}


@pytest.mark.parametrize("text, msg", [
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}', "MooncakeConnector"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_server"}', "kv_role"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
     '{"backends": ["UCX"]}}', "no meaning"),
    ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}', "cpu_bytes_to_use"),
    ('{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
     '{"cpu_bytes_to_use": 1024, "spec_name": "X"}}', "spec_name"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_size": 1}', "kv_buffer_size"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": "x"}', "wrong type"),
])
def test_kv_transfer_config_errors(text: str, msg: str) -> None:
    with pytest.raises(EngineConfigError, match=msg):
        kv_transfer_config(text)


def test_gpu_memory_utilization_rule() -> None:
    gib = 2**30
    assert gpu_kv_bytes(0.9, free=70 * gib, total=80 * gib) == int(0.9 * 80 * gib) - 10 * gib
    with pytest.raises(EngineConfigError, match="nothing is left"):
        gpu_kv_bytes(0.5, free=30 * gib, total=80 * gib)
    with pytest.raises(EngineConfigError, match=r"\(0, 1\]"):
        gpu_kv_bytes(1.5, free=80 * gib, total=80 * gib)


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_served_with_vllm_spellings(tmp_path) -> None:
    """`serve MODEL --kv-events-config JSON` as a vLLM launch script writes it: the model
    from the positional, events on the JSON's endpoint and topic; and
    `--no-enable-prefix-caching` turns the prefix cache off (a repeat reads nothing)."""
    from agentserve.engine.model.tiny import default_model_dir

    port = free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://127.0.0.1:{port}", "topic": "vllm-topic"})
    on = start_engine(tmp_path, name="on", extra=[str(default_model_dir()), "--kv-events-config", cfg])
    off = start_engine(tmp_path, name="off", extra=[str(default_model_dir()), "--no-enable-prefix-caching"])
    try:
        on.wait_healthy(120)
        off.wait_healthy(120)
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", topic="vllm-topic")
        try:
            stored = 0
            for i in range(20):  # a SUB socket joins late: send new prompts until events arrive
                _complete(on.url, f"prompt {i}: " + "the quick brown fox jumps over the lazy dog " * 8)
                got = sub.recv(timeout_ms=500)
                if got is not None:
                    stored = sum(isinstance(e, BlockStored) for e in got[1].events)
                    break
            assert stored >= 1
        finally:
            sub.close()
        prompt = "a repeated prompt over several blocks " * 10
        for eng, cached in ((on, True), (off, False)):
            _complete(eng.url, prompt)
            again = _complete(eng.url, prompt)
            assert (_cached(again["usage"]) > 0) is cached, eng.name
    finally:
        on.stop()
        off.stop()
