"""A constrained tool call ("required" / named) cut short by max_tokens: a tool_calls entry
with the partial arguments and finish_reason "length" (as vLLM), never <tool_call> markup in
the content; the same on /v1/messages (tool_use, stop_reason max_tokens) and /v1/responses."""

from __future__ import annotations


import anthropic
import openai
import pytest

from tests.conftest import API_KEY, ServerThread, post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MSGS = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("choice", [NAMED, "required"])
@pytest.mark.parametrize("max_tokens", [1, 12])
def test_cut_call_chat(client: openai.OpenAI, served: ServerThread, choice, max_tokens) -> None:
    kw = dict(model=served.engine.model_name, messages=MSGS, tools=[WEATHER], tool_choice=choice,
              max_tokens=max_tokens, seed=0)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert "<tool_call>" not in (c.message.content or "")
    calls = c.message.tool_calls or []
    if choice == NAMED:  # the name is known: always one call, as vLLM
        assert [t.function.name for t in calls] == ["get_weather"]
    for t in calls:
        assert t.function.name == "get_weather"
        assert t.function.arguments == "" or t.function.arguments.startswith("{")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert "<tool_call>" not in text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [d.function.name for d in deltas if d.id] == [t.function.name for t in calls]
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert streamed == "".join(t.function.arguments for t in calls)


def test_cut_call_messages_and_responses(served: ServerThread) -> None:
    a = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=60)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    for n in (1, 12):
        m = a.messages.create(model=served.engine.model_name, max_tokens=n, messages=MSGS,
                              tools=[tool], tool_choice={"type": "tool", "name": "get_weather"})
        assert m.stop_reason == "max_tokens"
        assert [b.type for b in m.content] == ["tool_use"]
        assert m.content[0].name == "get_weather" and isinstance(m.content[0].input, dict)
        status, body = post(served, "/v1/responses", {
            "model": served.engine.model_name, "input": "weather in Paris?", "max_output_tokens": n,
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"}})
        assert status == 200, body
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert [(o["type"], o["name"]) for o in body["output"]] == [("function_call", "get_weather")]
