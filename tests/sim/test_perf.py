"""Step-time model: physical monotonicity, MTP, transfers, and the reference's cost method."""

from __future__ import annotations

import pytest

from agentserve.sim.cost import aggregate_cost, pool_cost
from agentserve.sim.memory import Topology
from agentserve.sim.perf import PerfModel, mtp_tokens_per_step
from agentserve.sim.specs import GLM_5_2_FP8, H200

M = GLM_5_2_FP8
DEC = PerfModel(M, H200, Topology("dep", 16, "decode", mtp=True))
PRE = PerfModel(M, H200, Topology("dep", 16, "prefill"))


def _ranks(per_rank: int, ctx: int = 50_000, width: int = 16) -> list[list[int]]:
    return [[ctx] * per_rank for _ in range(width)]


def test_mtp_tokens_per_step() -> None:
    assert mtp_tokens_per_step() == pytest.approx(2.97, abs=0.03)


def test_decode_step_grows_with_batch_and_context() -> None:
    t1, t8 = DEC.decode_step(_ranks(1)), DEC.decode_step(_ranks(8))
    assert t8 > t1
    assert DEC.decode_step(_ranks(8, 300_000)) > t8
    # Weight streaming + all-to-all latency dominate at batch 1: tens of ms, not seconds.
    assert 0.015 < t1 < 0.060


def test_decode_itl_order_of_magnitude_of_reference() -> None:
    """c16 of the calibration run: ~1 request per decode rank, ITL p50 11.7 ms."""
    itl = DEC.decode_step(_ranks(1)) / mtp_tokens_per_step()
    assert 0.008 < itl < 0.016


def test_no_mtp_is_cheaper_per_step_but_slower_per_token() -> None:
    off = PerfModel(M, H200, Topology("dep", 16, "decode", mtp=False))
    t_on, t_off = DEC.decode_step(_ranks(4)), off.decode_step(_ranks(4))
    assert t_off < t_on
    assert t_off > t_on / mtp_tokens_per_step()


def test_prefill_throughput_and_sparse_attention() -> None:
    ranks = [[(16_384, 0)] for _ in range(16)]
    t = PRE.prefill_step(ranks)
    tok_s_gpu = 16_384 / t
    assert 2_000 < tok_s_gpu < 20_000
    # Longer cached prefix costs more (indexer is O(context)); the top-k core does not grow.
    long = PRE.prefill_step([[(16_384, 200_000)] for _ in range(16)])
    assert long > t


def test_dep8_intranode_all_to_all_is_cheaper() -> None:
    d8 = PerfModel(M, H200, Topology("dep", 8, "decode"))
    d16 = PerfModel(M, H200, Topology("dep", 16, "decode"))
    assert d8.a2a_time(32) < d16.a2a_time(32)


def test_prefill_all_to_all_high_throughput_sends_a_token_once_per_node() -> None:
    """DeepEP's high-throughput kernels (the reference's prefill backend) send a token over
    RDMA once per remote node and forward it over NVLink; the low-latency ones once per
    remote expert: DEP16 over two nodes moves ~4x fewer inter-node bytes."""
    lat = 2 * PRE.eff.a2a_latency_s * M.moe_layers
    ll = PRE.a2a_time(8192, mode="low_latency") - lat
    ht = PRE.a2a_time(8192, mode="high_throughput") - lat
    assert 3.5 < ll / ht < 4.5
    # within one node there is no RDMA: NVLink-bound, still below per-expert sends
    p8 = PerfModel(M, H200, Topology("dep", 8, "prefill"))
    assert p8.a2a_time(8192, mode="high_throughput") < p8.a2a_time(8192, mode="low_latency")
    with pytest.raises(ValueError, match="low_latency or high_throughput"):
        PRE.a2a_time(1, mode="nccl")


