"""Tool-call parsing (one-shot and streaming) and the tool-call grammar."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
import torch

from agentserve.engine.model.constrained import (GrammarError, GrammarConstraint,
                                           compile_tool_grammar, tool_call_schema)
from agentserve.engine.model.tools import (StreamingToolParser, parse_cut_calls, parse_tool_calls,
                                          top_level_spans)

ONE = ('Let me check.<tool_call>{"name": "get_weather", '
       '"arguments": {"city": "Paris", "n": [1, {"x": "}"}]}}</tool_call>')
TWO = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
       '<tool_call>{"arguments": {"q": "a\\"b"}, "name": "b"}</tool_call>')
CASES = [ONE, TWO, "no tools here",
         '<tool_call>{"name": "x", "arguments": "{\\"k\\": 1}"}</tool_call>',
         "text <tool_call>not json</tool_call> tail", "<tool_ca"]


def stream(text: str, sizes: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """Feed text in chunks of the given sizes (cycled); reassemble content and calls."""
    parser, content, calls = StreamingToolParser(), "", {}
    pos, k = 0, 0
    pieces = []
    while pos < len(text):
        n = sizes[k % len(sizes)]
        pieces.append(text[pos:pos + n])
        pos, k = pos + n, k + 1
    for piece in pieces:
        c, deltas = parser.feed(piece)
        content += c
        for d in deltas:
            merge(calls, d)
    c, deltas = parser.finish()
    for d in deltas:
        merge(calls, d)
    return content + c, [calls[i] for i in sorted(calls)]


def merge(calls: dict[int, dict[str, Any]], d: dict[str, Any]) -> None:
    if d["index"] not in calls:
        assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"]
        calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
    else:
        assert "name" not in d["function"]
    calls[d["index"]]["arguments"] += d["function"]["arguments"]


def test_spans_on_prefix() -> None:
    body = '{"name": "f", "arguments": {"a": "}",'
    spans = top_level_spans(body)
    assert body[spans["name"][0]:spans["name"][1]] == '"f"'
    assert spans["arguments"][1] is None


def test_parse_one() -> None:
    content, calls = parse_tool_calls(ONE)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "n": [1, {"x": "}"}]}
    assert calls[0].to_openai()["type"] == "function"


def test_parse_two_and_string_arguments() -> None:
    content, calls = parse_tool_calls(TWO)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ("b", {"q": 'a"b'})]
    _, calls = parse_tool_calls(CASES[3])
    assert calls[0].arguments == '{"k": 1}'


def test_invalid_block_stays_content() -> None:
    assert parse_tool_calls(CASES[4]) == (CASES[4], [])


@pytest.mark.parametrize("text", CASES)
@pytest.mark.parametrize("sizes", [[1], [2, 5], [7], [1000], [3, 1, 11]])
def test_streaming_reassembles_exactly(text: str, sizes: list[int]) -> None:
    content, calls = stream(text, sizes)
    ref_content, ref_calls = parse_tool_calls(text)
    want = [(c.name, c.arguments) for c in ref_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == want
    assert (content.strip() or None) == ref_content.strip() if ref_content else not content.strip()


LONE_SURROGATES = '<tool_call>{"name": "f\\ud83d", "arguments": "\\udc00x"}</tool_call>'


@pytest.mark.parametrize("sizes", [[1], [1000]])
def test_a_model_written_lone_surrogate_can_be_encoded(sizes: list[int]) -> None:
    """The model may write "\\ud83d" alone, which json.loads accepts; the name and string
    arguments must still encode as UTF-8 (a Responses answer was a 500; found by
    benchmarks/harden_fuzz.py)."""
    _, calls = parse_tool_calls(LONE_SURROGATES)
    assert [c.name for c in calls] == ["f\ufffd\ufffd\ufffd"]
    msgspec.json.encode([c.to_openai() for c in calls])
    _, streamed = stream(LONE_SURROGATES, sizes)
    msgspec.json.encode(streamed)
    assert [c["name"] for c in streamed] == [calls[0].name]


def test_streaming_name_before_arguments() -> None:
    parser = StreamingToolParser()
    assert parser.feed("Hi <tool_") == ("Hi ", [])
    _, d = parser.feed('call>{"name": "get_weather", "argu')
    assert d[0]["function"] == {"name": "get_weather", "arguments": ""}
    _, d = parser.feed('ments": {"city": "Pa')
    assert d == [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]


# --- grammar ---------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["city", "unit"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "now"}}


def check_schema(value: Any, schema: dict[str, Any]) -> None:
    """The subset of JSON Schema the tests use (no jsonschema dependency)."""
    if "enum" in schema:
        assert value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props)
        for k, v in value.items():
            if k in props:
                check_schema(v, props[k])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
    elif kind == "boolean":
        assert isinstance(value, bool)


def run_random(tokenizer, constraint: GrammarConstraint, seed: int,
               limit: int = 400) -> list[int]:
    """Sample from random logits under the constraint until it is done."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not constraint.done() and len(out) < limit:
        logits = torch.randn(tokenizer.vocab_size + 7, generator=gen) * 3
        constraint.apply(logits)
        assert torch.isinf(logits[tokenizer.vocab_size:]).all()
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        constraint.accept(tok)
        out.append(tok)
    assert constraint.done(), "grammar did not finish"
    return out


