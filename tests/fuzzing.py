"""Hypothesis strategies for fuzzing the servers' APIs (test support, not a test module).

Used by tests/engine/http/test_fuzz_api.py (bodies against an in-process engine),
tests/router/test_parse_fuzz.py (the router's parsing) and benchmarks/harden_fuzz.py (a
whole `agentserve up` cluster). Bodies start from a valid one and have fields set to
random values: mostly well-typed values around the edges of each field's range (so that
combinations of valid fields reach the engine), sometimes any JSON. `kv_params` makes
malformed and well-formed `kv_transfer_params`, `raw_bodies` bytes that are not a JSON
object (or not JSON, or not UTF-8), `odd_headers` the headers a client may get wrong or
must not be able to use.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import strategies as st

from agentserve.api.anthropic import CountTokensRequest, MessagesRequest
from agentserve.api.openai import ChatRequest, CompletionRequest
from agentserve.api.responses import ResponsesRequest

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.integers(-2**70, 2**70),
                     st.floats(-5, 5), st.text(max_size=6))
json_values = st.recursive(_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)),
    max_leaves=10)


def _fields(struct: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(struct)]


MSG = {"role": "user", "content": "hi"}
# path -> (a valid body, the field names a fuzzed body sets)
ENDPOINTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": ({"prompt": "hello", "max_tokens": 3}, _fields(CompletionRequest)),
    "/v1/chat/completions": ({"messages": [MSG], "max_tokens": 3}, _fields(ChatRequest)),
    "/v1/messages": ({"messages": [MSG], "max_tokens": 3}, _fields(MessagesRequest)),
    "/v1/responses": ({"input": "hi", "max_output_tokens": 3}, _fields(ResponsesRequest)),
    "/v1/messages/count_tokens": ({"messages": [MSG]}, _fields(CountTokensRequest)),
    "/tokenize": ({"prompt": "hello"}, ["prompt", "messages", "tools", "add_special_tokens",
                                        "add_generation_prompt", "return_token_strs"]),
    "/detokenize": ({"tokens": [1, 2, 3]}, ["tokens", "model"]),
}
GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")

# values that would only make a request long, not wrong: kept small
SMALL = {"max_tokens": st.integers(-1, 6), "max_completion_tokens": st.integers(-1, 6),
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

# ---- kv_transfer_params: every field wrong in the ways a client (or a bug) gets it wrong ----
_HEX64 = st.text("0123456789abcdef", min_size=64, max_size=64)
_HOSTS = st.sampled_from(["127.0.0.1", "localhost", "::1", "10.255.255.1", "evil.example",
                          "http://127.0.0.1", "127.0.0.1:80", "[::1]", "a b", "", "x" * 300,
                          "-bad-.host", "169.254.169.254", "0.0.0.0"])
_PORTS = st.one_of(st.sampled_from([-1, 0, 1, 65535, 65536, 2**40, "abc", "80", 1.5, None,
                                    True, [80]]), st.integers(1, 65535))
_IDS = st.one_of(st.text(max_size=8), st.just("x" * 300), st.integers(), st.none())
_HASHES = st.one_of(st.lists(_HEX64, max_size=3),
                    st.lists(st.sampled_from(["zz", "", "ab" * 16, "AB" * 32, "g" * 64, 1, None]),
                             max_size=3),
                    st.integers(), st.text(max_size=4))
_BLOCK_IDS = st.one_of(st.lists(st.integers(-2, 2**40), max_size=4),
                       st.lists(st.sampled_from(["1", 1.5, None, True]), max_size=2), st.text(max_size=3))
_KV_FIELDS: dict[str, st.SearchStrategy] = {
    "do_remote_decode": st.one_of(st.booleans(), st.sampled_from([1, "true", None])),
    "do_remote_prefill": st.one_of(st.booleans(), st.sampled_from([1, "true", None])),
    "remote_host": st.one_of(_HOSTS, st.text(max_size=10), st.integers()),
    "remote_port": _PORTS,
    "remote_request_id": _IDS, "remote_engine_id": _IDS,
    "remote_block_ids": _BLOCK_IDS, "remote_block_hashes": _HASHES,
    "remote_block_size": st.one_of(st.sampled_from([16, 32, 0, -1, "16", 2**40]), st.none()),
    "remote_num_tokens": st.one_of(st.integers(-2, 5000), st.text(max_size=3)),
    "tp_size": st.one_of(st.integers(-1, 3), st.text(max_size=2)),
}


def kv_params(base: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    """`kv_transfer_params` values: any JSON, or an object (from `base`, e.g. a real
    prefill leg's answer) with up to four fields set to wrong or edge values."""
    @st.composite
    def mutated(draw: st.DrawFn) -> dict[str, Any]:
        p = dict(base or {})
        for name in draw(st.lists(st.sampled_from(list(_KV_FIELDS)), max_size=4, unique=True)):
            p[name] = draw(_KV_FIELDS[name])
        if draw(st.integers(0, 9)) == 0:
            p[draw(st.text(max_size=6))] = draw(json_values)  # a field nobody defines
        return p
    return st.one_of(mutated(), mutated(), mutated(), json_values)


# well-typed values around the edges of each field's range, so that combinations of valid
# fields (echo + stream + logprobs + n, a grammar + penalties, ...) reach the engine
PLAUSIBLE = {
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
    "return_token_strs": st.booleans(),
    "tools": st.sampled_from([[_TOOL], [], [_ATOOL]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "any"},
                                    {"type": "tool", "name": "f"}, {"type": "function",
                                                                     "function": {"name": "f"}}]),
    "prompt": st.one_of(st.text(max_size=8), st.lists(st.integers(-1, 5000), max_size=6)),
    "tokens": st.lists(st.integers(-1, 60000), max_size=6),
    "messages": st.lists(st.one_of(_chat_msg, _anthropic_msg), max_size=4),
    "system": st.one_of(_txt, st.lists(_block, max_size=2)),
    "input": st.one_of(_txt, st.lists(_item, max_size=4)), "instructions": _txt,
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "object"}}}, {"format": {}}]),
    "previous_response_id": st.one_of(st.none(), _txt), "prompt_cache_key": _txt,
    "metadata": st.one_of(st.fixed_dictionaries({"user_id": _txt}), json_values),
    "kv_transfer_params": st.one_of(st.sampled_from([None, {}, {"do_remote_decode": True}]),
                                    kv_params()),
}


