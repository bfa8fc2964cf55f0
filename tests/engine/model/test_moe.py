"""MoE FFN (moe.py): routing and expert mixing against a dense loop over tokens and experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentserve.engine.model.moe import MoE, MoeSpec


def _moe(spec: MoeSpec, seed: int = 0, owned: range | None = None) -> MoE:
    g = torch.Generator().manual_seed(seed)
    m = MoE(spec)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if owned is None:
        return m
    part = MoE(spec, experts_owned=owned)
    sd = dict(m.state_dict())
    sd["w_gate_up"], sd["w_down"] = (sd[k][owned.start:owned.stop] for k in ("w_gate_up", "w_down"))
    part.load_state_dict(sd)
    return part


def _reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, as DeepSeek-V3's routing rule reads."""
    sp = m.spec
    out = torch.zeros_like(x)
    size = sp.n_routed_experts // sp.n_group
    for t in range(len(x)):
        logits = m.gate.weight @ x[t]
        s = logits.sigmoid() if sp.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = s + (m.gate.e_score_correction_bias if m.gate.e_score_correction_bias is not None
                      else 0)
        groups = sorted(range(sp.n_group), key=lambda gi: -float(
            sum(sorted(choice[gi * size:(gi + 1) * size].tolist(), reverse=True)[:2])))
        allowed = [e for gi in groups[:sp.topk_group] for e in range(gi * size, (gi + 1) * size)]
        top = sorted(allowed, key=lambda e: -float(choice[e]))[:sp.num_experts_per_tok]
        w = torch.stack([s[e] for e in top])
        if sp.norm_topk_prob:
            w = w / w.sum()
        w = w * sp.routed_scaling_factor
        for we, e in zip(w, top):
            gate, up = (m.w_gate_up[e] @ x[t]).chunk(2)
            out[t] += we * (m.w_down[e] @ (F.silu(gate) * up))
        if m.shared_experts is not None:
            out[t] += m.shared_experts(x[t])
    return out


SPECS = {
    "sigmoid-noaux": MoeSpec(64, 32, 8, 2, n_shared_experts=1, routed_scaling_factor=2.5),
    "sigmoid-grouped": MoeSpec(64, 32, 8, 3, n_shared_experts=2, n_group=4, topk_group=2),
    "softmax-greedy": MoeSpec(64, 32, 8, 2, n_shared_experts=0, scoring_func="softmax",
                              topk_method="greedy", norm_topk_prob=False),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_moe_equals_dense_loop(name: str) -> None:
    m = _moe(SPECS[name])
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m(x), _reference(m, x), atol=1e-5, rtol=1e-5)


def test_router_weights_and_choice() -> None:
    """Experts chosen by score + bias, weighted by the score alone, normalized, scaled."""
    m = _moe(SPECS["sigmoid-noaux"])
    with torch.no_grad():
        m.gate.e_score_correction_bias.zero_()
        m.gate.e_score_correction_bias[7] = 100.0  # always chosen, weighted by its own score
        x = torch.randn(5, 64)
        w, idx = m.gate(x)
        s = (x @ m.gate.weight.T).sigmoid()
    assert (idx == 7).any(-1).all()
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))
    e7 = (idx == 7).float().argmax(-1)
    chosen = s.gather(1, idx)
    torch.testing.assert_close(w.gather(1, e7[:, None])[:, 0],
                               2.5 * s[:, 7] / chosen.sum(-1))


def test_expert_slices_sum_to_the_whole() -> None:
    """A rank owning a slice of experts computes those experts' share; slices add up."""
    spec = SPECS["sigmoid-noaux"]
    full, lo, hi = _moe(spec), _moe(spec, owned=range(0, 3)), _moe(spec, owned=range(3, 8))
    x = torch.randn(9, 64)
    with torch.no_grad():
        w, idx = full.gate(x)
        parts = lo.routed(x, w, idx) + hi.routed(x, w, idx)
        torch.testing.assert_close(parts, full.routed(x, w, idx), atol=1e-5, rtol=1e-5)
        assert lo.routed(x, w, idx).abs().sum() > 0 and lo.w_down.shape[0] == 3


@pytest.mark.parametrize("kw, msg", [
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(topk_method="group_limited_greedy"), "topk_method"),
    (dict(scoring_func="softmax"), "noaux_tc goes with"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(n_group=3), "multiple of n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
])
def test_bad_specs_say_what_is_wrong(kw: dict, msg: str) -> None:
    base = dict(hidden_size=8, moe_intermediate_size=4, n_routed_experts=8, num_experts_per_tok=2)
    assert msg in (MoeSpec(**(base | kw)).check() or "")
