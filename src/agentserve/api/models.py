"""The built-in model shapes by preset name, shared by the engine (engine/model/tiny.py
writes their checkpoints) and the simulator (sim/specs.py sizes their KV and compute)."""

from __future__ import annotations

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
VOCAB_SIZE = 4096
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # DeepSeek-V3-style MLA + MoE (engine/model/mla*.py, moe.py); routing keys in mla_checkpoint.py
    "mla-moe": dict(hidden_size=256, intermediate_size=688, moe_intermediate_size=128,
                    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                    num_experts_per_tok=2, n_shared_experts=1),
}