@pytest.mark.parametrize("seed", range(6))
def test_required_random_logits_are_schema_valid(tokenizer, seed: int) -> None:
    tools = [WEATHER, NOARGS] if seed % 2 else [WEATHER]
    grammar = compile_tool_grammar(tokenizer, tools, None, parallel=False)
    ids = run_random(tokenizer, GrammarConstraint(tokenizer, grammar), seed)
    content, calls = parse_tool_calls(tokenizer.decode(ids))
    assert content is None and len(calls) == 1
    params = {"get_weather": WEATHER["function"]["parameters"], "now": {"type": "object"}}
    check_schema(json.loads(calls[0].arguments), params[calls[0].name])


@pytest.mark.parametrize("seed", range(4))
def test_required_on_tiny_tokenizer(tiny_tokenizer, seed: int) -> None:
    tools = [WEATHER, NOARGS]
    constraint = GrammarConstraint(tiny_tokenizer, compile_tool_grammar(
        tiny_tokenizer, tools, None, parallel=seed % 2 == 1))
    text = tiny_tokenizer.decode(run_random(tiny_tokenizer, constraint, seed, limit=1000))
    content, calls = parse_tool_calls(text)
    assert content is None and calls
    params = {"get_weather": WEATHER["function"]["parameters"], "now": {"type": "object"}}
    for call in calls:
        check_schema(json.loads(call.arguments), params[call.name])


@pytest.mark.parametrize("seed", range(4))
def test_forced_parallel_answer_has_no_content_streamed_or_not(tiny_tokenizer, seed: int) -> None:
    """"required" with parallel calls: the newlines the grammar puts between calls are never
    content (a streamed one was a text block on /v1/messages), and the streamed calls are the
    whole answer's, fed in random pieces."""
    constraint = GrammarConstraint(tiny_tokenizer, compile_tool_grammar(
        tiny_tokenizer, [WEATHER, NOARGS], None, parallel=True))
    text = tiny_tokenizer.decode(run_random(tiny_tokenizer, constraint, seed, limit=1000))
    text = text + "\n" + text  # (at least two calls, as the grammar joins them)
    parser, content, rng = StreamingToolParser(forced=True), "", random.Random(seed)
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 9)
        content += parser.feed(text[pos:pos + step])[0]
        pos += step
    content += parser.finish()[0]
    whole_content, whole = parse_cut_calls(text)
    assert content == "" and whole_content is None
    assert [(c.name, c.arguments) for c in parser.calls] == \
        [(c.name, c.arguments) for c in whole] == \
        [(c.name, c.arguments) for c in parse_tool_calls(text)[1]]
    assert len(whole) >= 2


def test_named_choice_forces_that_tool(tokenizer) -> None:
    grammar = compile_tool_grammar(tokenizer, [WEATHER, NOARGS], "get_weather", parallel=False)
    for seed in range(3):
        ids = run_random(tokenizer, GrammarConstraint(tokenizer, grammar), seed)
        _, calls = parse_tool_calls(tokenizer.decode(ids))
        assert calls[0].name == "get_weather"


def test_bad_schemas_are_errors(tokenizer) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(GrammarError):
        compile_tool_grammar(tokenizer, [bad], None, parallel=False)
    with pytest.raises(GrammarError, match="not in tools"):
        compile_tool_grammar(tokenizer, [WEATHER], "missing", parallel=False)
    assert tool_call_schema([NOARGS])["properties"]["name"] == {"const": "now"}


def test_random_sampling_without_constraint_is_not_json(tokenizer) -> None:
    # Sanity check that the test above is meaningful: unconstrained text is garbage.
    rng = random.Random(0)
    text = tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(30)])
    assert parse_tool_calls(text)[1] == []