@st.composite
def bodies(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A body for `path` (a key of ENDPOINTS): its valid base with up to 5 fields set."""
    base, fields = ENDPOINTS[path]
    body = dict(base)
    if draw(st.integers(0, 4)):  # mostly the fields that take values, not the structure
        fields = [f for f in fields if f in PLAUSIBLE or f in SMALL]
    for name in draw(st.lists(st.sampled_from(fields), max_size=5, unique=True)):
        typed = name in SMALL or (name in PLAUSIBLE and draw(st.integers(0, 9)) < 8)
        strategy = SMALL[name] if name in SMALL else PLAUSIBLE[name] if typed else json_values
        body[name] = draw(strategy)
    return body


# ---- bytes that are not a JSON object --------------------------------------------------
def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


@st.composite
def raw_bodies(draw: st.DrawFn, path: str) -> bytes:
    """A body for `path` that is broken as bytes: not UTF-8, cut short, nested deep, with
    numbers no type holds, a JSON value that is not an object, empty, or random bytes."""
    valid = json.dumps(draw(bodies(path))).encode()
    kind = draw(st.sampled_from(["utf8", "truncated", "nested", "number", "not_object",
                                 "empty", "bytes", "literal", "bom"]))
    if kind == "utf8":  # a mangled byte in a key or a value (a key: D-gap "max_tokens")
        at = draw(st.integers(0, len(valid)))
        return valid[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) \
            + valid[at:]
    if kind == "truncated":
        return valid[:draw(st.integers(0, max(0, len(valid) - 1)))]
    if kind == "nested":
        return _nested(draw(st.sampled_from([64, 1000, 5000, 100_000])))
    if kind == "number":
        field = draw(st.sampled_from(["max_tokens", "temperature", "n", "seed", "top_k",
                                      "max_output_tokens", "tokens"]))
        num = draw(st.sampled_from([b"1e999", b"-1e999", b"1" * 400, b"1e-400", b"-0",
                                    b"123456789012345678901234567890", b"0x10", b"NaN",
                                    b"Infinity", b"[1e999]"]))
        return valid[:-1] + b', "' + field.encode() + b'": ' + num + b"}"
    if kind == "not_object":
        return draw(st.sampled_from([b"[]", b"null", b'"x"', b"1", b"true", b"[{}]"]))
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n", b"{}", b"{"]))
    if kind == "literal":  # duplicate keys and JSON's edge literals
        return valid[:-1] + b', "prompt": 1, "prompt": {"a": NaN}}'
    if kind == "bom":
        return draw(st.sampled_from([b"\xef\xbb\xbf" + valid, valid.decode().encode("utf-16")]))
    return draw(st.binary(max_size=64))


# ---- headers -----------------------------------------------------------------------------
_ODD = st.one_of(st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b),
                 st.sampled_from([b"", b" ", b"../../etc/passwd", b"%00%0d%0a", b"\x00",
                                  b"\xff\xfe", "é日本".encode(), b"x" * 8000, b'"quoted"',
                                  b"a,b;c=d", b"<script>"]))
CONTENT_TYPES = [b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                 b"multipart/form-data", b"multipart/form-data; boundary=x", b"",
                 b"application/json; charset=latin-1", b"application/octet-stream"]


@st.composite
def odd_headers(draw: st.DrawFn) -> dict[str, bytes]:
    """Up to four headers (name -> raw value) a client may get wrong or must not be able
    to use: auth, request ids, the cluster's internal x-agentserve-* headers, encodings."""
    pool = {
        "Authorization": st.one_of(st.just(b"Bearer "), _ODD.map(lambda v: b"Bearer " + v),
                                   st.just(b"Basic Zm9vOmJhcg=="), _ODD),
        "x-api-key": _ODD,
        "X-Request-Id": _ODD,
        "x-session-id": _ODD,
        "x-agentserve-transfer-auth": st.one_of(_ODD, st.sampled_from(
            [b"1.abc", b"99999999999.00", b"0." + b"0" * 64, b"."])),
        "x-agentserve-operator-key": _ODD,
        "Content-Type": st.sampled_from(CONTENT_TYPES),
        "Content-Encoding": st.sampled_from([b"gzip", b"deflate", b"br", b"identity", b"x"]),
        "Accept-Encoding": st.sampled_from([b"gzip", b"*", b"x;q=abc"]),
        "x-claude-code-session-id": _ODD,
    }
    names = draw(st.lists(st.sampled_from(list(pool)), max_size=4, unique=True))
    return {n: draw(pool[n]) for n in names}
