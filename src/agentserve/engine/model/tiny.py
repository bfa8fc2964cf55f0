"""Deterministic, offline tiny Llama checkpoints (random weights + a real BPE tokenizer).

`make_tiny` writes an HF-format folder that both our engine and vLLM load: `config.json`,
`generation_config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`.
The tokenizer is a byte-level BPE trained on a fixed list of standard-library sources, so
it needs no network and the same Python yields byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch

from agentserve.api.models import PRESETS, SPECIAL_TOKENS, VOCAB_SIZE

# Long-lived modules (several deprecated, so rarely patched): ~1.1 MB of code and prose.
CORPUS_FILES = sorted([
    "_pydecimal.py", "aifc.py", "calendar.py", "cgi.py", "colorsys.py", "difflib.py",
    "doctest.py", "fractions.py", "ftplib.py", "heapq.py", "imaplib.py", "mailbox.py",
    "nntplib.py", "optparse.py", "pickletools.py", "smtpd.py", "statistics.py",
    "textwrap.py", "turtle.py",
])

# ChatML with Qwen2.5-style tools: tool JSON in the system turn, calls as <tool_call> JSON.
CHAT_TEMPLATE = """\
{%- set default_system = 'You are a helpful assistant.' -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = default_system -%}{%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system -}}
{%- if tools -%}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in rest -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
{%- for tc in message.tool_calls or [] -%}
{%- set call = tc.function if tc.function is defined else tc -%}
{%- set args = call.arguments if call.arguments is string else (call.arguments | tojson) -%}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + args + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def train_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821
    """Byte-level BPE with VOCAB_SIZE tokens; ids 0..4 are SPECIAL_TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text(encoding="utf-8") for f in CORPUS_FILES if (stdlib / f).is_file()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _hf_weights(p: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named weights: N(0, 0.02) drawn in a fixed order, norms at 1."""
    if "kv_lora_rank" in p:  # the mla-moe family
        from agentserve.engine.model.mla_checkpoint import tiny_weights

        return tiny_weights(p, VOCAB_SIZE, seed)
    g = torch.Generator().manual_seed(seed)
    H, D = p["hidden_size"], p["head_dim"]
    q_out, kv_out, inter = p["num_attention_heads"] * D, p["num_key_value_heads"] * D, p["intermediate_size"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.02

    w = {"model.embed_tokens.weight": randn(VOCAB_SIZE, H)}
    for i in range(p["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w[pre + "self_attn.q_proj.weight"] = randn(q_out, H)
        w[pre + "self_attn.k_proj.weight"] = randn(kv_out, H)
        w[pre + "self_attn.v_proj.weight"] = randn(kv_out, H)
        w[pre + "self_attn.o_proj.weight"] = randn(H, q_out)
        w[pre + "mlp.gate_proj.weight"] = randn(inter, H)
        w[pre + "mlp.up_proj.weight"] = randn(inter, H)
        w[pre + "mlp.down_proj.weight"] = randn(H, inter)
        w[pre + "input_layernorm.weight"] = torch.ones(H)
        w[pre + "post_attention_layernorm.weight"] = torch.ones(H)
    w["model.norm.weight"] = torch.ones(H)
    w["lm_head.weight"] = randn(VOCAB_SIZE, H)
    return w


def _configs(p: dict[str, int], ids: dict[str, int]) -> dict[str, dict]:
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB_SIZE, **p,
        hidden_act="silu", max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=None,
        rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, use_cache=True,
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, torch_dtype="float32",
    )
    if "kv_lora_rank" in p:  # the mla-moe family: a DeepseekV3 config
        from agentserve.engine.model.mla_checkpoint import tiny_config_keys

        config.update(tiny_config_keys(p))
    generation = dict(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
    added = {str(ids[t]): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                               single_word=False, special=True) for t in SPECIAL_TOKENS}
    tok_config = dict(
        tokenizer_class="PreTrainedTokenizerFast", added_tokens_decoder=added,
        additional_special_tokens=SPECIAL_TOKENS[1:], bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None, model_max_length=131072,
        clean_up_tokenization_spaces=False, split_special_tokens=False, errors="replace",
        chat_template=CHAT_TEMPLATE,
    )
    return {"config.json": config, "generation_config.json": generation,
            "tokenizer_config.json": tok_config}


def make_tiny(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a deterministic tiny checkpoint folder to `out_dir` and return its path."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    for name, d in _configs(PRESETS[preset], ids).items():
        (out / name).write_text(json.dumps(d, indent=2) + "\n")
    save_file(_hf_weights(PRESETS[preset], seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    return out


def default_model_dir() -> Path:
    """`$AGENTSERVE_CACHE/models/tiny-s0` (default ~/.cache/agentserve), built on first use.

    Concurrent first uses are safe: each builds into a private temp folder and renames it
    into place atomically; a loser of the race discards its copy.
    """
    root = Path(os.environ.get("AGENTSERVE_CACHE") or Path.home() / ".cache" / "agentserve")
    final = root / "models" / "tiny-s0"
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-s0.", dir=final.parent))
    tmp.chmod(0o755)
    try:
        make_tiny(tmp, "tiny", 0)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its folder is complete
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
