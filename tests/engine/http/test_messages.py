"""Anthropic's Messages API (/v1/messages), driven by the official `anthropic` client against
the real server on the tiny model: text, tools (forced, so the random-weight model calls
one), tool results, stop sequences, streaming, token counting, caching, errors."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.conftest import API_KEY, ServerThread, post, wait_idle

# (the string bounded, so that a random-weight model's call ends within max_tokens)
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def client(served: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=60)


def _model(served: ServerThread) -> str:
    return served.engine.model_name


def _prompt(usage: anthropic.types.Usage) -> int:
    """The whole prompt: Anthropic's input_tokens leaves out what was read or written."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_text_message_and_cached_context(client: anthropic.Anthropic, served: ServerThread) -> None:
    """A text answer with Anthropic's usage: input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens is the prompt the chat endpoint counts for the same
    conversation; the first time its full blocks are written, a repeat reads them."""
    msgs = [{"role": "user", "content": "write a haiku about the sea " * 8}]
    kw = dict(model=_model(served), max_tokens=6, system="You are terse.", messages=msgs,
              extra_body={"temperature": 0})
    first = client.messages.create(**kw)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert [b.type for b in first.content] == ["text"] and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens <= 6
    chat = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
    ref = chat.chat.completions.create(
        model=_model(served), max_tokens=1,
        messages=[{"role": "system", "content": "You are terse."}, *msgs])
    again = client.messages.create(**kw)
    total = _prompt(again.usage)
    assert total == ref.usage.prompt_tokens == _prompt(first.usage)
    assert first.usage.cache_creation_input_tokens > 0
    assert again.usage.cache_read_input_tokens > 0
    assert again.content[0].text == first.content[0].text  # greedy: the same answer
    assert client.messages.count_tokens(model=_model(served), system="You are terse.",
                                        messages=msgs).input_tokens == total


def test_forced_tool_use_then_tool_result(client: anthropic.Anthropic, served: ServerThread) -> None:
    """tool_choice any: a tool_use block whose input follows the schema, stop_reason
    tool_use; the tool's result goes back as a tool_result block and is served."""
    kw = dict(model=_model(served), max_tokens=200, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              extra_body={"seed": 0})  # (greedy, the random weights repeat one token for ever)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    r = client.messages.create(messages=msgs, **kw)
    calls = [b for b in r.content if b.type == "tool_use"]
    assert calls and r.stop_reason == "tool_use", r
    call = calls[0]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    follow = msgs + [{"role": "assistant", "content": r.content},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"},
                         {"type": "text", "text": "thanks"}]}]
    r2 = client.messages.create(messages=follow, model=_model(served), max_tokens=4,
                                tools=[WEATHER])
    assert _prompt(r2.usage) > _prompt(r.usage)  # the result is in the prompt
    named = client.messages.create(messages=msgs, **{
        **kw, "tool_choice": {"type": "tool", "name": "get_weather",
                              "disable_parallel_tool_use": True}})
    assert [b.name for b in named.content if b.type == "tool_use"][:1] == ["get_weather"]


def test_streaming_matches_the_whole_answer(client: anthropic.Anthropic, served: ServerThread) -> None:
    """The event stream (message_start, blocks, message_delta, message_stop) adds up to the
    same message as the non-streamed answer (greedy); a streamed tool call arrives as a
    tool_use block whose input the client assembles from input_json_delta fragments."""
    kw = dict(model=_model(served), max_tokens=30, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "hello there, weather in Rome?"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.output_tokens)
    tools = dict(kw, max_tokens=200, tools=[WEATHER], extra_body={"seed": 3},
                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    with client.messages.stream(**tools) as stream:
        kinds = [ev.type for ev in stream]
        called = stream.get_final_message()
    assert "content_block_delta" in kinds and called.stop_reason == "tool_use"
    [call] = [b for b in called.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city", "unit"}
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0


def test_stop_sequence(client: anthropic.Anthropic, served: ServerThread) -> None:
    kw = dict(model=_model(served), max_tokens=12, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "count: one two three"}])
    text = client.messages.create(**kw).content[0].text
    stop = text[2:5]
    assert len(stop) == 3
    r = client.messages.create(stop_sequences=[stop], **kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    head = text[:text.find(stop)]  # (the stop string may also occur before position 2)
    assert [b.text for b in r.content] == ([head] if head else [])


@pytest.mark.parametrize("body,status,kind,needle", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]},
     400, "invalid_request_error", "image"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, 400,
     "invalid_request_error", "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "server tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "read_file", "description": "no schema"}]}, 400,
     "invalid_request_error", "input_schema"),
    ({"model": "claude-9", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
     404, "not_found_error", "claude-9"),
])
def test_bad_requests_get_anthropic_errors(served: ServerThread, body, status, kind, needle) -> None:
    got, err = post(served, "/v1/messages", body)
    assert got == status and err["type"] == "error", err
    assert err["error"]["type"] == kind and needle in err["error"]["message"], err


def test_api_key_by_x_api_key_header(served: ServerThread) -> None:
    bad = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=_model(served), max_tokens=2,
                            messages=[{"role": "user", "content": "hi"}])


def test_a_final_assistant_message_is_a_prefill(client: anthropic.Anthropic,
                                                served: ServerThread) -> None:
    """As Anthropic's API: the answer continues the final assistant message's text (the
    chat path's continue_final_message) and holds only the continuation."""
    msgs = [{"role": "user", "content": "name a colour"},
            {"role": "assistant", "content": "The colour is"}]
    r = client.messages.create(model=_model(served), max_tokens=5, messages=msgs,
                               extra_body={"temperature": 0})
    chat = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
    ref = chat.chat.completions.create(model=_model(served), messages=msgs, max_tokens=5,
                                       temperature=0, extra_body={
                                           "continue_final_message": True,
                                           "add_generation_prompt": False})
    assert r.content[0].text == ref.choices[0].message.content
    assert _prompt(r.usage) == ref.usage.prompt_tokens


def test_model_aliases_answer_a_harness_model_name() -> None:
    """--served-model-name repeated: every name is served (an agent harness sends its own
    model names, e.g. Claude Code's), /v1/models lists them, the first is reported."""
    from tests.conftest import TEST_DEVICE

    server = ServerThread(served_model_name=["tiny", "claude-sonnet-4-5"], kv_cache_tokens=4096,
                          device=TEST_DEVICE).start()
    try:
        c = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        r = c.messages.create(model="claude-sonnet-4-5", max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
        assert r.model == "tiny"
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in oai.models.list().data] == ["tiny", "claude-sonnet-4-5"]
        with pytest.raises(anthropic.NotFoundError, match="`tiny`, `claude-sonnet-4-5`"):
            c.messages.create(model="claude-opus-9", max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
    finally:
        server.close()
