"""Our engine's KV-event block hashes equal a real vLLM's for the same tokens, seed and block size."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from agentserve.kv.events import BlockStored
from agentserve.kv.zmq_events import KVEventSubscriber
from agentserve.cluster.procs import free_port, start_engine, start_vllm

pytestmark = pytest.mark.interop

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
SEED = "0"


def _complete(url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stored_hashes(sub: KVEventSubscriber, want: int, timeout_s: float = 30.0) -> list[tuple]:
    """Collect (hash, parent, token_ids) of BlockStored events until `want` blocks are seen."""
    out: list[tuple] = []
    deadline_polls = int(timeout_s * 10)
    for _ in range(deadline_polls):
        got = sub.recv(timeout_ms=100)
        if got is None:
            if len(out) >= want:
                break
            continue
        _, batch = got
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                toks = list(ev.token_ids)
                for i, h in enumerate(ev.block_hashes):
                    parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
                    out.append((h, parent, tuple(toks[i * ev.block_size:(i + 1) * ev.block_size])))
    return out


def test_block_stored_hashes_match_vllm(vllm_available, tiny_model_dir, tmp_path) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(16, 4000) for _ in range(n)] for n in (5 * BLOCK + 3, 3 * BLOCK)]
    ev_v, ev_a = free_port(), free_port()
    vllm = start_vllm(tiny_model_dir, tmp_path, block_size=BLOCK, kv_events_port=ev_v, hash_seed=SEED)
    ours = start_engine(tmp_path, extra=["--model", str(tiny_model_dir), "--served-model-name", "tiny",
                                         "--block-size", str(BLOCK),
                                         "--kv-events-endpoint", f"tcp://127.0.0.1:{ev_a}"],
                        env={"PYTHONHASHSEED": SEED})
    try:
        ours.wait_healthy(120)
        vllm.wait_healthy(300)
        results = {}
        for name, proc, port in (("vllm", vllm, ev_v), ("ours", ours, ev_a)):
            sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", topic="kv-events")
            try:
                sub.recv(timeout_ms=500)  # let the SUB connect before events flow (slow joiner)
                for p in prompts:
                    _complete(proc.url, p)
                results[name] = _stored_hashes(sub, want=sum(len(p) // BLOCK for p in prompts))
            finally:
                sub.close()
    finally:
        vllm.stop()
        ours.stop()
    # Compare only the blocks that cover prompt tokens (both engines may also store output blocks).
    prompt_blocks = {tuple(p[i * BLOCK:(i + 1) * BLOCK]) for p in prompts for i in range(len(p) // BLOCK)}
    v = {t: (h, par) for h, par, t in results["vllm"] if t in prompt_blocks}
    a = {t: (h, par) for h, par, t in results["ours"] if t in prompt_blocks}
    assert len(v) == len(prompt_blocks), f"vLLM reported {len(v)} of {len(prompt_blocks)} prompt blocks"
    assert a == v