def test_prefill_all_to_all_blocks_without_dual_batch_overlap() -> None:
    """The reference runs no `--enable-dbo`: a prefill step pays its all-to-all on top of
    its compute; with full overlap it would hide under it."""
    from dataclasses import replace

    ranks = [[(2048, 0)] for _ in range(16)]
    overlapped = PerfModel(M, H200, PRE.topo, eff=replace(PRE.eff, prefill_overlap=1.0))
    gap = PRE.prefill_step(ranks) - overlapped.prefill_step(ranks)
    assert gap == pytest.approx(PRE.a2a_time(2048, mode="high_throughput"))


def test_transfer_and_restore() -> None:
    """A token's KV moves whole, by a P->D pull or a CPU restore: the latent KV of 78 + 1 (MTP)
    layers and the indexer keys, ~7.5% over SPEC's 44,928 bytes of the 78 layers' latent."""
    moved = 100_000 * (M.kv_bytes_per_token() * 79 / 78 + M.indexer_bytes_per_token())
    assert M.state_bytes_per_token() * 100_000 == pytest.approx(moved)
    assert moved / (100_000 * M.kv_bytes_per_token()) == pytest.approx(1.075, abs=0.01)
    assert DEC.kv_transfer_time(100_000) == pytest.approx(moved / 4.3e9, rel=0.01)
    assert DEC.cpu_restore_time(100_000) == pytest.approx(0.026 * moved / 1e9)


def test_pull_posting_counts_blocks_times_regions() -> None:
    """The decode worker posts a descriptor per pulled block per registered KV region: GLM-5.2's
    78 layers' latent caches, the MTP layer's and the 21 indexer-key caches (~100, vllm#55434
    counts 101 for GLM-5.3); a partial block is one block, nothing pulled posts nothing."""
    from agentserve.sim.linkcost import NIXL_POST_S

    assert DEC.kv_regions() == 78 + 1 + 21
    assert DEC.kv_post_time(100_000, 64) == pytest.approx(1563 * 100 * NIXL_POST_S)
    assert DEC.kv_post_time(1, 64) == pytest.approx(100 * NIXL_POST_S)
    assert DEC.kv_post_time(0, 64) == 0.0
    # the posting stays a small share of the pull it starts (vllm#55434: ~15% on IB rc_x)
    assert 0.05 < DEC.kv_post_time(64_000, 64) / DEC.kv_transfer_time(64_000) < 0.2


def test_reference_cost_method() -> None:
    """SPEC calibration: 3P1D DEP16, 431K input and 6,281 output tok/s -> $0.08 / $1.92 per M."""
    c = pool_cost(48, 16, 431_000, 6_281, 2.71)
    assert c.per_m_input == pytest.approx(0.08, rel=0.10)
    assert c.per_m_output == pytest.approx(1.92, rel=0.10)
    assert c.per_hour == pytest.approx(64 * 2.71)
    a = aggregate_cost(16, 100_000, 1_000, 0.5)
    assert a.per_m_input == pytest.approx(8 * 2.71 / 360)


def test_measured_profile_replaces_efficiency_factors() -> None:
    from dataclasses import replace

    from agentserve.sim.specs import model_spec

    hw = replace(H200, name="cpu-local", measured={"step_overhead_s": 0.004, "per_request_s": 0.001})
    p = PerfModel(model_spec("tiny"), hw, Topology("dep", 1, "both"))
    assert p.eff.flops == 1.0 and p.eff.step_overhead_s == 0.004 and p.eff.per_request_s == 0.001


def test_indexer_reads_keys_per_query_beyond_kernel_window() -> None:
    """MTP verify (4 query tokens) > the logits kernel's 2: each query reads the key column."""
    bw = H200.hbm_bw * DEC.eff.hbm
    keys = 8 * 16 * (200_000 - 3_000)  # 8 requests per rank, all 16 ranks
    grow = DEC.decode_step(_ranks(8, 200_000)) - DEC.decode_step(_ranks(8, 3_000))
    assert grow > 4 * keys / 16 * M.indexer_bytes_per_token() / bw
    off = PerfModel(M, H200, Topology("dep", 16, "decode", mtp=False))  # one query: one read
    grow_off = off.decode_step(_ranks(8, 200_000)) - off.decode_step(_ranks(8, 3_000))
    assert grow_off < grow / 2


