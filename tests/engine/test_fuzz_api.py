"""Property: whatever JSON a client sends to an endpoint, the answer is a 200 or a 4xx with a
well-formed error object, never a 500 or a hang, and the engine keeps no blocks after.

Bodies start from a valid one and have random fields set to random JSON values (the
endpoint's own field names, so the values reach the checks behind them)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.engine.protocol import ChatRequest, CompletionRequest
from agentserve.engine.messages_protocol import MessagesRequest
from agentserve.engine.responses_protocol import ResponsesRequest
from tests.conftest import API_KEY, ServerThread, wait_idle

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.integers(-2**70, 2**70),
                     st.floats(-5, 5), st.text(max_size=6))
_json = st.recursive(_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)),
    max_leaves=10)

MSG = {"role": "user", "content": "hi"}
ENDPOINTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": ({"prompt": "hello", "max_tokens": 3},
                        [f.name for f in msgspec.structs.fields(CompletionRequest)]),
    "/v1/chat/completions": ({"messages": [MSG], "max_tokens": 3},
                             [f.name for f in msgspec.structs.fields(ChatRequest)]),
    "/v1/messages": ({"messages": [MSG], "max_tokens": 3},
                     [f.name for f in msgspec.structs.fields(MessagesRequest)]),
    "/v1/responses": ({"input": "hi", "max_output_tokens": 3},
                      [f.name for f in msgspec.structs.fields(ResponsesRequest)]),
    "/tokenize": ({"prompt": "hello"}, ["prompt", "messages", "tools", "add_special_tokens",
                                        "add_generation_prompt", "return_token_strs"]),
}
# values that would only make a request long, not wrong: kept small
_SMALL = {"max_tokens": st.integers(-1, 6), "max_completion_tokens": st.integers(-1, 6),
          "max_output_tokens": st.integers(-1, 6),
          "n": st.integers(-1, 3), "min_tokens": st.integers(-1, 4)}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}}}
_ATOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"enum": [1, 2]}},
                                        "required": ["a"]}}
_txt = st.text(max_size=6)
_chat_msg = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bot"]),
     "content": st.one_of(st.none(), _txt, st.lists(st.sampled_from(
         [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]),
         max_size=2))},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"id": _txt, "function": st.fixed_dictionaries(
        {"name": _txt, "arguments": st.one_of(_txt, st.just("{}"), st.just({"a": 1}))})}), max_size=2),
        "tool_call_id": _txt})
_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _txt}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": _txt, "name": _txt,
                           "input": st.one_of(st.none(), _txt, st.just({"a": 2}))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": _txt, "content": st.one_of(
        _txt, st.just([{"type": "text", "text": "r"}]), st.just([{"type": "image"}]))}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document"])}))
_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "tool"]),
                           "content": st.one_of(_txt, st.lists(st.fixed_dictionaries({
                               "type": st.sampled_from(["input_text", "output_text",
                                                        "input_image"]), "text": _txt}),
                               max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": _txt, "name": _txt, "arguments": st.one_of(_txt, st.just('{"a": 1}'))}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "reasoning", "x"])},
                          optional={"call_id": _txt, "output": _txt}))
_anthropic_msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                        "content": st.one_of(_txt, st.lists(_block, max_size=3))})
# well-typed values around the edges of each field's range, so that combinations of valid
# fields (echo + stream + logprobs + n, a grammar + penalties, ...) reach the engine
_PLAUSIBLE = {
    "temperature": st.floats(-0.5, 3), "top_p": st.floats(-0.2, 1.2), "top_k": st.integers(-2, 60),
    "min_p": st.floats(-0.1, 1.1), "seed": st.integers(-2**64, 2**64), "stream": st.booleans(),
    "echo": st.booleans(), "logprobs": st.one_of(st.booleans(), st.integers(-1, 21)),
    "top_logprobs": st.integers(-1, 21), "prompt_logprobs": st.integers(-1, 21),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-0.5, 2.5), "ignore_eos": st.booleans(),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_sequences": st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(-1, 5000), max_size=3),
    "logit_bias": st.dictionaries(st.integers(-2, 5000).map(str), st.floats(-120, 120), max_size=3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"schema": {
                                            "type": "object"}}}, {"type": "nope"}]),
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "return_token_ids": st.booleans(), "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "tools": st.sampled_from([[_TOOL], [], [_ATOOL]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "any"},
                                    {"type": "tool", "name": "f"}, {"type": "function",
                                                                     "function": {"name": "f"}}]),
    "prompt": st.one_of(st.text(max_size=8), st.lists(st.integers(-1, 5000), max_size=6)),
    "messages": st.lists(st.one_of(_chat_msg, _anthropic_msg), max_size=4),
    "system": st.one_of(_txt, st.lists(_block, max_size=2)),
    "input": st.one_of(_txt, st.lists(_item, max_size=4)), "instructions": _txt,
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "object"}}}, {"format": {}}]),
    "previous_response_id": st.one_of(st.none(), _txt), "prompt_cache_key": _txt,
    "kv_transfer_params": st.sampled_from([None, {}, {"do_remote_decode": True}]),
}


def _send(served: ServerThread, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(served.url + path, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@st.composite
def _bodies(draw: st.DrawFn, path: str) -> dict[str, Any]:
    base, fields = ENDPOINTS[path]
    body = dict(base)
    if draw(st.integers(0, 4)):  # mostly the fields that take values, not the structure
        fields = [f for f in fields if f in _PLAUSIBLE or f in _SMALL]
    for name in draw(st.lists(st.sampled_from(fields), max_size=5, unique=True)):
        typed = name in _SMALL or (name in _PLAUSIBLE and draw(st.integers(0, 9)) < 8)
        strategy = _SMALL[name] if name in _SMALL else _PLAUSIBLE[name] if typed else _json
        body[name] = draw(strategy)
    return body


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_any_body_gets_an_answer_or_a_4xx(served: ServerThread, path: str) -> None:
    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_bodies(path))
    def check(body: dict[str, Any]) -> None:
        status, raw = _send(served, path, body)
        assert status == 200 or 400 <= status < 500, (status, body, raw[:400])
        if status != 200:
            err = json.loads(raw)
            detail = err["error"]
            assert isinstance(detail["message"], str) and detail["message"], err
            if path == "/v1/messages":
                assert err["type"] == "error"

    check()
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0
