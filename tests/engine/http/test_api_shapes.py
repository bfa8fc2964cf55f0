"""The agent APIs' shapes as the real APIs define them, checked by validating the raw answers
and events with the official SDKs' pydantic types (strictly, not the SDKs' lenient
construct) on the tiny model: Anthropic ids (``msg_``, ``toolu_``), its usage (input +
cache read + cache creation = the prompt) in the message and in both stream events; the
Responses API's integer times and cache counts; a forced tool choice (any / tool) that never
yields a text block and whose tool_use input has every required field unless max_tokens cut
it (random weights push on the grammar hard: several seeds and prompts, streamed and not)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import anthropic
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from tests.conftest import API_KEY, ServerThread, post

STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
RESPONSE_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
# required fields, an optional one and a nested object with its own required field; strings
# bounded so that a random-weight model's call can end within max_tokens
TOOLS = [
    {"name": "get_weather", "input_schema": {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    {"name": "search", "input_schema": {
        "type": "object", "required": ["q", "opts"],
        "properties": {"q": {"type": "string", "maxLength": 6},
                       "opts": {"type": "object", "required": ["n"], "additionalProperties": False,
                                "properties": {"n": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}}}}}},
]


def _sse(served: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data objects of a streamed answer, in order (``event:`` names checked against
    each object's type)."""
    req = urllib.request.Request(served.url + path, data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {API_KEY}"})
    out, name = [], None
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                assert name == data["type"], (name, data)
                out.append(data)
    return out


def _assembled(events: list[dict[str, Any]]) -> Message:
    """The message a stream adds up to (a tool_use input: its input_json_delta fragments)."""
    msg = next(e for e in events if e["type"] == "message_start")["message"]
    blocks, args = msg["content"], {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            args[e["index"]] = args.get(e["index"], "") + e["delta"]["partial_json"]
        elif e["type"] == "message_delta":
            msg.update(e["delta"], usage=e["usage"])
    stop = msg["stop_reason"]
    for i, b in enumerate(blocks):
        if b["type"] == "tool_use" and i in args:
            try:
                b["input"] = json.loads(args[i])
            except ValueError:  # (cut short: only max_tokens may do that)
                assert stop == "max_tokens", (stop, args[i])
    return Message.model_validate(msg)


def _prompt(usage: dict[str, int]) -> int:
    return (usage["input_tokens"] + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"])


def _full_blocks(served: ServerThread, n: int) -> int:
    bs = served.engine.block_size
    return n // bs * bs


def test_message_ids_and_usage(served: ServerThread) -> None:
    """msg_ id; a fresh prompt writes its full blocks (cache_creation_input_tokens) and a
    repeat reads them; the three input counts add up to the chat endpoint's prompt tokens,
    with cache_control blocks in the request (accepted; the cache is automatic)."""
    system = [{"type": "text", "text": "You review pull requests for a shapes test. " * 6,
               "cache_control": {"type": "ephemeral"}}]
    body = {"model": served.engine.model_name, "max_tokens": 3, "temperature": 0,
            "system": system, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "check the id format", "cache_control":
                 {"type": "ephemeral"}}]}]}
    status, first = post(served, "/v1/messages", body)
    assert status == 200, first
    m = Message.model_validate(first)
    assert m.id.startswith("msg_") and "-" not in m.id[:4]
    ref = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0
                        ).chat.completions.create(
        model=served.engine.model_name, max_tokens=1, messages=[
            {"role": "system", "content": system[0]["text"]},
            {"role": "user", "content": "check the id format"}])
    n = ref.usage.prompt_tokens
    u = first["usage"]
    assert _prompt(u) == n
    assert u["cache_creation_input_tokens"] == _full_blocks(served, n) - u["cache_read_input_tokens"]
    assert u["cache_creation_input_tokens"] > 0 and u["input_tokens"] == n - _full_blocks(served, n)
    _, again = post(served, "/v1/messages", body)
    v = again["usage"]
    assert _prompt(v) == n and v["cache_read_input_tokens"] >= _full_blocks(served, n - 1)
    assert v["cache_creation_input_tokens"] == _full_blocks(served, n) - v["cache_read_input_tokens"]


