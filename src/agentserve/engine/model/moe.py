"""Mixture-of-experts FFN (DeepSeek-V3 style): a top-k router over routed experts, plus shared
experts every token goes through.

Routing, as DeepSeek-V3's `noaux_tc` (sigmoid) or V2's `greedy` (softmax):

    s = sigmoid(x W_g^T) or softmax(x W_g^T)          # [T, E] affinities, float32
    choice = s + b                                     # b: e_score_correction_bias (sigmoid only)
    (n_group > 1: keep the topk_group groups whose two best `choice` scores sum highest)
    idx = topk(choice, k);  w = s[idx]                 # weights from s, not from choice
    w = w / sum(w) if norm_topk_prob;  w *= routed_scaling_factor
    y = sum_k w_k expert_idx_k(x) + shared(x)

The layer holds the experts of ``experts_owned`` only (all of them in one process); a
data-parallel rank will own a slice and dispatch the other tokens to their owners.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The routing and expert shapes of one MoE layer (from config.json)."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def check(self) -> str | None:
        """What is wrong with this spec, or None."""
        if self.scoring_func not in SCORING_FUNCS:
            return f"scoring_func {self.scoring_func!r} is not supported; only {SCORING_FUNCS}"
        if self.topk_method not in TOPK_METHODS:
            return f"topk_method {self.topk_method!r} is not supported; only {TOPK_METHODS}"
        if (self.topk_method == "noaux_tc") != (self.scoring_func == "sigmoid"):
            return "topk_method noaux_tc goes with scoring_func sigmoid, greedy with softmax"
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            return "num_experts_per_tok must be in [1, n_routed_experts]"
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            return "n_routed_experts must be a multiple of n_group"
        if not 0 < self.topk_group <= self.n_group:
            return "topk_group must be in [1, n_group]"
        if self.n_group > 1 and self.topk_group * self.n_routed_experts // self.n_group \
                < self.num_experts_per_tok:
            return "topk_group groups hold fewer experts than num_experts_per_tok"
        return None


class MLP(nn.Module):
    """SwiGLU FFN with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.n_routed_experts, spec.hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(spec.n_routed_experts))
                                        if spec.topk_method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sp = self.spec
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid() if sp.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores if self.e_score_correction_bias is None \
            else scores + self.e_score_correction_bias.float()
        if sp.n_group > 1:  # group-limited: only the topk_group best groups compete
            # (the others masked to -inf, as vLLM's grouped_topk; HF's fills 0.0, which differs
            # only if fewer than k allowed experts score above 0)
            T, E = choice.shape
            grouped = choice.view(T, sp.n_group, E // sp.n_group)
            best = grouped.topk(min(2, E // sp.n_group), dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
                1, best.topk(sp.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        idx = choice.topk(sp.num_experts_per_tok, dim=-1).indices  # [T, k]
        w = scores.gather(1, idx)
        if sp.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * sp.routed_scaling_factor, idx


class MoE(nn.Module):
    """Routed experts (stacked weights, the owned range only) + shared experts."""

    def __init__(self, spec: MoeSpec, experts_owned: range | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.experts_owned = experts_owned or range(spec.n_routed_experts)
        n, H, inter = len(self.experts_owned), spec.hidden_size, spec.moe_intermediate_size
        self.gate = Router(spec)
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * inter, H))  # per expert: [gate; up]
        self.w_down = nn.Parameter(torch.empty(n, H, inter))
        self.shared_experts = (MLP(H, inter * spec.n_shared_experts)
                               if spec.n_shared_experts else None)

    def routed(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """sum_k w[t, k] expert_idx[t, k](x[t]) over the owned experts; x: [T, H] -> [T, H].

        Token-sorted dispatch: each expert runs one matmul over the rows routed to it."""
        T, k = idx.shape
        flat = idx.flatten()  # [T * k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.spec.n_routed_experts).tolist()
        rows = order // k  # the token of each sorted assignment
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or e not in self.experts_owned:
                start += n
                continue
            sel, tok = order[start:start + n], rows[start:start + n]
            xe = x.index_select(0, tok)  # [n, H]
            j = e - self.experts_owned.start
            gate, up = F.linear(xe, self.w_gate_up[j]).chunk(2, dim=-1)
            ye = F.linear(F.silu(gate) * up, self.w_down[j])  # [n, H]
            out.index_add_(0, tok, ye * w.flatten()[sel, None].to(ye.dtype))
            start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x)
        y = self.routed(x, w, idx)
        return y if self.shared_experts is None else y + self.shared_experts(x)
