"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude
Code speaks; point ``ANTHROPIC_BASE_URL`` at the engine or the router).

A Messages request is turned into the equivalent chat request (`to_chat`) and served by
the chat path (`serving_chat.start_chat`: template, tools, grammar, generations); only
the answer's shape differs. The mapping, as vLLM's:

- ``system`` (text or text blocks) -> a system message; ``tool_result`` blocks -> ``tool``
  messages (before the rest of their user turn), ``tool_use`` blocks -> the assistant's
  ``tool_calls``; ``thinking`` blocks of earlier turns are dropped (chat templates drop
  earlier reasoning too); an image or a server tool (``web_search_...``) is a 400.
- ``tools`` (``input_schema``) -> functions; ``tool_choice`` auto / any / tool / none ->
  auto / required / named / none; ``stop_sequences`` -> stop strings; ``metadata.user_id``
  -> the session (routing and the CPU tier's session policy see Claude Code's sessions).
- A final assistant message is a prefill: the answer continues its text (and holds only
  the continuation), as Anthropic's API does (chat's ``continue_final_message``).
- The answer: a text block, then one ``tool_use`` block per call; ``stop_reason``
  ``tool_use`` / ``max_tokens`` / ``stop_sequence`` / ``end_turn``; usage as Anthropic
  counts it: ``input_tokens`` excludes ``cache_read_input_tokens`` (the prefix cache's hit).
- ``thinking`` is accepted, and answered without thinking blocks: our models have no
  reasoning parser.
- Errors are Anthropic error objects (``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from agentserve.engine.metrics import ServerMetrics
from agentserve.engine.protocol import (APIError, ChatRequest, FunctionCall, FunctionDef, Message,
                                        MessageToolCall, NamedFunction, NamedToolChoice, Tool,
                                        decode)
from agentserve.engine.request_id import request_ids
from agentserve.engine.answer_stream import pieces
from agentserve.engine.serving import (EngineClient, Generation, collect, json_response,
                                       release_unread_pins, stream_named, with_transfer)
from agentserve.engine.serving_chat import chat_messages, start_chat
from agentserve.engine.tools import parse_tool_calls


class Block(Struct, kw_only=True, omit_defaults=True):
    """A content block: text, tool_use, tool_result, thinking, image, ..."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


class AnthropicMessage(Struct, kw_only=True):
    role: str
    content: str | list[Block]


class AnthropicTool(Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    input_schema: Any = None
    type: str | None = None  # "custom" (or absent); anything else is a server tool


class AnthropicToolChoice(Struct, kw_only=True, omit_defaults=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(Struct, kw_only=True, omit_defaults=True):
    user_id: str | None = None


class MessagesRequest(Struct, kw_only=True, omit_defaults=True):
    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a P/D leg (the router's), as chat's


class CountTokensRequest(Struct, kw_only=True, omit_defaults=True):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error(e: APIError) -> dict[str, Any]:
    """An error as the Messages API shapes it (the field at fault, if known, in the text)."""
    where = f" ({e.param})" if e.param else ""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message + where}}


def _text(content: str | list[Block] | None, where: str) -> str:
    """Text of a string or of text blocks (an image or another kind is a 400)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for b in content:
        if b.type != "text":
            raise APIError(400, f"{where}: only text blocks are supported here, got {b.type!r}",
                           where)
        parts.append(b.text or "")
    return "\n".join(parts)


def _messages(req: MessagesRequest | CountTokensRequest) -> list[Message]:
    msgs = [Message(role="system", content=_text(req.system, "system"))] if req.system else []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant', got {m.role!r}",
                           f"{where}.role")
        if isinstance(m.content, str):
            msgs.append(Message(role=m.role, content=m.content))
            continue
        texts, calls = [], []
        for b in m.content:
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise APIError(400, f"{where}: a tool_use block needs id and name", where)
                calls.append(MessageToolCall(id=b.id, function=FunctionCall(
                    name=b.name, arguments=b.input if isinstance(b.input, dict) else {})))
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise APIError(400, f"{where}: a tool_result block needs tool_use_id", where)
                msgs.append(Message(role="tool", tool_call_id=b.tool_use_id,
                                    content=_text(b.content, f"{where}.tool_result")))
            elif b.type not in ("thinking", "redacted_thinking"):
                raise APIError(400, f"{where}: content blocks of type {b.type!r} are not "
                               f"supported in a {m.role} message", where)
        if m.role == "assistant":
            msgs.append(Message(role="assistant", content="".join(texts),
                                tool_calls=calls or None))
        elif texts:
            msgs.append(Message(role="user", content="\n".join(texts)))
    return msgs


def _tools(tools: list[AnthropicTool] | None) -> list[Tool] | None:
    out = []
    for i, t in enumerate(tools or []):
        if t.type not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: server tools ({t.type!r}) are not supported; "
                           "send client tools with an input_schema", f"tools[{i}]")
        out.append(Tool(function=FunctionDef(name=t.name, description=t.description,
                                             parameters=t.input_schema)))
    return out or None


