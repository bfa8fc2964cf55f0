"""The tiny `mla-moe` checkpoint under Hugging Face transformers' own DeepseekV3ForCausalLM
(from the cached vLLM venv) gives the greedy tokens and logits of our model: the weight
names, the interleaved rope, the sigmoid router with its correction bias, the shared
expert and the dense first layer read as DeepSeek-V3's reference code reads them."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from agentserve.cluster.procs import vllm_python
from agentserve.engine.model.checkpoint import load_model
from agentserve.engine.model.tiny import make_tiny

pytestmark = pytest.mark.interop

PROMPT = [(7 * i + 11) % 4000 + 5 for i in range(45)]
HF = """
import json, sys, torch
from transformers import DeepseekV3ForCausalLM
m = DeepseekV3ForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
ids = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    logits = m(ids).logits[0, -1]
print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "logits": logits.tolist()}))
"""


def test_transformers_deepseek_v3_agrees(tmp_path) -> None:
    py = vllm_python()
    if not py.exists():
        pytest.fail(f"vLLM venv missing at {py.parent.parent}: run `make vllm-venv` "
                    "(or deselect with -m 'not interop')")
    folder = make_tiny(tmp_path / "mla", "mla-moe", seed=1)
    run = subprocess.run([str(py), "-c", HF, str(folder), json.dumps(PROMPT)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    hf = json.loads(run.stdout.strip().splitlines()[-1])
    model = load_model(folder)[0]
    ids = list(PROMPT)
    for _ in range(10):
        ids.append(int(model.forward_reference(torch.tensor(ids))[-1].argmax()))
    assert ids[len(PROMPT):] == hf["tokens"]
    ours = model.forward_reference(torch.tensor(PROMPT))[-1]
    torch.testing.assert_close(ours, torch.tensor(hf["logits"]), atol=2e-4, rtol=1e-3)
