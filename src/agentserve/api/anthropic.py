"""Anthropic's Messages API on the wire: its request types, its error object, and the chat
request a Messages request stands for (`to_chat`; the mapping is in engine/http/messages.py).

Only msgspec and the chat protocol: the router imports this to render Messages bodies as
the engine does, without the engine's serving stack (torch).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from agentserve.api.openai import (APIError, ChatRequest, FunctionCall, FunctionDef, Message,
                                        MessageToolCall, NamedFunction, NamedToolChoice, Tool)


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


def to_messages(req: MessagesRequest | CountTokensRequest) -> list[Message]:
    """The chat messages of a Messages (or count_tokens) request."""
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


def to_tools(tools: list[AnthropicTool] | None) -> list[Tool] | None:
    """Client tools as chat functions (server tools are a 400)."""
    out = []
    for i, t in enumerate(tools or []):
        if t.type not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: server tools ({t.type!r}) are not supported; "
                           "send client tools with an input_schema", f"tools[{i}]")
        if not isinstance(t.input_schema, dict):  # Anthropic requires it on client tools
            raise APIError(400, f"tools[{i}].input_schema: a JSON Schema object is required "
                           f"(tool {t.name!r})", f"tools[{i}].input_schema")
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
    # any / tool: the answer is tool_use blocks only, and a stop sequence met inside a call's
    # input would cut its required fields: stop sequences end text, so they do not apply
    forced = bool(req.tools) and tool_choice not in (None, "auto", "none")
    return ChatRequest(
        add_generation_prompt=not prefill, continue_final_message=prefill,
        messages=to_messages(req), tools=to_tools(req.tools), tool_choice=tool_choice,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        stop=None if forced else req.stop_sequences, stream=req.stream, kv_transfer_params=req.kv_transfer_params,
        user=req.metadata.user_id if req.metadata is not None else None)
