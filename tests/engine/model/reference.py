"""Dense, unpaged Llama forward written independently of the engine (test oracle).

Full causal attention over the whole sequence, no cache, HF weight names read straight
from the safetensors file, explicit softmax (no SDPA), GQA by repeat_interleave.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


class DenseLlama:
    """`logits(token_ids) -> [T, vocab]` float32 for one whole sequence."""

    def __init__(self, model_dir: str | Path) -> None:
        self.c = json.loads((Path(model_dir) / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x / torch.sqrt(var + self.c["rms_norm_eps"]))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [heads, T, D]
        d = x.shape[-1]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = pos.double()[:, None] * inv[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * cos + rot * sin

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        c, w = self.c, self.w
        T = len(token_ids)
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        pos = torch.arange(T)
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = self._proj(h, p + "self_attn.q_proj").view(T, nh, hd).transpose(0, 1)
            k = self._proj(h, p + "self_attn.k_proj").view(T, nkv, hd).transpose(0, 1)
            v = self._proj(h, p + "self_attn.v_proj").view(T, nkv, hd).transpose(0, 1)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k = k.repeat_interleave(nh // nkv, dim=0)
            v = v.repeat_interleave(nh // nkv, dim=0)
            s = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            s = s.masked_fill(~causal, float("-inf")).softmax(-1)
            a = (s @ v).transpose(0, 1).reshape(T, nh * hd)
            x = x + self._proj(a, p + "self_attn.o_proj")
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = self._norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return x @ head.T

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]