def test_streamed_weights_skip_input_embedding_and_fp8_kv_b() -> None:
    from agentserve.sim.memory import weight_bytes_per_gpu

    unread = M.vocab * M.hidden * M.embed_bytes + M.layers * M.kv_lora * M.n_heads * (
        M.nope_dim + M.v_head_dim) * M.weight_bytes
    assert DEC.rank_weight_bytes(1.0) == pytest.approx(weight_bytes_per_gpu(M, DEC.topo) - unread)


def test_recompute_costs_prefill_compute() -> None:
    assert DEC.recompute_time([[] for _ in range(16)]) == 0.0
    t = DEC.recompute_time([[(50_000, 0)]] + [[] for _ in range(15)])
    assert t > 50_000 * 2 * M.replicated_params() / (H200.fp8_flops * DEC.eff.flops)


def test_glm52_indexcache_indexer_layers() -> None:
    """GLM-5.2's config: index_n_heads 32, index_topk_freq 4, index_skip_topk_offset 3 ->
    the indexer runs on layers 1-3 and every 4th after (21 of 78); its key cache only there."""
    assert M.indexer_heads == 32 and M.indexer_layers() == 21
    assert M.indexer_bytes_per_token() == (M.indexer_dim + 4) * 21
    from dataclasses import replace

    every = replace(M, index_topk_freq=1, index_skip_offset=0)  # DeepSeek-V3.2: every layer
    assert every.indexer_layers() == 78
    # the indexer part of a long-context prefill token scales with the indexer layers
    p_every = PerfModel(every, H200, Topology("dep", 16, "prefill"))
    short, long_ = 3_000, 300_000
    d_share = PRE._attn_flops(long_) - PRE._attn_flops(short)
    d_every = p_every._attn_flops(long_) - p_every._attn_flops(short)
    assert d_every / d_share == pytest.approx(78 / 21, rel=0.02)
    # and so does the decode key scan
    grow = DEC.decode_step(_ranks(8, 200_000)) - DEC.decode_step(_ranks(8, 3_000))
    d_ev = PerfModel(every, H200, Topology("dep", 16, "decode", mtp=True))
    grow_every = d_ev.decode_step(_ranks(8, 200_000)) - d_ev.decode_step(_ranks(8, 3_000))
    assert grow_every > 2.5 * grow


def test_efficiency_overrides_reach_the_step_model() -> None:
    """`SimConfig.efficiency` (`agentserve sim --efficiency`) replaces the named factors only:
    weights streamed at 0.5 of HBM instead of 0.8 lengthen a bytes-bound decode step, and a
    simulated stage's ITL with it; the prefill chunk is FLOP-bound and hardly moves."""
    from agentserve.sim.config import efficiency
    from agentserve.sim.run import SimConfig, simulate

    eff = efficiency({"hbm": 0.5})
    assert eff.hbm == 0.5 and eff.flops == efficiency(None).flops
    slow = PerfModel(M, H200, Topology("dep", 16, "decode", mtp=True), eff)
    assert slow.decode_step(_ranks(1)) > 1.3 * DEC.decode_step(_ranks(1))
    pre = PerfModel(M, H200, Topology("dep", 16, "prefill"), eff)
    chunk = [[(2048, 40_000)]] * 16
    assert pre.prefill_step(chunk) == pytest.approx(PRE.prefill_step(chunk), rel=0.05)
    base = simulate(SimConfig(concurrency=16, duration=60, warmup=30))
    what_if = simulate(SimConfig(concurrency=16, duration=60, warmup=30, efficiency={"hbm": 0.5}))
    assert what_if["itl_ms"]["p50"] > 1.2 * base["itl_ms"]["p50"]