def to_chat(req: MessagesRequest) -> ChatRequest:
    """The chat request a Messages request stands for (the module docstring has the map)."""
    choice = req.tool_choice
    tool_choice: str | NamedToolChoice | None = None
    if choice is not None:
        named = {"auto": "auto", "any": "required", "none": "none"}
        if choice.type == "tool":
            tool_choice = NamedToolChoice(function=NamedFunction(name=choice.name or ""))
        elif choice.type in named:
            tool_choice = named[choice.type]
        else:
            raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got "
                           f"{choice.type!r}", "tool_choice")
    if req.max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
    # a final assistant message is the answer's beginning (Anthropic's prefill)
    prefill = bool(req.messages) and req.messages[-1].role == "assistant"
    return ChatRequest(add_generation_prompt=not prefill, continue_final_message=prefill,
        messages=_messages(req), tools=_tools(req.tools), tool_choice=tool_choice,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        stop=req.stop_sequences, stream=req.stream, kv_transfer_params=req.kv_transfer_params,
        user=req.metadata.user_id if req.metadata is not None else None)


def count_tokens(engine: EngineClient, body: bytes) -> dict[str, Any]:
    """``/v1/messages/count_tokens``: the prompt's tokens, as /v1/messages would count them."""
    req = decode(body, CountTokensRequest)
    tok = engine.tokenizer
    tools = _tools(req.tools)
    try:
        prompt = tok.apply_chat_template(
            chat_messages(_messages(req)), tools=[msgspec.to_builtins(t) for t in tools or []] or None)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    return {"input_tokens": len(tok.encode(prompt))}


def _usage(g: Generation) -> dict[str, int]:
    return {"input_tokens": g.prompt_tokens - g.cached_tokens, "output_tokens": g.completion_tokens,
            "cache_read_input_tokens": g.cached_tokens, "cache_creation_input_tokens": 0}


def _stop(g: Generation, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if g.finish_reason == "length":
        return "max_tokens", None
    if g.finish_reason != "stop":
        return None, None
    if called:
        return "tool_use", None
    if g.detok.stop_string is not None:
        return "stop_sequence", g.detok.stop_string
    return "end_turn", None


def _tool_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        args = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        args = {}  # (cut short by max_tokens: stop_reason says so)
    return {"type": "tool_use", "id": call_id, "name": name, "input": args}


async def create_message(request: web.Request, engine: EngineClient, metrics: ServerMetrics,
                         body: bytes) -> web.StreamResponse:
    arrival = time.monotonic()
    mid, eid = request_ids(request, "msg")
    req = decode(body, MessagesRequest)
    run = await start_chat(request, engine, metrics, to_chat(req), eid, arrival)
    g = run.gens[0]
    head = {"id": mid, "type": "message", "role": "assistant", "model": engine.model_name}
    if req.stream:
        return await stream_named(request, _events(head, g, run.use_tools), anthropic_error)
    texts, _, _ = await collect(run.gens)
    content, calls = parse_tool_calls(texts[0]) if run.use_tools else (texts[0], [])
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    blocks += [_tool_block(c.id, c.name, c.arguments) for c in calls]
    reason, sequence = _stop(g, bool(calls))
    release_unread_pins(request, engine, run.gens)
    return json_response(with_transfer({**head, "content": blocks, "stop_reason": reason,
                                        "stop_sequence": sequence, "usage": _usage(g)}, run.gens))


async def _events(head: dict[str, Any], g: Generation, use_tools: bool
                  ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Anthropic's event stream: message_start, per block start / deltas / stop,
    message_delta (stop reason, output tokens), message_stop."""
    index, kind = -1, None  # the open block: its index and type (None: none open)
    called = False

    def close_block() -> list[tuple[str, dict[str, Any]]]:
        nonlocal kind
        if kind is None:
            return []
        kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def open_block(block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        nonlocal index, kind
        out = close_block()
        index, kind = index + 1, block["type"]
        return out + [("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": block})]

    def delta(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": index,
                                       "delta": body}

    async with contextlib.aclosing(pieces(g, use_tools)) as stream:
        async for p in stream:
            if p.kind == "start":  # after the first step: the cached tokens are known
                yield "message_start", {"type": "message_start", "message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**_usage(g), "output_tokens": 0}}}
            elif p.kind == "text":
                if kind != "text":
                    for ev in open_block({"type": "text", "text": ""}):
                        yield ev
                yield delta({"type": "text_delta", "text": p.text})
            elif p.kind == "call":
                called = True
                for ev in open_block({"type": "tool_use", "id": p.call_id, "name": p.name,
                                      "input": {}}):
                    yield ev
            else:
                yield delta({"type": "input_json_delta", "partial_json": p.text})
    for ev in close_block():
        yield ev
    reason, sequence = _stop(g, called)
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": {"output_tokens": g.completion_tokens}}
    yield "message_stop", {"type": "message_stop"}
