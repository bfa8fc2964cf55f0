"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude
Code speaks; point ``ANTHROPIC_BASE_URL`` at the engine or the router).

A Messages request is turned into the equivalent chat request (`api.anthropic.to_chat`,
which the router uses too) and served by
the chat path (`chat.start_chat`: template, tools, grammar, generations); only
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
- The answer (id ``msg_...``): a text block, then one ``tool_use`` block per call (id
  ``toolu_...``; chat's ``call_...`` id with Anthropic's prefix); with tool_choice any / tool
  only ``tool_use`` blocks; ``stop_reason`` ``tool_use`` / ``max_tokens`` / ``stop_sequence``
  / ``end_turn``. Usage as Anthropic counts it: the prompt is ``input_tokens`` +
  ``cache_read_input_tokens`` (the prefix cache's hit) + ``cache_creation_input_tokens``
  (computed and stored in full blocks: `answer_stream.prompt_cache`); streamed, both
  message_start and message_delta carry all four counts (message_delta's are final).
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

from agentserve.engine.http.answer_stream import pieces, prompt_cache
from agentserve.prompt.chat import chat_messages, chat_prompts
from agentserve.api.anthropic import (CountTokensRequest, MessagesRequest,
                                                 anthropic_error, to_chat, to_messages, to_tools)
from agentserve.engine.http.metrics import ServerMetrics
from agentserve.api.openai import APIError, decode
from agentserve.api.request_id import request_ids
from agentserve.engine.http.serving import (EngineClient, Generation, collect, json_response,
                                       release_unread_pins, stream_named, with_transfer)
from agentserve.engine.http.chat import start_chat
from agentserve.engine.model.tools import StreamingToolParser, partial_object

__all__ = ["anthropic_error", "count_tokens", "create_message"]


def count_tokens(engine: EngineClient, body: bytes) -> dict[str, Any]:
    """``/v1/messages/count_tokens``: the prompt's tokens, as /v1/messages would count them."""
    req = decode(body, CountTokensRequest)
    tools = to_tools(req.tools)
    try:
        ids = chat_prompts(engine).ids(chat_messages(to_messages(req)),
                                       [msgspec.to_builtins(t) for t in tools or []] or None)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    return {"input_tokens": len(ids)}


def _usage(g: Generation) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` is the prompt less what was read from the cache and
    what was written to it (the three add up to the prompt)."""
    read, written = prompt_cache(g)
    return {"input_tokens": g.prompt_tokens - read - written,
            "cache_creation_input_tokens": written, "cache_read_input_tokens": read,
            "output_tokens": g.completion_tokens}


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a call the parser named ``call_...`` (the same suffix)."""
    return "toolu_" + call_id.removeprefix("call_")


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
    # cut short by max_tokens (stop_reason says so): the completed members of the object
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name,
            "input": partial_object(arguments)}


async def create_message(request: web.Request, engine: EngineClient, metrics: ServerMetrics,
                         body: bytes) -> web.StreamResponse:
    arrival = time.monotonic()
    mid, eid = request_ids(request, "msg", sep="_")
    req = decode(body, MessagesRequest)
    run = await start_chat(request, engine, metrics, to_chat(req), eid, arrival)
    g = run.gens[0]
    head = {"id": mid, "type": "message", "role": "assistant", "model": engine.model_name}
    if req.stream:
        return await stream_named(request, _events(head, g, run.parser()), anthropic_error)
    texts, _, _ = await collect(run.gens)
    content, calls = run.calls(texts[0], g.finish_reason)
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    blocks += [_tool_block(c.id, c.name, c.arguments) for c in calls]
    reason, sequence = _stop(g, bool(calls))
    release_unread_pins(request, engine, run.gens)
    return json_response(with_transfer({**head, "content": blocks, "stop_reason": reason,
                                        "stop_sequence": sequence, "usage": _usage(g)}, run.gens))


async def _events(head: dict[str, Any], g: Generation, parser: StreamingToolParser | None
                  ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Anthropic's event stream: message_start, per block start / deltas / stop,
    message_delta (stop reason, the final usage), message_stop."""
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

    async with contextlib.aclosing(pieces(g, parser)) as stream:
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
                for ev in open_block({"type": "tool_use", "id": tool_use_id(p.call_id),
                                      "name": p.name, "input": {}}):
                    yield ev
            else:
                yield delta({"type": "input_json_delta", "partial_json": p.text})
    for ev in close_block():
        yield ev
    reason, sequence = _stop(g, called)
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": _usage(g)}
    yield "message_stop", {"type": "message_stop"}
