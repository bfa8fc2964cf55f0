"""Tool calls on the real SmolLM2-135M-Instruct, whose chat template has no tools: the Hermes
block rendered into the system prompt, required/named calls constrained, a named call cut
by max_tokens still a tool_calls entry (finish_reason "length"). One engine for the module."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import openai
import pytest

from agentserve.cluster.procs import ManagedProcess

from tests.smollm2 import MARKS  # noqa: E402

pytestmark = MARKS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 24}}}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def engine(smollm2_engine: ManagedProcess) -> ManagedProcess:
    return smollm2_engine  # one engine for every SmolLM2 HTTP test (tests/conftest.py)


@pytest.fixture(scope="module")
def client(engine: ManagedProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _post(engine: ManagedProcess, path: str, body: dict) -> dict:
    req = urllib.request.Request(engine.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_prompt_has_tools_block(engine: ManagedProcess) -> None:
    ids = _post(engine, "/tokenize", {"model": "smollm2-135m", "messages": MSGS,
                                      "tools": [WEATHER]})["tokens"]
    text = _post(engine, "/detokenize", {"model": "smollm2-135m", "tokens": ids})["prompt"]
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text


def test_auto(client: openai.OpenAI) -> None:
    # what the 135M model does is its own choice: only the shape is asserted
    r = client.chat.completions.create(model="smollm2-135m", messages=MSGS, tools=[WEATHER],
                                       max_tokens=40, temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        assert all(t.function.name == "get_weather" for t in c.message.tool_calls)
    assert "<tool_call>" not in (c.message.content or "") or not c.message.tool_calls


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_required_and_named(client: openai.OpenAI, choice) -> None:
    r = client.chat.completions.create(model="smollm2-135m", messages=MSGS, tools=[WEATHER],
                                       tool_choice=choice, parallel_tool_calls=False,
                                       max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_named_cut_by_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2-135m", messages=MSGS, tools=[WEATHER],
                                       tool_choice=NAMED, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    assert "<tool_call>" not in (c.message.content or "")


def test_messages(engine: ManagedProcess) -> None:
    a = anthropic.Anthropic(base_url=engine.url, api_key="x", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    for n, reason in ((60, "tool_use"), (12, "max_tokens")):
        m = a.messages.create(model="smollm2-135m", max_tokens=n, messages=MSGS, tools=[tool],
                              tool_choice={"type": "tool", "name": "get_weather"},
                              extra_body={"temperature": 0})
        assert m.stop_reason == reason
        assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_weather")]
        assert isinstance(m.content[0].input, dict)
        if reason == "tool_use":
            assert isinstance(m.content[0].input["city"], str)
