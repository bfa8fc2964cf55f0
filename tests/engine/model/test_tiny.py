"""Tiny checkpoint: determinism, tokenizer, chat template, loading in bf16."""

from __future__ import annotations

import json

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from agentserve.engine.model.checkpoint import CheckpointError, ModelConfig, load_config, load_model
from agentserve.engine.model.llama import KVCache, SeqChunk, prepare_batch
from agentserve.engine.model.tiny import SPECIAL_TOKENS, default_model_dir, make_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("a"), "tiny", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def test_deterministic(tiny_dir, tmp_path):
    again = make_tiny(tmp_path / "b", "tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_config(tiny_dir):
    cfg = load_config(tiny_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 2, 64)
    assert cfg.vocab_size == 4096 and cfg.max_position_embeddings == 131072


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_roundtrip_unicode(tok, s):
    assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s


def test_roundtrip_bytes(tok):
    text = bytes(range(256)).decode("latin-1") + "日本語 🙂 \x00\t\r\n  def f():\n\treturn 1"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text


def test_special_tokens_single_ids(tok):
    for t in SPECIAL_TOKENS:
        ids = tok.encode(f"a{t}b").ids
        assert tok.token_to_id(t) in ids and tok.encode(t).ids == [tok.token_to_id(t)]


def test_generation_config_eos(tiny_dir, tok):
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]


def _render(tiny_dir, **kw) -> str:
    tmpl = json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"]
    return jinja2.Environment().from_string(tmpl).render(**kw)


def test_chat_template_tools(tiny_dir):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "show a.py"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
    ]
    out = _render(tiny_dir, messages=msgs, tools=tools, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert '"name": "read_file"' in out and "<tools>" in out
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>' in out
    assert out.count("<tool_response>") == 2 and out.count("<|im_start|>user") == 2
    assert out.endswith("<|im_end|>\n<|im_start|>assistant\n")
    plain = _render(tiny_dir, messages=[{"role": "system", "content": "S"},
                                        {"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_load_bf16(tiny_dir):
    model, cfg = load_model(tiny_dir, torch.bfloat16, "cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    kv = KVCache.allocate(cfg, 4, 16, torch.bfloat16, "cpu")
    ref, _ = load_model(tiny_dir, torch.float32, "cpu")
    kv32 = KVCache.allocate(cfg, 4, 16, torch.float32, "cpu")
    chunk = [SeqChunk(list(range(10, 30)), 0, [2, 0], True)]
    out = model(prepare_batch(chunk, 16, "cpu"), kv)
    out32 = ref(prepare_batch(chunk, 16, "cpu"), kv32)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - out32).abs().max() < 0.05


def test_unsupported_config():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8,
                intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    assert ModelConfig.from_dict(base).head_dim == 4
    with pytest.raises(CheckpointError, match="unsupported architectures"):
        ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(CheckpointError, match="rope_scaling"):
        ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="config.json"):
        load_config("/nonexistent")


def test_default_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSERVE_CACHE", str(tmp_path))
    d = default_model_dir()
    assert d == tmp_path / "models" / "tiny-s0" and (d / "model.safetensors").is_file()
    assert default_model_dir() == d and not [p for p in d.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("args, message", [
    (["--out", "OUT", "--preset", "huge"], "unknown preset 'huge'"),
    (["--out", "/proc/no/such/dir/m"], "No such file or directory"),
])
def test_make_tiny_cli_errors_are_one_line(tmp_path, args, message):
    import typer
    from typer.testing import CliRunner

    from agentserve.engine import cli as engine_cli

    app = typer.Typer()
    engine_cli.register(app)
    args = [str(tmp_path / "m") if a == "OUT" else a for a in args]
    res = CliRunner().invoke(app, ["model", "make-tiny", *args])
    assert res.exit_code == 2 and message in res.output, res.output


def _with_dtype(src, dst, **fields):
    """A copy of checkpoint `src` whose config.json has `fields` set (None: removed)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_dtype_auto_is_the_checkpoints(tiny_dir, tmp_path):
    """`--dtype auto` (the default, as vLLM's) takes the checkpoint's `torch_dtype`: the tiny
    model stays float32, a bfloat16 checkpoint loads in bfloat16 (KV cache too), a float16
    one runs in bfloat16 on CPU; an explicit --dtype wins; a dtype we cannot run is an error."""
    from agentserve.engine.builder import EngineArgs, EngineConfigError, build_engine, resolve_dtype

    assert EngineArgs().dtype == "auto"
    assert resolve_dtype("auto", tiny_dir, "cpu") == "float32"
    bf16 = _with_dtype(tiny_dir, tmp_path / "bf16", torch_dtype="bfloat16")
    assert resolve_dtype("auto", bf16, "cpu") == "bfloat16"
    assert resolve_dtype("float32", bf16, "cpu") == "float32"
    newer = _with_dtype(tiny_dir, tmp_path / "newer", torch_dtype=None, dtype="bfloat16")
    assert resolve_dtype("auto", newer, "cpu") == "bfloat16"
    none = _with_dtype(tiny_dir, tmp_path / "none", torch_dtype=None)
    assert resolve_dtype("auto", none, "cpu") == "float32"
    fp16 = _with_dtype(tiny_dir, tmp_path / "fp16", torch_dtype="float16")
    assert resolve_dtype("auto", fp16, "cpu") == "bfloat16"
    assert resolve_dtype("auto", fp16, "cuda") == "float16"
    fp8 = _with_dtype(tiny_dir, tmp_path / "fp8", torch_dtype="float8_e4m3fn")
    with pytest.raises(EngineConfigError, match="float8_e4m3fn"):
        resolve_dtype("auto", fp8, "cpu")
    broken = _with_dtype(tiny_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        resolve_dtype("auto", broken, "cpu")
    with pytest.raises(EngineConfigError, match="--dtype must be auto or one of"):
        build_engine(EngineArgs(model=str(tiny_dir), dtype="fp32"))
    eng = build_engine(EngineArgs(model=str(bf16), kv_cache_tokens=4096))
    assert eng.core.runner.kv_cache.k.dtype == torch.bfloat16
    assert next(eng.core.runner.model.parameters()).dtype == torch.bfloat16