def test_stream_usage_in_message_start_and_delta(served: ServerThread) -> None:
    """Every event validates as the SDK's RawMessageStreamEvent; message_start and
    message_delta both carry input_tokens, cache_read_input_tokens and
    cache_creation_input_tokens (the delta's output_tokens final), equal to the non-streamed
    answer's usage in the same cache state; the SDK's stream helper assembles that usage."""
    body = {"model": served.engine.model_name, "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "stream usage please " * 5}]}
    post(served, "/v1/messages", body)  # warm: the next ones read the same blocks
    events = _sse(served, "/v1/messages", {**body, "stream": True})
    for ev in events:
        STREAM_EVENT.validate_python(ev)
    start = next(e for e in events if e["type"] == "message_start")["message"]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert start["id"].startswith("msg_")
    _, whole = post(served, "/v1/messages", body)
    keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert {k: start["usage"][k] for k in keys} == {k: whole["usage"][k] for k in keys}
    assert delta["usage"] == whole["usage"]
    client = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=60)
    with client.messages.stream(**{k: v for k, v in body.items() if k != "temperature"},
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.usage.model_dump(include=set(whole["usage"])) == whole["usage"]


def test_tool_use_ids_round_trip(served: ServerThread) -> None:
    """A tool_use block's id is toolu_..., streamed or not, and the SDK sends it back in a
    tool_result that the next turn serves."""
    client = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=60)
    kw = dict(model=served.engine.model_name, max_tokens=80, tools=TOOLS[:1],
              tool_choice={"type": "tool", "name": "get_weather"})
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    m = client.messages.create(messages=msgs, **kw)
    with client.messages.stream(messages=msgs, **kw) as stream:
        streamed = stream.get_final_message()
    for answer in (m, streamed):
        uses = [b for b in answer.content if b.type == "tool_use"]
        assert uses and all(b.id.startswith("toolu_") for b in uses), answer
    use = next(b for b in m.content if b.type == "tool_use")
    follow = msgs + [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}]
    r = client.messages.create(model=served.engine.model_name, max_tokens=3, messages=follow,
                               tools=TOOLS[:1])
    assert r.id.startswith("msg_") and r.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_choice_never_text_and_required_fields(served: ServerThread,
                                                           stream: bool) -> None:
    """tool_choice any (parallel calls allowed) and tool, over prompts (sampled: the
    Messages API has no seed), a stop sequence in some: only tool_use blocks; each input has
    its tool's required fields (nested too) unless stop_reason is max_tokens."""
    required = {t["name"]: set(t["input_schema"]["required"]) for t in TOOLS}
    finished = 0
    for seed in range(4):
        for choice in ({"type": "any"}, {"type": "tool", "name": "search"}):
            body = {"model": served.engine.model_name, "max_tokens": 90, "tools": TOOLS,
                    "tool_choice": choice,
                    "messages": [{"role": "user", "content": f"case {seed}: look it up"}]}
            if seed % 2:
                body["stop_sequences"] = ['"', "}"]  # would cut every call's input
            if stream:
                events = _sse(served, "/v1/messages", {**body, "stream": True})
                for ev in events:
                    STREAM_EVENT.validate_python(ev)
                starts = [e["content_block"] for e in events
                          if e["type"] == "content_block_start"]
                assert starts and all(b["type"] == "tool_use" for b in starts), starts
                assert not [e for e in events if e["type"] == "content_block_delta"
                            and e["delta"]["type"] != "input_json_delta"]
                m = _assembled(events)
                if seed == 0:  # the SDK's stream helper assembles the same kinds of blocks
                    client = anthropic.Anthropic(base_url=served.url, api_key=API_KEY,
                                                 max_retries=0, timeout=60)
                    with client.messages.stream(**body) as s:
                        assert {b.type for b in s.get_final_message().content} == {"tool_use"}
            else:
                status, raw = post(served, "/v1/messages", body)
                assert status == 200, raw
                m = Message.model_validate(raw)
            kinds = [b.type for b in m.content]
            assert kinds and set(kinds) == {"tool_use"}, (seed, choice, m)
            if choice["type"] == "tool":
                assert {b.name for b in m.content} == {"search"}
            if m.stop_reason == "max_tokens":
                continue
            assert m.stop_reason == "tool_use", m
            finished += 1
            for b in m.content:
                assert required[b.name] <= set(b.input), (seed, choice, b)
                if b.name == "search":
                    assert "n" in b.input["opts"], b
    assert finished >= 2  # (otherwise the required-field check checked nothing)


def test_response_shapes(served: ServerThread) -> None:
    """Responses: resp_ id, created_at and completed_at integers, the object validates as
    the SDK's Response; usage counts the whole prompt in input_tokens, of which
    cached_tokens were read and cache_write_tokens written (full blocks); streamed events
    validate as ResponseStreamEvent and end with the same usage shape."""
    body = {"model": served.engine.model_name, "input": "responses shape check " * 4,
            "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0}
    status, raw = post(served, "/v1/responses", body)
    assert status == 200, raw
    r = Response.model_validate(raw)
    assert r.id.startswith("resp_") and type(raw["created_at"]) is int
    if r.status == "completed":
        assert type(raw["completed_at"]) is int and raw["completed_at"] >= raw["created_at"]
    else:
        assert r.status == "incomplete" and raw["completed_at"] is None
    n = raw["usage"]["input_tokens"]
    d = raw["usage"]["input_tokens_details"]
    assert d["cache_write_tokens"] == _full_blocks(served, n) - d["cached_tokens"] > 0
    assert raw["text"] == {"format": {"type": "text"}} and raw["store"] is False
    _, again = post(served, "/v1/responses", body)
    d2 = again["usage"]["input_tokens_details"]
    assert again["usage"]["input_tokens"] == n and d2["cached_tokens"] >= _full_blocks(served, n - 1)
    assert d2["cache_write_tokens"] == _full_blocks(served, n) - d2["cached_tokens"]
    events = _sse(served, "/v1/responses", {**body, "stream": True})
    for ev in events:
        RESPONSE_EVENT.validate_python(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]["response"]
    assert type(last["created_at"]) is int and last["usage"] == again["usage"]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
    sdk = client.responses.create(**body)
    assert sdk.usage.input_tokens_details.cache_write_tokens == d2["cache_write_tokens"]


def test_required_tool_choice_streams_no_content(served: ServerThread) -> None:
    """Chat and Responses with tool_choice required and parallel calls: no content between
    or around the calls, streamed or not (the grammar's newlines between calls are not text)."""
    fn = {"name": TOOLS[0]["name"], "parameters": TOOLS[0]["input_schema"]}
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for seed in range(2):
        kw = dict(model=served.engine.model_name, max_tokens=60, seed=seed, temperature=1.0,
                  tools=[{"type": "function", "function": fn}], tool_choice="required",
                  messages=[{"role": "user", "content": f"weather {seed}"}])
        whole = client.chat.completions.create(**kw).choices[0].message
        assert whole.content is None and whole.tool_calls
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        events = _sse(served, "/v1/responses", {
            "model": served.engine.model_name, "input": f"weather {seed}", "stream": True,
            "tools": [{"type": "function", **fn}], "tool_choice": "required",
            "max_output_tokens": 60, "temperature": 1.0})
        items = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert items and set(items) == {"function_call"}, items
