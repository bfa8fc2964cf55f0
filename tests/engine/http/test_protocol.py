"""Request decoding, validation, prompt building and metrics rendering (no engine)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agentserve.engine.http.metrics import RequestTimer, ServerMetrics
from agentserve.api.openai import (APIError, ChatRequest, CompletionRequest, NamedToolChoice,
                                        check_chat, check_completion, check_length, decode)
from agentserve.engine.http.serving import resolve_max_tokens, sampling_params
from agentserve.engine.http.completions import completion_prompts
from agentserve.prompt.chat import chat_messages


def bad(fn, *args) -> APIError:
    with pytest.raises(APIError) as exc:
        fn(*args)
    return exc.value


def test_decode_completion_shapes() -> None:
    req = decode(b'{"prompt": [1, 2], "stop": "x", "temperature": 0, "extra": {"a": 1}}',
                 CompletionRequest)
    assert req.prompt == [1, 2] and req.stop == "x" and req.temperature == 0.0
    req = decode(b'{"prompt": "p", "stop": ["a", "b"], "stream_options": {"include_usage": true}}',
                 CompletionRequest)
    assert req.stream_options.include_usage and req.max_tokens is None


def test_decode_errors_name_the_field() -> None:
    e = bad(decode, b'{"prompt": "p", "top_p": "high"}', CompletionRequest)
    assert e.status == 400 and e.param == "top_p" and "Expected" in e.message
    e = bad(decode, b'{"messages": [{"role": "user", "content": 3}]}', ChatRequest)
    assert e.param == "messages[0].content"
    e = bad(decode, b"{not json", ChatRequest)
    assert "not valid JSON" in e.message and e.body()["error"]["type"] == "invalid_request_error"
    assert bad(decode, b'{"prompt": "p", "ignore_eos": 1}', CompletionRequest).param == "ignore_eos"


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "p", "n": 0}', "n"),
    (b'{"prompt": "p", "n": 129}', "n"),
    (b'{"prompt": "p", "temperature": -1}', "temperature"),
    (b'{"prompt": "p", "top_p": 0}', "top_p"),
    (b'{"prompt": "p", "top_p": 1.01}', "top_p"),
    (b'{"prompt": "p", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "p", "logprobs": -1}', "logprobs"),
    (b'{"prompt": "p", "prompt_logprobs": -1}', "prompt_logprobs"),
    (b'{"prompt": "p", "prompt_logprobs": 21}', "prompt_logprobs"),
    (b'{"prompt": "p", "prompt_logprobs": 0, "stream": true}', "prompt_logprobs"),
    (b'{"prompt": "p", "echo": true, "logprobs": 1, "kv_transfer_params": {}}', None),
    (b'{"prompt": "p", "echo": true, "logprobs": 1, "kv_transfer_params": {"a": 1}}',
     "kv_transfer_params"),
    (b'{"prompt": "p", "max_tokens": -1, "echo": true}', "max_tokens"),
    (b'{"prompt": "p", "logprobs": 21}', "logprobs"),
])
def test_completion_range_checks(body: bytes, param: str | None) -> None:
    if param is None:  # (an empty kv_transfer_params is no P/D leg)
        check_completion(decode(body, CompletionRequest))
        return
    assert bad(check_completion, decode(body, CompletionRequest)).param == param


def test_ranges_that_are_fine() -> None:
    for body in (b'{"prompt": "p", "top_p": 1, "temperature": 0, "top_k": -1, "max_tokens": 1}',
                 b'{"prompt": "p", "temperature": 2.5, "top_k": 40, "seed": 7, "user": "u"}',
                 b'{"prompt": "p", "echo": true, "max_tokens": 0, "logprobs": 0}',
                 b'{"prompt": "p", "prompt_logprobs": 20, "echo": true, "stream": false}'):
        check_completion(decode(body, CompletionRequest))


def test_chat_checks() -> None:
    ok = b'{"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]'
    check_chat(decode(ok + b"}", ChatRequest))
    tools = b', "tools": [{"type": "function", "function": {"name": "f"}}]'
    req = decode(ok + tools + b', "tool_choice": {"type": "function", "function": {"name": "f"}}}',
                 ChatRequest)
    assert isinstance(req.tool_choice, NamedToolChoice)
    check_chat(req)
    assert bad(check_chat, decode(ok + tools + b', "tool_choice": "maybe"}', ChatRequest)).param \
        == "tool_choice"
    assert bad(check_chat, decode(b'{"messages": []}', ChatRequest)).param == "messages"


def test_check_length_messages() -> None:
    e = bad(check_length, 50, None, 40)
    assert "40 tokens" in e.message and "50 tokens" in e.message
    e = bad(check_length, 30, 20, 40)
    assert "50 tokens (30 in the prompt, 20 for the completion)" in e.message
    assert e.code == "context_length_exceeded"
    assert check_length(30, None, 40) == 10
    assert resolve_max_tokens(30, None, 16, 40) == 10  # a default is clamped, not refused
    assert resolve_max_tokens(10, None, 16, 40) == 16


def test_completion_prompts(tokenizer) -> None:
    ids = tokenizer.encode("hello world")
    assert completion_prompts("hello world", tokenizer) == [ids]
    assert completion_prompts(ids, tokenizer) == [ids]
    assert completion_prompts(["hello world", [5, 6]], tokenizer) == [ids, [5, 6]]
    for prompt in ("", [], [[]], [1, "a"], [True], [[1], "x", 3]):
        assert bad(completion_prompts, prompt, tokenizer).param == "prompt"


def test_chat_messages_for_template() -> None:
    req = decode(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                 b'{"type": "text", "text": "b"}]}, {"role": "assistant", '
                 b'"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\\"x\\": 1}"}}]}]}',
                 ChatRequest)
    user, assistant = chat_messages(req.messages)
    assert user == {"role": "user", "content": "a\nb"}
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}


def test_sampling_params_defaults(tiny_tokenizer) -> None:
    p = sampling_params(decode(b'{"prompt": "p", "top_k": -1, "stop_token_ids": [3]}',
                               CompletionRequest), 7, tiny_tokenizer)
    got = (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop_token_ids)
    assert got == (7, 1.0, 1.0, 0, [3])
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0, 0, 1, 0)
    assert p.logit_bias is None and p.min_tokens == 0 and not p.penalized


def test_min_tokens_blocks_eos_and_stop_ids(tiny_tokenizer) -> None:
    p = sampling_params(decode(b'{"prompt": "p", "min_tokens": 2, "stop_token_ids": [3],'
                               b' "logit_bias": {"7": -5}}', CompletionRequest), 7, tiny_tokenizer)
    assert p.min_tokens_blocked == sorted({3, *tiny_tokenizer.eos_token_ids})
    assert p.logit_bias == {7: -5.0}


@dataclass
class FakeStats:
    num_running: int = 2
    num_waiting: int = 1
    kv_usage: float = 0.25
    prefix_queries_tokens: int = 100
    prefix_hits_tokens: int = 60
    num_preemptions: int = 0
    prompt_tokens: int = 100
    generation_tokens: int = 9


class FakeEngine:
    model_name, block_size, num_gpu_blocks = "m", 16, 64

    def stats(self) -> FakeStats:
        return FakeStats()


def test_metrics_private_registry_and_names() -> None:
    m1, m2 = ServerMetrics(FakeEngine()), ServerMetrics(FakeEngine())  # no duplicate errors
    timer = RequestTimer(m1, arrival=0.0)
    timer.on_tokens(0.5)
    timer.on_tokens(0.52)
    timer.on_finish(1.0)
    text = m1.render()[0].decode()
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 60.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 0.0' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'vllm:inter_token_latency_seconds_bucket{le="0.025",model_name="m"} 1.0' in text
    assert 'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="64"} 1.0' in text
    assert "time_to_first_token_seconds_count" in m2.render()[0].decode()


def test_text_prompts_get_the_tokenizers_special_tokens_as_the_router_adds_them(
        tok_dir, tmp_path) -> None:
    """A tokenizer whose post-processor adds a BOS (Llama's): a completion's text prompt
    gets it unless add_special_tokens is false (vLLM's default), and the router tokenizes
    the same prompt to the same ids (its prefix index must see the engine's blocks); token
    ids are taken as sent."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from agentserve.prompt.tokenizer import Tokenizer
    from agentserve.prompt.incremental import IncrementalTokenizer

    d = tmp_path / "bos"
    shutil.copytree(tok_dir, d)
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    bos = hf.token_to_id("<|im_start|>")
    hf.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                           special_tokens=[("<|im_start|>", bos)])
    hf.save(str(d / "tokenizer.json"))
    tok = Tokenizer.from_dir(d)
    plain = tok.encode("hello world")
    assert completion_prompts("hello world", tok) == [[bos, *plain]]
    assert completion_prompts("hello world", tok, add_special_tokens=False) == [plain]
    assert completion_prompts([5, 6], tok) == [[5, 6]]
    assert IncrementalTokenizer(tok).text("hello world").ids == [bos, *plain]
    req = decode(b'{"prompt": "p", "add_special_tokens": false}', CompletionRequest)
    assert req.add_special_tokens is False
