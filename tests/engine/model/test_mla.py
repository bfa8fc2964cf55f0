"""MLA (mla.py, mla_model.py, mla_checkpoint.py): the absorbed paged form against expanded
K/V, the latent pool's size, the loader's keys, and the tiny `mla-moe` preset served."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from agentserve.engine.builder import EngineArgs, EngineConfigError, build_engine
from agentserve.engine.model.attention import KVCache, SeqChunk, prepare_batch
from agentserve.engine.model.checkpoint import CheckpointError, ModelConfig, load_model
from agentserve.engine.model.llama import rope_cos_sin
from agentserve.engine.model.mla import (
    MLAttention,
    allocate_latent,
    latent_bytes_per_token,
)
from agentserve.engine.model.mla_checkpoint import MlaConfig, read_hf_weights, to_state_dict
from agentserve.engine.model.mla_model import MlaMoeForCausalLM
from tests.conftest import ServerThread


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    """The preset, built as checks build it: `agentserve model make-tiny --preset mla-moe`."""
    import typer
    from typer.testing import CliRunner

    from agentserve.engine import cli as engine_cli

    app = typer.Typer()
    engine_cli.register(app)
    out = tmp_path_factory.mktemp("mla") / "m"
    res = CliRunner().invoke(app, ["model", "make-tiny", "--preset", "mla-moe", "--out", str(out)])
    assert res.exit_code == 0 and res.output.strip() == str(out), res.output
    return out


@pytest.fixture(scope="module")
def raw(mla_dir) -> dict:
    return json.loads((mla_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def model(mla_dir) -> MlaMoeForCausalLM:
    return load_model(mla_dir)[0]


def test_preset_config_and_loader(mla_dir, raw, model) -> None:
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (raw["kv_lora_rank"], raw["qk_rope_head_dim"], raw["n_routed_experts"]) == (64, 16, 8)
    assert isinstance(model, MlaMoeForCausalLM) and model.cfg.latent_dim == 80
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MLP"] + ["MoE"] * (raw["num_hidden_layers"] - 1)  # first_k_dense_replace 1


@pytest.mark.parametrize("change, msg", [
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(rope_scaling={"type": "yarn", "factor": 40}), "rope_scaling"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(kv_lora_rank=None), "kv_lora_rank"),
])
def test_config_errors_are_clear(raw, change, msg) -> None:
    d = raw | change
    if change.get("kv_lora_rank", 0) is None:
        del d["kv_lora_rank"]
    with pytest.raises(CheckpointError, match=msg):
        MlaConfig.from_dict(d)


def test_weight_name_errors_are_clear(mla_dir, raw) -> None:
    cfg = MlaConfig.from_dict(raw)
    w = read_hf_weights(mla_dir)
    w["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"] = torch.ones(1)
    w["model.layers.4.eh_proj.weight"] = torch.ones(1)  # an MTP layer (>= num_hidden_layers): skipped
    with pytest.raises(CheckpointError, match="1 tensors .*weight_scale_inv"):
        to_state_dict(cfg, dict(w))
    del w["model.layers.1.mlp.gate.e_score_correction_bias"]
    with pytest.raises(CheckpointError, match="missing tensor .*e_score_correction_bias"):
        to_state_dict(cfg, w)


def test_pool_bytes_per_token(raw) -> None:
    cfg = MlaConfig.from_dict(raw)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * size
        assert latent_bytes_per_token(cfg, dtype) == per_token
        kv = allocate_latent(cfg, num_blocks=6, block_size=16, dtype=dtype, device="cpu")
        assert kv.v is kv.k  # one latent, not K and V
        assert kv.k.numel() * kv.k.element_size() == per_token * 6 * 16


def test_reference_kv_ratio(raw) -> None:
    """SPEC capability 1 from the specs: 512 latent + 64 rope elements against K and V."""
    mla = MlaConfig.from_dict(raw | dict(num_hidden_layers=61, kv_lora_rank=512,
                                         qk_rope_head_dim=64, num_attention_heads=128))

    def gqa(kv_heads: int, head_dim: int) -> int:
        cfg = ModelConfig("LlamaForCausalLM", 1, 1, 1, 61, 128, kv_heads, head_dim)
        return KVCache.bytes_per_token(cfg, torch.bfloat16)

    m = latent_bytes_per_token(mla, torch.bfloat16)
    assert 6.5 < gqa(8, 256) / m < 7.5  # GQA-8 at 256-dim heads: ~7x
    assert 55 < gqa(64, 256) / m < 59  # MHA-64 at 256 (GLM-5.2's heads): ~57x
    assert 55 < gqa(128, 128) / m < 59  # MHA-128 at 128 (DeepSeek-V3's heads): the same ~57x


def _scaled_attention(raw: dict) -> MLAttention:
    """One MLA layer with weights large enough that attention is far from uniform."""
    att = MLAttention(MlaConfig.from_dict(raw))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in att.named_parameters():
            if "layernorm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return att.eval()


def test_absorbed_paged_equals_naive(raw) -> None:
    """Prefill, a chunk after cached tokens, decodes of two sequences (one sharing the
    other's first blocks: the cascade path) over a shuffled block table: every row's output
    == expanded-K/V attention over the same latents."""
    att, bs = _scaled_attention(raw), 4
    hid = att.cfg.hidden_size
    gen = torch.Generator().manual_seed(5)
    A = torch.randn(40, hid, generator=gen)
    B = torch.cat((A[:8], torch.randn(20, hid, generator=gen)))  # B's first 2 blocks are A's
    X = torch.cat((A, B))  # "token id" i = row i of X: (A, pos i) or (B, pos i - 40)
    tables = {"A": [9, 2, 14, 5, 0, 11, 7, 3, 12, 1], "B": [9, 2, 6, 13, 4, 8, 10]}
    kv = allocate_latent(att.cfg, 16, bs, torch.float32, "cpu")
    ref = {}
    with torch.no_grad():
        for name, xs, base in (("A", A, 0), ("B", B, 40)):
            pos = torch.arange(len(xs))
            cos, sin = rope_cos_sin(pos, att.cfg.qk_rope_head_dim, att.cfg.rope_theta, xs.dtype)
            q_nope, q_pe, lat = att.project(xs, cos, sin)
            out = att.naive_attention(q_nope, q_pe, lat, pos)
            ref.update({base + i: out[i] for i in range(len(xs))})

        def step(chunks: list[tuple[str, int, int]]) -> None:
            seqs = [SeqChunk([(0 if s == "A" else 40) + p for p in range(a, b)], a, tables[s], True)
                    for s, a, b in chunks]
            meta = prepare_batch(seqs, bs, "cpu")
            cos, sin = rope_cos_sin(meta.positions, att.cfg.qk_rope_head_dim, att.cfg.rope_theta,
                                    X.dtype)
            got = att(X[meta.input_ids], cos, sin, meta, kv, 0)
            for row, tok in enumerate(meta.input_ids.tolist()):
                torch.testing.assert_close(got[row], ref[tok], atol=2e-5, rtol=1e-4)

        step([("A", 0, 30)])  # plain causal prefill
        step([("A", 30, 36), ("B", 8, 12)])  # chunks after cached tokens (B reuses A's blocks)
        step([("B", 12, 20)])
        for p in range(36, 40):  # decodes; A and B share their first two blocks
            step([("A", p, p + 1), ("B", p - 16, p - 15)])


@pytest.fixture(scope="module")
def served(mla_dir) -> Iterator[ServerThread]:
    s = ServerThread(model=str(mla_dir), kv_cache_tokens=2048, max_num_seqs=4, seed=0).start()
    yield s
    s.close()


def _greedy_reference(model: MlaMoeForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.forward_reference(torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt):]


def _complete(s: ServerThread, prompt: list[int], n: int) -> tuple[list[int], int]:
    data = json.dumps(dict(model=s.engine.model_name, prompt=prompt, max_tokens=n,
                           temperature=0, ignore_eos=True, return_token_ids=True)).encode()
    req = urllib.request.Request(s.url + "/v1/completions", data,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return body["choices"][0]["token_ids"], cached


def test_served_greedy_equals_reference_and_prefix_hits(served, model) -> None:
    prompt = [(7 * i + 11) % 4000 + 5 for i in range(45)]
    want = _greedy_reference(model, prompt, 10)
    got, cached = _complete(served, prompt, 10)
    assert got == want and cached == 0
    again, cached = _complete(served, prompt, 10)  # prefix cache hit: the same tokens
    assert again == want and cached >= 32
    branch = prompt[:40] + [99, 98, 97]  # a shared prefix, then its own tail
    got, cached = _complete(served, branch, 6)
    assert cached >= 32 and got == _greedy_reference(model, branch, 6)


def test_latent_cache_refuses_tiers_for_now(mla_dir) -> None:
    with pytest.raises(EngineConfigError, match="mla-moe latent cache"):
        build_engine(EngineArgs(model=str(mla_dir), kv_cache_tokens=256, kv_cpu_gib=0.01))
