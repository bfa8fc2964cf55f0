"""Constrained decoding of tool calls and JSON answers (response_format) with llguidance.

For tool_choice "required" (any tool) or a named function, the answer must be

    <tool_call>{"name": <tool name>, "arguments": <that tool's parameters schema>}</tool_call>

followed by EOS; with parallel_tool_calls and "required", more calls may follow,
separated by a newline. The JSON part is compiled from a JSON Schema (an anyOf over
tools, each pinning "name" with const), embedded in a Lark grammar, and enforced
token by token by `GrammarConstraint`, which implements the engine's
`LogitsConstraint`. JSON is compact (no free whitespace) so that a weak model
cannot wander off into blank space. `response_format` json_object / json_schema
is the same JSON part alone (any object, or the given schema), then EOS.

`llguidance.hf.from_tokenizer` needs transformers; we build the `LLTokenizer`
straight from the `tokenizers` JSON instead, once per tokenizer.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import numpy as np
import torch

from agentserve.prompt.tokenizer import Tokenizer
from agentserve.engine.model.tools import END, START

# Applied on top of every tool schema: compact separators, no free whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_NO_PARAMS = {"type": "object", "properties": {}, "additionalProperties": False}


class GrammarError(ValueError):
    """The tools cannot be turned into a grammar; the message says why (HTTP 400)."""


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance view of a tokenizer (expensive for big vocabularies: cached)."""
    return llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                  eos_token=tokenizer.eos_token_ids or None)


def _parameters(tool: dict[str, Any], i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise GrammarError(f"tools[{i}].function.name must be a string")
    params = fn.get("parameters")
    if params is None:
        return dict(_NO_PARAMS)
    if not isinstance(params, dict):
        raise GrammarError(f"tools[{i}].function.parameters must be a JSON Schema object, "
                           f"got {type(params).__name__}")
    return params


def tool_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """JSON Schema of one call object; `name` pins a single tool."""
    options = []
    for i, tool in enumerate(tools):
        params = _parameters(tool, i)
        fn_name = tool["function"]["name"]
        if name is not None and fn_name != name:
            continue
        options.append({"type": "object", "additionalProperties": False,
                        "required": ["name", "arguments"],
                        "properties": {"name": {"const": fn_name}, "arguments": params}})
    if not options:
        raise GrammarError(f"tool_choice names function {name!r}, which is not in tools")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": _JSON_OPTIONS}


def compile_tool_grammar(tokenizer: Tokenizer, tools: list[dict[str, Any]], name: str | None,
                         parallel: bool) -> str:
    """A validated llguidance grammar for the tool-call answer. Raises GrammarError."""
    schema = json.dumps(tool_call_schema(tools, name))
    many = ' ("\\n" call)*' if parallel and name is None else ""
    lark = (f"start: call{many}\n"
            f"call: {_marker(tokenizer, START)} %json {schema} {_marker(tokenizer, END)}\n")
    return _validated(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark))


def compile_json_grammar(tokenizer: Tokenizer, schema: dict[str, Any] | None) -> str:
    """A validated grammar for one JSON value: `schema`, or any JSON object when None.
    Raises GrammarError."""
    body = {"type": "object"} if schema is None else schema
    lark = f"start: %json {json.dumps({**body, 'x-guidance': _JSON_OPTIONS})}\n"
    return _validated(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark),
                      "response_format schema")


def _marker(tokenizer: Tokenizer, text: str) -> str:
    """Lark for a tool marker: a special token must be named by id (`<[id]>`),
    since llguidance never matches special tokens against literal text."""
    tid = tokenizer.token_id(text)
    return f"<[{tid}]>" if tid in tokenizer.special_ids else json.dumps(text)


@functools.lru_cache(maxsize=256)
def _validated(tokenizer: Tokenizer, grammar: str, what: str = "tool schema") -> str:
    # Agents send the same tools every turn: validate each grammar once.
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, ll_tokenizer(tokenizer))
    if is_error:
        raise GrammarError(f"invalid {what}: {'; '.join(messages)}")
    return grammar


class GrammarConstraint:
    """A `LogitsConstraint` backed by an `llguidance.LLMatcher`."""

    def __init__(self, tokenizer: Tokenizer, grammar: str) -> None:
        self.n_vocab = tokenizer.vocab_size
        self.eos = tokenizer.eos_token_ids
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid schema: {self.matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """Bool mask [n_vocab] of tokens the grammar allows next."""
        if self.matcher.is_error():  # cannot happen with masked sampling; end cleanly
            mask = torch.zeros(self.n_vocab, dtype=torch.bool)
            mask[self.eos] = True
            return mask
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[:self.n_vocab]
        return torch.from_numpy(bits.astype(np.bool_))

    def apply(self, logits: torch.Tensor) -> None:
        """logits: [vocab >= n_vocab]; disallowed entries become -inf in place."""
        allowed = self.allowed().to(logits.device)
        logits[:self.n_vocab].masked_fill_(~allowed, float("-inf"))
        logits[self.n_vocab:] = float("-inf")

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()
