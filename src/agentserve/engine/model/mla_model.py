"""The `mla-moe` decoder (DeepSeek-V3 / GLM-5 style): MLA attention over a paged latent cache,
dense SwiGLU FFNs in the first `first_k_dense_replace` layers, MoE FFNs (routed top-k +
shared experts) after. Same runner-facing interface as LlamaForCausalLM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentserve.engine.model.attention import BatchMeta, KVCache
from agentserve.engine.model.llama import RMSNorm, rope_cos_sin
from agentserve.engine.model.mla import MLAttention
from agentserve.engine.model.mla_checkpoint import MlaConfig
from agentserve.engine.model.moe import MLP, MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MlaConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (MLP(cfg.hidden_size, cfg.intermediate_size)
                               if index < cfg.first_k_dense_replace else MoE(cfg.moe))

    def forward(self, h: torch.Tensor, a: torch.Tensor, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Residual around the FFN, given attention output `a` ([T, hidden])."""
        if keep is not None:  # the latents of every row are written; the rest is per row
            h, a = h[keep], a[keep]
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class MlaMoeForCausalLM(nn.Module):
    """DeepseekV3-style decoder; `forward(meta, kv)` runs one paged step (absorbed MLA)."""

    def __init__(self, cfg: MlaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
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
        cos, sin = rope_cos_sin(meta.positions, self.cfg.qk_rope_head_dim, self.cfg.rope_theta,
                                h.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            a = layer.self_attn(layer.input_layernorm(h), cos, sin, meta, kv, i)
            h = layer(h, a, keep=meta.keep_idx if i == last else None)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, hidden] -> logits [R, vocab] float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()

    @torch.inference_mode()
    def forward_reference(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One sequence [S] from position 0, no cache, expanded (naive) MLA: logits [S, vocab].
        The reference the paged, absorbed path is tested against."""
        pos = torch.arange(len(input_ids), device=input_ids.device)
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(pos, self.cfg.qk_rope_head_dim, self.cfg.rope_theta, h.dtype)
        for layer in self.layers:
            att = layer.self_attn
            q_nope, q_pe, lat = att.project(layer.input_layernorm(h), cos, sin)
            h = layer(h, att.naive_attention(q_nope, q_pe, lat, pos))
        return self.compute_logits(self.norm(h))
