"""Llama / Qwen2 decoder over a paged KV cache (GQA, RoPE, RMSNorm, SwiGLU).

One forward computes one step: any mix of prefill chunks and decode tokens, laid out by
`prepare_batch`. Logits come back only for the rows that need them, as float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentserve.engine.model.attention import (
    BatchMeta,
    KVCache,
    PrefillMeta,
    SeqChunk,
    paged_attention,
    prepare_batch,
)
from agentserve.engine.model.checkpoint import ModelConfig

__all__ = ["BatchMeta", "KVCache", "LlamaForCausalLM", "PrefillMeta", "SeqChunk",
           "prepare_batch", "rope_cos_sin"]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, 1, head_dim / 2] for integer positions [T].

    Angles are formed in float64 (exact for positions far beyond 131,072) and computed on
    the fly from the step's positions, so no table is precomputed or grown.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    return ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama layout). x: [T, heads, D]; cos, sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # low precision: normalize in float32, cast back, then scale (as HF does)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMeta,
                kv: KVCache, layer: int) -> torch.Tensor:
        T = x.shape[0]
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * Hkv, self.head_dim)  # [T, H + 2 Hkv, D]
        qk = apply_rope(qkv[:, : H + Hkv], cos, sin)  # q and k rotated together
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]  # [T, H, D], [T, Hkv, D], [T, Hkv, D]
        o = paged_attention(q, k, v, kv, layer, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(T, H * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMeta,
                kv: KVCache, layer: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden], or [len(keep), hidden] when only rows `keep` matter."""
        a = self.self_attn(self.input_layernorm(h), cos, sin, meta, kv, layer)
        if keep is not None:  # K/V of every row are written above; the rest is per row
            h, a = h[keep], a[keep]
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 decoder; `forward(meta, kv)` runs one paged step."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))

    @torch.inference_mode()
    def forward(self, meta: BatchMeta, kv: KVCache) -> torch.Tensor:
        """Logits [num_need_logits, vocab] float32, in chunk order."""
        h = self.forward_hidden(meta, kv)
        return self.compute_logits(h[: len(meta.logits_idx)])

    @torch.inference_mode()
    def forward_hidden(self, meta: BatchMeta, kv: KVCache) -> torch.Tensor:
        """Final hidden states (after the norm) of rows ``meta.keep_idx``: [N + P, hidden]."""
        h = self.embed_tokens(meta.input_ids)  # [T, hidden]
        cos, sin = rope_cos_sin(meta.positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        last = len(self.layers) - 1
        keep = meta.keep_idx
        for i, layer in enumerate(self.layers):
            # The last layer's MLP only matters for rows whose logits we return: in a
            # prefill chunk that skips all but one row (~1/L of the MLP FLOPs).
            h = layer(h, cos, sin, meta, kv, i, keep=keep if i == last else None)
        return self.norm(h)  # [N + P, hidden]

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, hidden] -> logits [R, vocab] float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()
