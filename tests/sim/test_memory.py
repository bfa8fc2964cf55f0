"""Each memory fact of SPEC.md ("Reference scale") reproduced by the memory model within 10%."""

from __future__ import annotations

import pytest

from agentserve.sim.memory import Topology, plan_memory, weight_bytes_per_gpu
from agentserve.sim.specs import GLM_5_2_FP8, H200, GiB, gqa_variant, model_spec

M = GLM_5_2_FP8


def near(value: float, target: float, tol: float = 0.10) -> bool:
    return abs(value / target - 1) <= tol


def test_param_counts_match_published_totals() -> None:
    assert near(M.total_params(), 744e9, 0.02)
    assert near(M.active_params(), 39e9)


def test_kv_bytes_per_token_mla() -> None:
    assert M.kv_elems_per_token_layer() == 576
    assert M.kv_bytes_per_token() == 44_928


def test_mla_vs_gqa8_vs_mha64_ratios() -> None:
    gqa8, mha = gqa_variant(M, 8, 256), gqa_variant(M, 64, 256)
    assert near(gqa8.kv_bytes_per_token() / M.kv_bytes_per_token(), 7)
    assert near(mha.kv_bytes_per_token() / M.kv_bytes_per_token(), 57)


def test_dep16_weights_per_gpu() -> None:
    assert near(weight_bytes_per_gpu(M, Topology("dep", 16)) / GiB, 65)


def test_dep16_prefill_rank() -> None:
    p = plan_memory(M, H200, Topology("dep", 16, "prefill"))
    assert 958_000 * 0.9 <= p.kv_tokens <= 990_000 * 1.1
    assert 40 * 0.9 <= p.kv_bytes / GiB <= 41 * 1.1


def test_dep16_decode_rank_with_mtp() -> None:
    p = plan_memory(M, H200, Topology("dep", 16, "decode", mtp=True))
    assert p.mtp > 0
    assert near(p.kv_tokens, 1_078_000)
    assert near(p.kv_bytes / GiB, 45)


def test_dep8_prefill_rank() -> None:
    p = plan_memory(M, H200, Topology("dep", 8, "prefill"))
    assert near(p.kv_tokens, 182_000)
    dep16 = weight_bytes_per_gpu(M, Topology("dep", 16))
    routed16 = M.routed_params() * M.weight_bytes / 16
    assert weight_bytes_per_gpu(M, Topology("dep", 8)) == pytest.approx(dep16 + routed16)


def test_tp8_aggregate_node() -> None:
    p = plan_memory(M, H200, Topology("tp", 8, "both", mtp=True))
    assert near((p.weights + p.mtp) / GiB, 89.5)
    assert near(p.kv_tokens_per_node, 598_000)
    assert p.kv_tokens_per_node == p.kv_tokens  # one latent copy per rank
    assert near(p.kv_bytes / GiB, 25)


def test_dep8_aggregate_node() -> None:
    p = plan_memory(M, H200, Topology("dep", 8, "both"))
    assert near(p.kv_tokens_per_node, 1_770_000)


@pytest.mark.xfail(strict=True, reason=(
    "SPEC's DEP16 node-share ~5.2M contradicts its own per-rank fact: 8 ranks x 958K = 7.7M "
    "per node. The model follows the per-rank facts (see README, memory model)."))
def test_dep16_node_share() -> None:
    p = plan_memory(M, H200, Topology("dep", 16, "both"))
    assert near(p.kv_tokens_per_node, 5_200_000)


def test_weights_that_do_not_fit_raise() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        plan_memory(M, H200, Topology("dep", 4, "prefill"))


def test_engine_presets_load() -> None:
    tiny = model_spec("tiny")
    assert tiny.kv_bytes_per_token() == 2 * 2 * 64 * 4 * 4  # K+V, 2 kv heads, 64 dim, 4 layers, fp32
    assert not tiny.is_moe and tiny.total_params() > 0
