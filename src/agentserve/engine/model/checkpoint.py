"""HF-format decoder checkpoints (Llama / Qwen2 family): config parsing and weight loading.

A checkpoint folder holds `config.json` and one or more `*.safetensors` files with the
Hugging Face weight names. `load_model` maps those names onto `LlamaForCausalLM`, fusing
q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (one matmul each per layer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from agentserve.engine.model.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


class CheckpointError(Exception):
    """A checkpoint folder that cannot be loaded; the message says what to fix."""


@dataclass(slots=True)
class ModelConfig:
    """The subset of an HF `config.json` a Llama/Qwen2 decoder needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: always; Llama: `attention_bias`
    o_bias: bool = False  # Llama `attention_bias` also biases o_proj; Qwen2 never does
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict; raise CheckpointError on what we cannot run."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architectures {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("rope_scaling") is not None:
            raise CheckpointError(
                f"rope_scaling {d['rope_scaling']!r} is not supported; only rope_scaling: null"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported; only 'silu'")
        if d.get("mlp_bias"):
            raise CheckpointError("mlp_bias: true is not supported")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            is_qwen = arch == "Qwen2ForCausalLM"
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            cfg = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=True if is_qwen else bool(d.get("attention_bias", False)),
                o_bias=False if is_qwen else bool(d.get("attention_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing required key {e.args[0]!r}") from None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `model_dir/config.json`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {model_dir}")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def read_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `model_dir/*.safetensors` on CPU, keyed by HF name."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f), device="cpu"))
    return weights


def _take(w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in w:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    return w.pop(name)


def to_state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF names onto our module names (fused qkv_proj, gate_up_proj)."""
    sd = {"embed_tokens.weight": _take(w, "model.embed_tokens.weight"),
          "norm.weight": _take(w, "model.norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = _take(w, "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        qkv = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
        sd[us + "self_attn.qkv_proj.weight"] = torch.cat([_take(w, n + ".weight") for n in qkv])
        if cfg.qkv_bias:
            sd[us + "self_attn.qkv_proj.bias"] = torch.cat([_take(w, n + ".bias") for n in qkv])
        sd[us + "self_attn.o_proj.weight"] = _take(w, hf + "self_attn.o_proj.weight")
        if cfg.o_bias:
            sd[us + "self_attn.o_proj.bias"] = _take(w, hf + "self_attn.o_proj.bias")
        sd[us + "mlp.gate_up_proj.weight"] = torch.cat(
            [_take(w, hf + "mlp.gate_proj.weight"), _take(w, hf + "mlp.up_proj.weight")])
        sd[us + "mlp.down_proj.weight"] = _take(w, hf + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[us + norm + ".weight"] = _take(w, f"{hf}{norm}.weight")
    return sd


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build `LlamaForCausalLM` from an HF folder, weights in `dtype` on `device`, eval mode
    (a DeepseekV3 folder: `MlaMoeForCausalLM` and its MlaConfig, mla_checkpoint.py)."""
    from agentserve.engine.model.llama import LlamaForCausalLM
    from agentserve.engine.model.mla_checkpoint import is_mla_config, load_mla_model

    path = Path(model_dir) / "config.json"
    if path.is_file() and is_mla_config(json.loads(path.read_text())):
        return load_mla_model(model_dir, dtype, device)  # type: ignore[return-value]
    cfg = load_config(model_dir)
    sd = to_state_dict(cfg, read_hf_weights(model_dir))
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    return build_model(LlamaForCausalLM, cfg, sd, f"weights in {model_dir} do not match config.json"), cfg


def build_model(model_cls: Any, cfg: Any, state_dict: dict[str, torch.Tensor], mismatch: str) -> Any:
    """`model_cls(cfg)` built on the meta device and given `state_dict`'s tensors as they are
    (no copy, no init), in eval mode; a missing or extra tensor is a CheckpointError that
    starts with `mismatch`."""
    with torch.device("meta"):
        model = model_cls(cfg)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{mismatch}: {e}") from None
    return model.eval()
