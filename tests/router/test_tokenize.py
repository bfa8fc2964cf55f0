"""Incremental tokenization equals full tokenization, and tokenizes only the new part."""

import random

import pytest

from agentserve.engine.tiny import default_model_dir
from agentserve.engine.tokenizer import Tokenizer
from agentserve.router.tokenize import IncrementalTokenizer, common_prefix_len


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(default_model_dir())


def test_common_prefix_len():
    a = "x" * 20000 + "abc"
    assert common_prefix_len(a, a + "d") == len(a)
    assert common_prefix_len(a, "x" * 20000 + "abd") == 20002
    assert common_prefix_len("", "a") == 0


def test_self_check_passes_for_byte_level_bpe(tok):
    assert IncrementalTokenizer(tok).incremental


def test_chat_turns_match_full_and_are_incremental(tok):
    it = IncrementalTokenizer(tok)
    rng = random.Random(0)
    words = ["def", "return", "  x", "\n", "é", "😀", "import os", "{", "}", "<|im_end|>", "tool"]
    msgs = [{"role": "system", "content": "You are a coding agent. " * 50}]
    for turn in range(8):
        msgs.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(80))})
        t = it.chat(msgs)
        full = tok.encode(tok.apply_chat_template(msgs))
        assert list(t.ids) == full, turn
        if turn:
            assert t.base is not None and t.shared > len(full) // 2
        msgs.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(30))})
    before = it.tokenized_chars
    msgs.append({"role": "user", "content": "short"})
    it.chat(msgs)
    assert it.tokenized_chars - before < 1000


def test_text_prompt_edits(tok):
    it = IncrementalTokenizer(tok)
    rng = random.Random(1)
    text = "".join(rng.choice("ab cd\nef(){}é😀") for _ in range(3000))
    for _ in range(20):
        i = rng.randrange(len(text))
        text = text[:i] + rng.choice(["x", " ", "\n\n", "é", ""]) + text[i:] + " tail"
        t = it.text(text, add_special_tokens=False, session="s")
        assert list(t.ids) == tok.encode(text)
