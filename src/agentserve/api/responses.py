"""OpenAI's Responses API on the wire: its request types and the chat request a Responses
request stands for (`to_chat`; the mapping is in engine/http/responses.py).

Only msgspec and the chat protocol: the router imports this to render Responses bodies as
the engine does, without the engine's serving stack (torch).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from agentserve.api.openai import (APIError, ChatRequest, FunctionCall, FunctionDef,
                                        JsonSchemaFormat, Message, MessageToolCall, NamedFunction,
                                        NamedToolChoice, ResponseFormat, Tool)


class Part(Struct, kw_only=True, omit_defaults=True):
    type: str  # input_text / output_text / refusal (others are refused)
    text: str | None = None
    refusal: str | None = None


class InputItem(Struct, kw_only=True, omit_defaults=True):
    type: str | None = None  # message (the default with a role), function_call, ...
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class FunctionTool(Struct, kw_only=True, omit_defaults=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class ToolChoiceFunction(Struct, kw_only=True, omit_defaults=True):
    type: str
    name: str | None = None


class TextFormat(JsonSchemaFormat, kw_only=True, omit_defaults=True):
    """``text.format``: chat's json_schema fields, flattened beside the type."""

    type: str


class TextConfig(Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None


class ResponsesRequest(Struct, kw_only=True, omit_defaults=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a P/D leg (the router's), as chat's


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for p in content:
        if p.type not in ("input_text", "output_text", "text", "refusal"):
            raise APIError(400, f"{where}: only text parts are supported, got {p.type!r}", where)
        out.append(p.text if p.text is not None else p.refusal or "")
    return "\n".join(out)


def _messages(req: ResponsesRequest) -> list[Message]:
    msgs = [Message(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return [*msgs, Message(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        where, kind = f"input[{i}]", item.type or ("message" if item.role else None)
        if kind == "message":
            if item.role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"{where}.role must be system, developer, user or "
                               f"assistant, got {item.role!r}", f"{where}.role")
            msgs.append(Message(role=item.role, content=_text(item.content, where)))
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise APIError(400, f"{where}: a function_call needs call_id and name", where)
            call = MessageToolCall(id=item.call_id, function=FunctionCall(
                name=item.name, arguments=item.arguments or "{}"))
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant":  # one turn's calls: one message
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                msgs.append(Message(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id:
                raise APIError(400, f"{where}: a function_call_output needs call_id", where)
            msgs.append(Message(role="tool", tool_call_id=item.call_id,
                                content=_text(item.output, f"{where}.output")))
        elif kind != "reasoning":
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", where)
    if not msgs:
        raise APIError(400, "input must not be empty", "input")
    return msgs


def _tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    out = []
    for i, t in enumerate(tools or []):
        if t.type != "function" or not t.name:
            raise APIError(400, f"tools[{i}]: only function tools (with a name) are supported, "
                           f"got type {t.type!r}", f"tools[{i}]")
        out.append(Tool(function=FunctionDef(name=t.name, description=t.description,
                                             parameters=t.parameters, strict=t.strict)))
    return out or None


def _format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict))
    return ResponseFormat(type=fmt.type)  # json_object, or a type check_chat refuses


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request stands for (the module docstring has the map)."""
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: responses are not stored; "
                       "send the whole conversation in input", "previous_response_id")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be >= 1, got {req.max_output_tokens}",
                       "max_output_tokens")
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        if choice.type != "function" or not choice.name:
            raise APIError(400, "tool_choice must be auto, none, required or {type: function, "
                           "name}", "tool_choice")
        choice = NamedToolChoice(function=NamedFunction(name=choice.name))
    return ChatRequest(
        messages=_messages(req), tools=_tools(req.tools), tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        response_format=_format(req.text), user=req.prompt_cache_key or req.user,
        kv_transfer_params=req.kv_transfer_params)
