"""The tokenizer a GGUF's metadata stands for (prompt/gguf_vocab.py), and HF folders whose
chat template is in chat_template.jinja."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from agentserve.prompt import gguf_vocab
from agentserve.prompt.tokenizer import Tokenizer


class _Field:  # GGUFReader's ReaderField, as far as gguf_vocab reads it
    def __init__(self, value: Any) -> None:
        self.value = value

    def contents(self) -> Any:
        return self.value


def fields_of(tok_dir: Path, **over: Any) -> dict[str, _Field]:
    """The tokenizer.ggml.* metadata llama.cpp's converter writes for `tok_dir`."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tj["added_tokens"] if t["special"]}
    d: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(vocab))],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m
                                  for m in tj["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": vocab.index("<|im_end|>"),
        "tokenizer.chat_template": "{{ messages[0]['content'] }}"}
    d.update(over)
    return {k: _Field(v) for k, v in d.items() if v is not None}


TEXTS = ["hello world, the quick brown fox", "héllo naïve café 日本語 🙂🚀",
         "<|im_start|>user\nstop STOP<|im_end|>", "a  b\n\n c\t 12345"]


def test_rebuilt_tokenizer_encodes_as_tokenizer_json(tok_dir, tokenizer) -> None:
    got = Tokenizer(gguf_vocab.build_tokenizer(fields_of(tok_dir)),
                    gguf_vocab.tokenizer_config(fields_of(tok_dir)))
    for text in TEXTS:
        assert got.encode(text) == tokenizer.encode(text), text
        assert got.decode(got.encode(text), skip_special_tokens=False) == text
    assert got.special_ids == tokenizer.special_ids
    assert got.eos_token_ids == [tokenizer.token_id("<|im_end|>")]
    assert got.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_smollm_pre_tokenizer_splits_digits(tok_dir) -> None:
    gpt2 = gguf_vocab.build_tokenizer(fields_of(tok_dir))
    smollm = gguf_vocab.build_tokenizer(fields_of(tok_dir, **{"tokenizer.ggml.pre": "smollm"}))
    pieces = smollm.pre_tokenizer.pre_tokenize_str("abc 2024")
    assert [p for p, _ in pieces] == ["abc", "Ġ", "2", "0", "2", "4"]
    assert [p for p, _ in gpt2.pre_tokenizer.pre_tokenize_str("abc 2024")] == ["abc", "Ġ2024"]


@pytest.mark.parametrize("key,value,match", [
    ("tokenizer.ggml.pre", "deepseek-llm", "pre-tokenizer 'deepseek-llm'"),
    ("tokenizer.ggml.model", "llama", "tokenizer model 'llama'"),
])
def test_unsupported_vocab_is_named(tok_dir, key, value, match) -> None:
    with pytest.raises(gguf_vocab.GGUFVocabError, match=match):
        gguf_vocab.build_tokenizer(fields_of(tok_dir, **{key: value}))


def test_chat_template_jinja_file(tok_dir, tmp_path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tok_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").write_text("[{{ messages[-1]['content'] }}]")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    config["chat_template"] = "old"  # the file wins over tokenizer_config.json, as in HF
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(d).chat_template == "[{{ messages[-1]['content'] }}]"
