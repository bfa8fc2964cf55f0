"""Our engine scores a prompt as a real vLLM does: prompt_logprobs, echo with logprobs and
echo of the prompt alone, on the same tiny checkpoint (fp32 on both), through the official
client. The same token ids, ranks and top tokens, the same logprobs to within float
rounding, the same response shapes."""

from __future__ import annotations

import random

import openai
import pytest

from agentserve.cluster.procs import start_engine, start_vllm

pytestmark = pytest.mark.interop

ABS = 2e-4  # two fp32 implementations of the same model: rounding, not a different model


def _scored(client: openai.OpenAI, prompt: list[int]) -> dict:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                  echo=True, logprobs=2, extra_body={"prompt_logprobs": 3})
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=1,
        extra_body={"prompt_logprobs": 1})
    return {"scored": r.choices[0], "only": only.choices[0], "only_usage": only.usage,
            "chat": chat.model_extra["prompt_logprobs"]}


def _same_token(ours: str, theirs: str) -> bool:
    """Token texts agree; where a token is a piece of a character, ours shows U+FFFD (as
    the tokenizers library decodes it) and vLLM an empty string: the one known difference."""
    return ours == theirs or (theirs == "" and set(ours) == {"\ufffd"})


def _same_entries(ours: list, theirs: list) -> None:
    """prompt_logprobs lists: None at 0, then the same keys (token ids) with the same ranks,
    in the same order, and the same logprobs."""
    assert len(ours) == len(theirs) and ours[0] is None and theirs[0] is None
    for a, b in zip(ours[1:], theirs[1:]):
        assert list(a) == list(b)
        for k in a:
            assert a[k]["rank"] == b[k]["rank"]
            assert a[k]["logprob"] == pytest.approx(b[k]["logprob"], abs=ABS)


def test_prompt_logprobs_and_echo_match_vllm(vllm_available, tiny_model_dir, tmp_path) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(16, 4000) for _ in range(40)]
    vllm = start_vllm(tiny_model_dir, tmp_path)
    ours = start_engine(tmp_path, extra=["--model", str(tiny_model_dir), "--served-model-name",
                                         "tiny", "--block-size", "32"])
    got = {}
    try:
        ours.wait_healthy(120)
        vllm.wait_healthy(300)
        for name, proc in (("vllm", vllm), ("ours", ours)):
            client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0,
                                   timeout=120)
            got[name] = _scored(client, prompt)
    finally:
        vllm.stop()
        ours.stop()
    a, b = got["ours"], got["vllm"]
    _same_entries(a["scored"].model_extra["prompt_logprobs"],
                  b["scored"].model_extra["prompt_logprobs"])
    _same_entries(a["chat"], b["chat"])
    for x, y in ((a["scored"], b["scored"]), (a["only"], b["only"])):
        assert x.text == y.text and x.finish_reason == y.finish_reason
        lx, ly = x.logprobs, y.logprobs
        assert len(lx.tokens) == len(ly.tokens)
        assert all(_same_token(p, q) for p, q in zip(lx.tokens, ly.tokens))
        assert lx.text_offset == [sum(map(len, lx.tokens[:i])) for i in range(len(lx.tokens))]
        assert lx.token_logprobs[0] is None and ly.token_logprobs[0] is None
        assert lx.token_logprobs[1:] == pytest.approx(ly.token_logprobs[1:], abs=ABS)
        assert lx.top_logprobs[0] is None and ly.top_logprobs[0] is None
        compared = 0
        for tx, ty in zip(lx.top_logprobs[1:], ly.top_logprobs[1:]):
            if "" in ty:  # (two pieces of characters share vLLM's key "": the last one wins)
                continue
            assert tx == pytest.approx(ty, abs=ABS)
            compared += 1
        assert compared >= len(lx.top_logprobs) // 2  # (29 of 41 for this prompt)
    assert a["only_usage"].completion_tokens == b["only_usage"].completion_tokens
