"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache.

Per token and layer the cache holds ONE latent of kv_lora + rope elements, shared by all
heads: c = RMSNorm(x W_DKV) [kv_lora] and the rope key k_pe = RoPE(x W_KR) [rope]. The
per-head keys and values are never stored; they are c expanded by kv_b_proj:

    k_h = [W_UK_h c ; k_pe],  v_h = W_UV_h c       W_UK_h: [nope, kv_lora], W_UV_h: [v, kv_lora]
    q_h = [q_nope_h ; q_pe_h]                      scale = 1 / sqrt(nope + rope)

Absorbed form (every paged step here): q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe, so
attention runs as multi-query attention with one KV head of width kv_lora + rope over the
latents themselves, queries [W_UK_h^T q_nope_h ; q_pe_h]; the output over the latent,
o_lat_h = sum_j p_j c_j, becomes o_h = W_UV_h o_lat_h. The paged machinery of attention.py
(decode groups, cascade over shared prefixes, prefixes read in place) runs unchanged on it:
the cache is a KVCache whose K and V are the same latent tensor. `naive_attention` is the
expanded form (per-head K and V), the reference the absorbed form is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentserve.engine.model.attention import BatchMeta, KVCache, paged_attention
from agentserve.engine.model.llama import RMSNorm, apply_rope
from agentserve.engine.model.mla_checkpoint import MlaConfig


def latent_bytes_per_token(cfg: MlaConfig, dtype: torch.dtype) -> int:
    """Latent bytes one token occupies across all layers: (kv_lora + rope) x layers x elem."""
    return cfg.num_hidden_layers * cfg.latent_dim * torch.empty((), dtype=dtype).element_size()


def allocate_latent(cfg: MlaConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: str | torch.device) -> KVCache:
    """Zeroed latent pool [layers, num_blocks, block_size, 1, kv_lora + rope], held as a
    KVCache whose k and v are this one tensor (one latent per token, not K and V)."""
    lat = torch.zeros((cfg.num_hidden_layers, num_blocks, block_size, 1, cfg.latent_dim),
                      dtype=dtype, device=device)
    return KVCache(lat, lat)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] pairs (x0, x1), (x2, x3), ... -> halves [x0, x2, ... | x1, x3, ...]: DeepSeek-V3
    rotates interleaved pairs; rotate-half RoPE then applies (q and k alike, so dot
    products are those of the interleaved rotation)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    def __init__(self, cfg: MlaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, nope, rope, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.kv_lora_rank)
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (nope + rope), bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, H * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, r + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(r, H * (nope + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        self.scale = (nope + rope) ** -0.5

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent
        [T, kv_lora + rope] (normalized c, rotated k_pe): what the cache stores."""
        c = self.cfg
        T, H = x.shape[0], c.num_attention_heads
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank
             else self.q_proj(x)).view(T, H, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        if c.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe[:, None], cos, sin)[:, 0]
        return q_nope, q_pe, torch.cat((self.kv_a_layernorm(ckv), k_pe), dim=-1)

    def absorb_q(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[W_UK_h^T q_nope_h ; q_pe_h]: [T, H, kv_lora + rope], queries over the latent."""
        w_uk, _ = self._w_uk_uv()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora]
        return torch.cat((q_lat, q_pe), dim=-1)

    def unabsorb_o(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output over the latent [T, H, kv_lora + rope] -> [T, hidden]."""
        _, w_uv = self._w_uk_uv()
        T, H = o.shape[:2]
        o_lat = o[..., :self.cfg.kv_lora_rank].transpose(0, 1)  # [H, T, kv_lora]; rope part unused
        o_v = torch.bmm(o_lat, w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(o_v.reshape(T, H * self.cfg.v_head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMeta,
                kv: KVCache, layer: int) -> torch.Tensor:
        """One paged step, absorbed: write the step's latents, attend over the latents."""
        q_nope, q_pe, lat = self.project(x, cos, sin)
        q = self.absorb_q(q_nope, q_pe)
        o = paged_attention(q, lat[:, None], lat[:, None], kv, layer, meta, self.scale)
        return self.unabsorb_o(o)

    def naive_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                        q_pos: torch.Tensor) -> torch.Tensor:
        """Expanded MLA: queries [S, H, *] at positions q_pos over one sequence's latents
        lat [K, kv_lora + rope] (positions 0..K-1), causal -> [S, hidden]."""
        c = self.cfg
        H = c.num_attention_heads
        ckv, k_pe = lat.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kvb = self.kv_b_proj(ckv).view(-1, H, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kvb.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [K, H, *]
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, H, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        mask = torch.arange(len(lat), device=lat.device)[None, :] <= q_pos[:, None]  # [S, K]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=self.scale)  # [H, S, v]
        return self.o_proj(o.transpose(0, 1).reshape(len(q_pos), H * c.v_head_dim))
