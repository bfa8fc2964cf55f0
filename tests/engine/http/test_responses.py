"""OpenAI's Responses API (/v1/responses, stateless, as Codex uses it), driven by the
official client against the real server on the tiny model: text, function tools (forced,
so the random-weight model calls one), function call outputs, streaming, JSON output,
caching, errors."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import API_KEY, ServerThread, post, wait_idle

# (the string bounded, so that a random-weight model's call ends within max_output_tokens)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def client(served: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_text_response_usage_and_cache(client: openai.OpenAI, served: ServerThread) -> None:
    """A message item with the text; usage counts the prompt the chat endpoint counts for
    the same conversation, and a repeated one is read from the prefix cache; a response cut
    by max_output_tokens is incomplete."""
    model = served.engine.model_name
    kw = dict(model=model, instructions="You are terse.", input="tell me about the sea " * 8,
              max_output_tokens=5, temperature=0)
    first = client.responses.create(**kw)
    assert first.object == "response" and first.id.startswith("resp_")
    assert [o.type for o in first.output] == ["message"] and first.output_text
    chat = client.chat.completions.create(model=model, max_tokens=1, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "tell me about the sea " * 8}])
    again = client.responses.create(**kw)
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert again.output_text == first.output_text  # greedy
    if first.usage.output_tokens == 5:
        assert first.status == "incomplete"
        assert first.incomplete_details.reason == "max_output_tokens"


def test_function_call_then_its_output(client: openai.OpenAI, served: ServerThread) -> None:
    """tool_choice required: a function_call item whose arguments follow the schema; its
    output goes back as a function_call_output item (stateless: the whole conversation)."""
    model = served.engine.model_name
    kw = dict(model=model, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=200, extra_body={"seed": 0})
    conv: list = [{"role": "user", "content": "weather in Paris?"}]
    r = client.responses.create(input=conv, **kw)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    conv += [o.model_dump(exclude_none=True) for o in r.output]
    conv.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    r2 = client.responses.create(model=model, input=conv, tools=[WEATHER], max_output_tokens=3)
    assert r2.usage.input_tokens > r.usage.input_tokens  # the call and its output are in it
    named = client.responses.create(input=conv[:1], **{
        **kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]


def test_streaming_adds_up_to_the_response(client: openai.OpenAI, served: ServerThread) -> None:
    """The event stream (created, item added, deltas, item done, completed) adds up to the
    same response as the non-streamed one (greedy); a streamed call's arguments arrive in
    argument deltas."""
    model = served.engine.model_name
    kw = dict(model=model, input="hello there, weather in Rome?", max_output_tokens=20,
              temperature=0)
    whole = client.responses.create(**kw)
    # (the SDK's get_final_response wants response.completed; a response cut by
    # max_output_tokens ends with response.incomplete, as OpenAI's does)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [ev.type for ev in events]
    streamed = events[-1].response
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{whole.status}"
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert deltas == streamed.output_text == whole.output_text and streamed.status == whole.status
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    tools = dict(model=model, input="weather in Rome?", tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False, max_output_tokens=200, extra_body={"seed": 3})
    with client.responses.stream(**tools) as stream:
        kinds = [ev.type for ev in stream]
        called = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    [call] = [o for o in called.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0


def test_json_schema_output(client: openai.OpenAI, served: ServerThread) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model=served.engine.model_name, input="a number", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "n",
                                                 "schema": schema}}, extra_body={"seed": 1})
    assert set(json.loads(r.output_text)) == {"n"}


@pytest.mark.parametrize("body,needle,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text parts", "input[0]"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "not stored", "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools", "tools[0]"),
    ({"input": "hi", "max_output_tokens": 0}, ">= 1", "max_output_tokens"),
    ({"input": []}, "must not be empty", "input"),
    ({"input": [{"type": "function_call_output"}]}, "needs call_id", "input[0]"),
])
def test_bad_requests(served: ServerThread, body, needle, param) -> None:
    status, err = post(served, "/v1/responses", body)
    assert status == 400 and needle in err["error"]["message"] and err["error"]["param"] == param
