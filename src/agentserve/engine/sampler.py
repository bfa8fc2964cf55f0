"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, constraints.

logits: [B, V] float32, one row per sequence that needs a token this step.
"""

from __future__ import annotations

import torch

from agentserve.engine.request import SamplingParams


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] -> probs: [V] after temperature, top-k and top-p (nucleus) filtering."""
    logits = logits / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = torch.where(logits < kth, torch.full_like(logits, -float("inf")), logits)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest set whose mass reaches top_p (always at least one token)
        drop = cum - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row. Greedy rows are batched; sampled rows use their own generator."""
    for i, p in enumerate(params):
        if p.constraint is not None:
            p.constraint.apply(logits[i])
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy[i])
            continue
        probs = logits_to_probs(logits[i].float(), p.temperature, p.top_k, p.top_p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A per-request generator: seeded requests are reproducible, others draw fresh entropy."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
