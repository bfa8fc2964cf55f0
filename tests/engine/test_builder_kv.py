"""The KV capacity the builder picks: explicit tokens or GiB, else 131,072 tokens capped at 4 GiB."""

from __future__ import annotations

import pytest

from agentserve.engine.builder import DEFAULT_KV_GIB, DEFAULT_KV_TOKENS, EngineArgs, EngineConfigError, _num_blocks

SMOLLM2_FP32 = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head_dim x 4 bytes = 46,080
TINY_FP32 = 4096  # bytes a token small enough that 131,072 tokens fit well under 4 GiB


def test_default_is_131072_tokens_for_a_small_model() -> None:
    assert _num_blocks(EngineArgs(block_size=16), TINY_FP32) * 16 == DEFAULT_KV_TOKENS


def test_default_is_capped_at_4_gib_for_a_larger_model() -> None:
    blocks = _num_blocks(EngineArgs(block_size=16), SMOLLM2_FP32)
    assert blocks * 16 * SMOLLM2_FP32 <= DEFAULT_KV_GIB * 2**30
    assert blocks * 16 < DEFAULT_KV_TOKENS  # 5.6 GiB uncapped
    assert (blocks + 1) * 16 * SMOLLM2_FP32 > DEFAULT_KV_GIB * 2**30 - 16 * SMOLLM2_FP32


def test_explicit_sizes_win_and_conflicts_are_errors() -> None:
    assert _num_blocks(EngineArgs(block_size=16, kv_cache_tokens=1_000_000), SMOLLM2_FP32) == 62_500
    assert _num_blocks(EngineArgs(block_size=16, kv_cache_gib=8.0), SMOLLM2_FP32) * 16 > DEFAULT_KV_TOKENS
    with pytest.raises(EngineConfigError, match="either"):
        _num_blocks(EngineArgs(kv_cache_tokens=64, kv_cache_gib=1.0), SMOLLM2_FP32)
