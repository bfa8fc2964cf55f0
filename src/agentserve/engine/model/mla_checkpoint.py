"""HF folders of the `mla-moe` family (DeepseekV3ForCausalLM): config, weight names, loading,
and the random-weight tiny preset's checkpoint.

Weight names (DeepSeek-V3's), per layer N under `model.layers.N.`:
  self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
  kv_b_proj, o_proj}; input_layernorm, post_attention_layernorm;
  dense layers (N < first_k_dense_replace): mlp.{gate,up,down}_proj;
  MoE layers: mlp.gate.weight (+ mlp.gate.e_score_correction_bias with sigmoid routing),
  mlp.experts.E.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj.
Layers N >= num_hidden_layers are DeepSeek-V3's multi-token-prediction heads: not loaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentserve.engine.model.checkpoint import CheckpointError, build_model, read_hf_weights
from agentserve.engine.model.moe import MoeSpec

if TYPE_CHECKING:
    from agentserve.engine.model.mla_model import MlaMoeForCausalLM

MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


@dataclass(slots=True)
class MlaConfig:
    """The subset of a DeepseekV3 `config.json` the `mla-moe` family needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' FFN
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int  # 0: plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe: MoeSpec
    first_k_dense_replace: int = 0
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # DeepSeek-V3's rope part is stored as interleaved pairs
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def latent_dim(self) -> int:
        """Elements one token stores per layer: the compressed KV and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MlaConfig:
        """Parse an HF config dict; raise CheckpointError on what we cannot run."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in MLA_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(f"unsupported architectures {archs!r} for mla-moe; "
                                  f"supported: {', '.join(MLA_ARCHITECTURES)}")
        for key, ok in (("rope_scaling", None), ("quantization_config", None)):
            if d.get(key) is not ok:
                raise CheckpointError(f"{key} {d[key]!r} is not supported; only {key}: null")
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {d['hidden_act']!r} is not supported; only 'silu'")
        if int(d.get("moe_layer_freq", 1)) != 1:
            raise CheckpointError("moe_layer_freq other than 1 is not supported")
        try:
            eos = d.get("eos_token_id")
            moe = MoeSpec(
                hidden_size=int(d["hidden_size"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                n_routed_experts=int(d["n_routed_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                n_shared_experts=int(d.get("n_shared_experts") or 0),
                scoring_func=str(d.get("scoring_func", "sigmoid")),
                topk_method=str(d.get("topk_method", "noaux_tc")),
                n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)))
            cfg = cls(
                architecture=arch, vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(d["kv_lora_rank"]),
                qk_nope_head_dim=int(d["qk_nope_head_dim"]),
                qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
                moe=moe, first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_interleave=bool(d.get("rope_interleave", True)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))
        except KeyError as e:
            raise CheckpointError(f"config.json is missing required key {e.args[0]!r}") from None
        problem = moe.check()
        if problem is None and cfg.qk_rope_head_dim % 2:
            problem = "qk_rope_head_dim must be even"
        if problem is not None:
            raise CheckpointError(problem)
        return cfg


def is_mla_config(d: dict[str, Any]) -> bool:
    """Whether a config dict names an `mla-moe` architecture."""
    return any(a in MLA_ARCHITECTURES for a in d.get("architectures") or [])


def _take(w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in w:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    return w.pop(name)


def _mlp(w: dict[str, torch.Tensor], hf: str, us: str, sd: dict[str, torch.Tensor]) -> None:
    sd[us + "gate_up_proj.weight"] = torch.cat([_take(w, hf + "gate_proj.weight"),
                                                _take(w, hf + "up_proj.weight")])
    sd[us + "down_proj.weight"] = _take(w, hf + "down_proj.weight")


def _attention(cfg: MlaConfig, w: dict[str, torch.Tensor], hf: str, us: str,
               sd: dict[str, torch.Tensor]) -> None:
    names = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"])
    names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    for n in names:
        sd[f"{us}{n}.weight"] = _take(w, f"{hf}{n}.weight")
    if cfg.attention_bias:
        for n in ("q_a_proj" if cfg.q_lora_rank else None, "kv_a_proj_with_mqa", "o_proj"):
            if n is not None:
                sd[f"{us}{n}.bias"] = _take(w, f"{hf}{n}.bias")


def to_state_dict(cfg: MlaConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map DeepSeek-V3 names onto MlaMoeForCausalLM's (experts stacked, gate/up fused);
    raise CheckpointError on a missing tensor or one left over."""
    sd = {"embed_tokens.weight": _take(w, "model.embed_tokens.weight"),
          "norm.weight": _take(w, "model.norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = _take(w, "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        _attention(cfg, w, hf + "self_attn.", us + "self_attn.", sd)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[us + norm + ".weight"] = _take(w, f"{hf}{norm}.weight")
        if i < cfg.first_k_dense_replace:
            _mlp(w, hf + "mlp.", us + "mlp.", sd)
            continue
        sd[us + "mlp.gate.weight"] = _take(w, hf + "mlp.gate.weight")
        if cfg.moe.topk_method == "noaux_tc":
            sd[us + "mlp.gate.e_score_correction_bias"] = _take(
                w, hf + "mlp.gate.e_score_correction_bias")
        experts = [f"{hf}mlp.experts.{e}." for e in range(cfg.moe.n_routed_experts)]
        sd[us + "mlp.w_gate_up"] = torch.stack([torch.cat(
            [_take(w, e + "gate_proj.weight"), _take(w, e + "up_proj.weight")]) for e in experts])
        sd[us + "mlp.w_down"] = torch.stack([_take(w, e + "down_proj.weight") for e in experts])
        if cfg.moe.n_shared_experts:
            _mlp(w, hf + "mlp.shared_experts.", us + "mlp.shared_experts.", sd)
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    left = [n for n in w if not ((m := mtp.match(n)) and int(m[1]) >= cfg.num_hidden_layers)]
    if left:
        raise CheckpointError(f"checkpoint has {len(left)} tensors the mla-moe loader does not "
                              f"know, e.g. {sorted(left)[:3]}")
    return sd


def load_mla_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> tuple[MlaMoeForCausalLM, MlaConfig]:
    """Build `MlaMoeForCausalLM` from an HF folder, weights in `dtype` on `device`, eval mode."""
    from agentserve.engine.model.mla_model import MlaMoeForCausalLM

    cfg = MlaConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
    sd = to_state_dict(cfg, read_hf_weights(model_dir))
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    return build_model(MlaMoeForCausalLM, cfg, sd, f"weights in {model_dir} do not match config.json"), cfg


# The tiny preset's routing (config.json keys beside PRESETS["mla-moe"]'s shapes).
TINY_ROUTING = dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                    moe_layer_freq=1, num_nextn_predict_layers=0)


def tiny_config_keys(p: dict[str, int]) -> dict[str, Any]:
    """config.json keys that make a tiny preset a DeepseekV3 checkpoint."""
    return dict(architectures=list(MLA_ARCHITECTURES), model_type="deepseek_v3",
                **TINY_ROUTING)


def tiny_weights(p: dict[str, int], vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random DeepSeek-V3-named weights: N(0, 0.02) in a fixed order, norms at 1."""
    g = torch.Generator().manual_seed(seed)
    H, heads = p["hidden_size"], p["num_attention_heads"]
    nope, rope, vd = p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["v_head_dim"]
    r, ql, inter = p["kv_lora_rank"], p["q_lora_rank"], p["moe_intermediate_size"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.02

    def mlp(pre: str, hidden: int, i: int) -> None:
        w[pre + "gate_proj.weight"], w[pre + "up_proj.weight"] = randn(i, hidden), randn(i, hidden)
        w[pre + "down_proj.weight"] = randn(hidden, i)

    w = {"model.embed_tokens.weight": randn(vocab, H)}
    for n in range(p["num_hidden_layers"]):
        pre = f"model.layers.{n}."
        a = pre + "self_attn."
        if ql:
            w[a + "q_a_proj.weight"], w[a + "q_a_layernorm.weight"] = randn(ql, H), torch.ones(ql)
            w[a + "q_b_proj.weight"] = randn(heads * (nope + rope), ql)
        else:
            w[a + "q_proj.weight"] = randn(heads * (nope + rope), H)
        w[a + "kv_a_proj_with_mqa.weight"] = randn(r + rope, H)
        w[a + "kv_a_layernorm.weight"] = torch.ones(r)
        w[a + "kv_b_proj.weight"] = randn(heads * (nope + vd), r)
        w[a + "o_proj.weight"] = randn(H, heads * vd)
        w[pre + "input_layernorm.weight"] = torch.ones(H)
        w[pre + "post_attention_layernorm.weight"] = torch.ones(H)
        if n < p["first_k_dense_replace"]:
            mlp(pre + "mlp.", H, p["intermediate_size"])
            continue
        E = p["n_routed_experts"]
        w[pre + "mlp.gate.weight"] = randn(E, H)
        w[pre + "mlp.gate.e_score_correction_bias"] = randn(E)
        for e in range(E):
            mlp(f"{pre}mlp.experts.{e}.", H, inter)
        mlp(pre + "mlp.shared_experts.", H, inter * p["n_shared_experts"])
    w["model.norm.weight"] = torch.ones(H)
    w["lm_head.weight"] = randn(vocab, H)
    return w
