"""Model and hardware specs: architecture -> parameter counts, KV bytes per token; GPU rates.

Parameter counts are computed from the architecture (no published totals are typed in),
so `glm-5.2-fp8` can be checked against SPEC.md's "744B total, 39B active". Units:
parameters are counts, bytes are bytes, rates are per second.

Attention families and their KV per token per layer (elements):
- MLA: one latent `kv_lora + rope` (512 + 64 = 576), shared by all heads.
- GQA: K and V for each KV head: `2 * n_kv_heads * head_dim`.
- MHA: GQA with `n_kv_heads == n_heads`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer; MoE when `n_routed > 0`, MLA when `kv_lora > 0`."""

    name: str
    layers: int
    hidden: int
    vocab: int
    n_heads: int
    head_dim: int = 128  # GQA/MHA head size
    n_kv_heads: int = 0  # GQA/MHA only
    # MLA (DeepSeek-V2 style): q down/up, kv latent, decoupled RoPE key
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_head_dim: int = 0
    # sparse-attention indexer (DeepSeek-V3.2 "lightning indexer")
    indexer_heads: int = 0
    indexer_dim: int = 0
    index_topk: int = 0
    # IndexCache (GLM-5.x `index_topk_freq` / `index_skip_topk_offset`): the indexer runs on
    # the first `index_skip_offset` layers and then on every `index_topk_freq`-th layer; the
    # other layers reuse the previous indexer layer's top-k. freq 1: every layer (DeepSeek-V3.2).
    index_topk_freq: int = 1
    index_skip_offset: int = 0
    # feed-forward
    dense_layers: int = 0  # leading dense-FFN layers of a MoE model (all layers if not MoE)
    dense_intermediate: int = 0
    n_routed: int = 0
    n_shared: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    mtp_layers: int = 0  # multi-token-prediction heads (one extra MoE layer each)
    weight_bytes: float = 2.0  # bytes per linear-layer parameter (FP8: 1)
    embed_bytes: float = 2.0  # embeddings and LM head stay bf16 in FP8 checkpoints
    kv_elem_bytes: float = 2.0  # bytes per KV element (FP8 KV: 1)
    tied_embeddings: bool = False

    # -- structure -----------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora > 0

    @property
    def is_moe(self) -> bool:
        return self.n_routed > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    # -- parameters per layer --------------------------------------------------------
    def attn_params(self) -> int:
        """Attention projections of one layer (indexer included)."""
        h, H = self.hidden, self.n_heads
        if self.is_mla:
            q = (h * self.q_lora + self.q_lora * H * (self.nope_dim + self.rope_dim)
                 if self.q_lora else h * H * (self.nope_dim + self.rope_dim))
            kv = h * (self.kv_lora + self.rope_dim) + self.kv_lora * H * (self.nope_dim + self.v_head_dim)
            o = H * self.v_head_dim * h
            idx = (self.q_lora * self.indexer_heads * self.indexer_dim
                   + h * self.indexer_dim + h * self.indexer_heads) if self.indexer_heads else 0
            return q + kv + o + idx
        kvh = self.n_kv_heads or H
        return h * H * self.head_dim * 2 + 2 * h * kvh * self.head_dim

    def attn_replicated_params(self) -> int:
        """Attention params a TP group cannot shard (MLA down-projections, indexer key/weights)."""
        if not self.is_mla:
            return 0
        h = self.hidden
        return (h * self.q_lora + h * (self.kv_lora + self.rope_dim)
                + h * self.indexer_dim + h * self.indexer_heads)

    def expert_params(self) -> int:
        """One expert: gate, up, down (SwiGLU)."""
        return 3 * self.hidden * self.expert_intermediate

    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    def embed_params(self) -> int:
        """Input embedding plus LM head (one matrix if tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    # -- totals ----------------------------------------------------------------------
    def routed_params(self) -> int:
        return self.moe_layers * self.n_routed * self.expert_params()

    def replicated_params(self) -> int:
        """Linear params outside the routed experts (attention, dense FFN, shared experts, gates)."""
        ffn = self.dense_layers if self.is_moe else self.layers
        shared = self.moe_layers * (self.n_shared * self.expert_params() + self.hidden * self.n_routed)
        return self.layers * self.attn_params() + ffn * self.dense_ffn_params() + shared

    def total_params(self) -> int:
        """All parameters of the main model (MTP heads excluded, as published totals do)."""
        return self.routed_params() + self.replicated_params() + self.embed_params()

    def active_params(self) -> int:
        """Parameters one token multiplies through: no embeddings, top-k routed experts only."""
        routed = self.moe_layers * self.top_k * self.expert_params()
        return self.replicated_params() + routed + self.vocab * self.hidden

    def mtp_params(self) -> int:
        """One MTP head: eh_proj (2h -> h) and one MoE layer; it shares embedding and LM head."""
        if not self.mtp_layers:
            return 0
        layer = (self.attn_params() + (self.n_routed + self.n_shared) * self.expert_params()
                 + self.hidden * self.n_routed)
        return self.mtp_layers * (2 * self.hidden * self.hidden + layer)

    # -- KV ----------------------------------------------------------------------------
    def kv_elems_per_token_layer(self) -> int:
        if self.is_mla:
            return self.kv_lora + self.rope_dim
        return 2 * (self.n_kv_heads or self.n_heads) * self.head_dim

    def kv_bytes_per_token(self) -> float:
        """KV bytes per token over all layers (MLA: the indexer's key cache is not counted);
        SPEC's figure, by which the memory facts count a rank's KV tokens."""
        return self.kv_elems_per_token_layer() * self.layers * self.kv_elem_bytes

    def state_bytes_per_token(self) -> float:
        """Bytes of every cache a rank keeps per token: the latent KV of each layer and of
        the MTP layers, and the indexer's keys. What moves when a token's KV does: a P->D pull
        reads every registered region, and the CPU offloading connector copies every KV
        tensor of a block (so a tier of N bytes holds N / this many tokens)."""
        return (self.kv_bytes_per_token() * (self.layers + self.mtp_layers) / self.layers
                + self.indexer_bytes_per_token())

    def indexer_layers(self) -> int:
        """Layers that run the indexer (score keys, select top-k) and keep its key cache:
        1-based layer l computes when l <= offset or (l - offset) % freq == 0 (GLM-5.2's
        `_is_index_compute_layer`); the rest reuse the indices of the last computing layer."""
        if not self.indexer_heads:
            return 0
        f, o = max(1, self.index_topk_freq), max(0, self.index_skip_offset)
        return min(o, self.layers) + max(0, self.layers - o) // f  # (in closed form: step-time hot path)

    def indexer_bytes_per_token(self) -> float:
        """Indexer key cache: FP8 key plus one fp32 scale per token per indexer layer."""
        return (self.indexer_dim + 4) * self.indexer_layers() if self.indexer_heads else 0.0


GLM_5_2_FP8 = ModelSpec(
    name="glm-5.2-fp8", layers=78, hidden=6144,
    vocab=154_880,  # GLM-4.5/5 tokenizer (151,329 tokens) padded; assumption, ~1 GB either way
    n_heads=64, q_lora=2048, kv_lora=512, rope_dim=64, nope_dim=192, v_head_dim=256,
    # GLM-5.2's config.json (GlmMoeDsaForCausalLM): index_n_heads 32, index_head_dim 128,
    # index_topk 2048, index_topk_freq 4, index_skip_topk_offset 3 -> the indexer runs on 21 of
    # 78 layers (IndexCache). It was DeepSeek-V3.2's shape (64 heads, every layer) before.
    indexer_heads=32, indexer_dim=128, index_topk=2048, index_topk_freq=4, index_skip_offset=3,
    dense_layers=3, dense_intermediate=12_288,  # dense FFN width: assumption (2 x 6144)
    n_routed=256, n_shared=1, top_k=8, expert_intermediate=2048, mtp_layers=1,
    weight_bytes=1.0, embed_bytes=2.0, kv_elem_bytes=1.0,
)


def _engine_preset(name: str) -> ModelSpec:
    """Our engine's tiny/small Llama presets (api/models.py), fp32 weights on CPU."""
    from agentserve.api.models import PRESETS, VOCAB_SIZE

    p = PRESETS[name]
    return ModelSpec(
        name=name, layers=p["num_hidden_layers"], hidden=p["hidden_size"], vocab=VOCAB_SIZE,
        n_heads=p["num_attention_heads"], n_kv_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"], dense_intermediate=p["intermediate_size"],
        weight_bytes=4.0, embed_bytes=4.0, kv_elem_bytes=4.0,
    )


def gqa_variant(m: ModelSpec, n_kv_heads: int, head_dim: int = 256) -> ModelSpec:
    """The same model with GQA/MHA attention (for the KV-size comparison of SPEC.md)."""
    return replace(m, name=f"{m.name}-gqa{n_kv_heads}", kv_lora=0, q_lora=0, rope_dim=0,
                   nope_dim=0, v_head_dim=0, indexer_heads=0, n_kv_heads=n_kv_heads,
                   head_dim=head_dim)


def model_spec(name: str) -> ModelSpec:
    if name == GLM_5_2_FP8.name:
        return GLM_5_2_FP8
    if name in ("tiny", "small"):
        return _engine_preset(name)
    raise ValueError(f"unknown model {name!r}; choose one of: glm-5.2-fp8, tiny, small")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator and its links; rates are peaks (perf.py applies efficiency factors)."""

    name: str
    hbm_bytes: float  # device memory
    hbm_bw: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    gpus_per_node: int
    nvlink_bw: float  # bytes/s per GPU, one direction
    net_bw: float  # bytes/s per GPU across nodes (InfiniBand)
    price_per_hour: float  # $ per GPU-hour
    cpu_restore_s_per_gb: float = 0.026  # SPEC: CPU -> GPU restore ~26 ms per GB
    measured: dict | None = None  # cpu-local: the calibration profile, if any


# H200 SXM: 141 GB marketed = 143,771 MiB as nvidia-smi reports (140.4 GiB).
H200 = HardwareSpec(
    name="h200", hbm_bytes=143_771 * 1024**2, hbm_bw=4.8e12, bf16_flops=990e12,
    fp8_flops=1980e12, gpus_per_node=8, nvlink_bw=450e9, net_bw=50e9, price_per_hour=2.71,
)

CPU_PROFILE_ENV = "AGENTSERVE_SIM_CPU_PROFILE"
# The committed profile, package data beside this file (`agentserve sim calibrate` writes
# it), so `agentserve sim` run from anywhere, or installed, reads the same one.
CPU_PROFILE_DEFAULT = Path(__file__).resolve().parent / "data" / "cpu_profile.json"


def cpu_profile_path(profile: str | Path | None = None) -> Path | None:
    """The cpu-local profile to read: `profile`, else `$AGENTSERVE_SIM_CPU_PROFILE`, else the
    committed one, package data (None when that is absent: placeholder rates). A profile named by
    either of the first two must exist: a typo must not turn into placeholder rates."""
    named = profile or os.environ.get(CPU_PROFILE_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            origin = "--cpu-profile" if profile else f"${CPU_PROFILE_ENV}"
            raise ValueError(f"the cpu-local profile {path} ({origin}) is not a file; write one "
                             "with `agentserve sim calibrate --out PATH`")
        return path
    return CPU_PROFILE_DEFAULT if CPU_PROFILE_DEFAULT.is_file() else None


def cpu_local(profile: str | Path | None = None, *, bare: bool = False) -> HardwareSpec:
    """This machine: placeholder rates, replaced by `agentserve sim calibrate`'s JSON
    (`cpu_profile_path(profile)`); `bare`: the placeholders, no profile read."""
    path = None if bare else cpu_profile_path(profile)
    measured = json.loads(path.read_text()) if path is not None else None
    base = HardwareSpec(
        name="cpu-local", hbm_bytes=8 * GiB, hbm_bw=10e9, bf16_flops=50e9, fp8_flops=50e9,
        gpus_per_node=1, nvlink_bw=5e9, net_bw=1e9, price_per_hour=0.10, measured=measured,
    )
    if measured:
        base = replace(base, bf16_flops=measured.get("flops", base.bf16_flops),
                       fp8_flops=measured.get("flops", base.fp8_flops),
                       hbm_bw=measured.get("mem_bw", base.hbm_bw))
    return base


def hardware_spec(name: str, cpu_restore_s_per_gb: float | None = None,
                  cpu_profile: str | Path | None = None) -> HardwareSpec:
    """The named hardware; `cpu_restore_s_per_gb` replaces its CPU -> GPU restore rate (how
    the CPU tier is reached, pinned or pageable, is a property of the deployment);
    `cpu_profile`: cpu-local's calibration profile (`cpu_profile_path`)."""
    if name == "h200":
        hw = H200
    elif name == "cpu-local":
        hw = cpu_local(cpu_profile)
    else:
        raise ValueError(f"unknown gpu {name!r}; choose one of: h200, cpu-local")
    if cpu_restore_s_per_gb is None:
        return hw
    if not (math.isfinite(cpu_restore_s_per_gb) and cpu_restore_s_per_gb > 0):
        raise ValueError(f"the CPU restore rate must be a positive number of seconds per GB, "
                         f"got {cpu_restore_s_per_gb}")
    return replace(hw, cpu_restore_s_per_gb=cpu_restore_s_per_gb)
