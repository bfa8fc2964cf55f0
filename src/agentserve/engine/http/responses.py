"""POST /v1/responses: OpenAI's Responses API, stateless (what Codex speaks with
``store: false``: the whole conversation in ``input`` each turn).

As /v1/messages, a Responses request becomes the equivalent chat request
(`api.responses.to_chat`, which the router uses too) and
runs on the chat path; only the answer's shape differs. The mapping:

- ``instructions`` -> a system message; ``input`` text -> a user message; input items:
  messages (system / developer / user / assistant, text parts) as they are,
  ``function_call`` items -> the assistant's ``tool_calls`` (joined to the assistant
  message before them), ``function_call_output`` -> ``tool`` messages; ``reasoning``
  items are dropped (chat templates drop earlier reasoning too); an image, a file or a
  built-in tool (web_search, file_search, ...) is a 400.
- ``tools`` (function tools), ``tool_choice``, ``parallel_tool_calls``,
  ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (json_schema /
  json_object, constrained as ``response_format``); ``prompt_cache_key`` (else ``user``)
  is the session for routing and the CPU tier's session policy.
- The answer (id ``resp_...``, ``created_at`` / ``completed_at`` integer seconds, the
  request's settings echoed): a ``message`` item with the text, then one ``function_call``
  item per call (with tool_choice required or a function, only those); ``status``
  ``incomplete`` (``max_output_tokens``) when cut short. Usage as OpenAI counts it:
  ``input_tokens`` is the whole prompt, of which ``input_tokens_details.cached_tokens`` were
  read from the prefix cache and ``cache_write_tokens`` computed and stored in full blocks
  (`answer_stream.prompt_cache`).
- Nothing is stored: ``previous_response_id`` is a 400 (send the conversation in
  ``input``), and ``store`` is accepted but keeps nothing. ``reasoning`` is accepted and
  answered without reasoning items (no reasoning parser).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from agentserve.engine.http.answer_stream import pieces, prompt_cache
from agentserve.engine.http.metrics import ServerMetrics
from agentserve.api.openai import decode
from agentserve.api.request_id import request_ids
from agentserve.api.responses import ResponsesRequest, to_chat
from agentserve.engine.http.serving import (EngineClient, Generation, collect, json_response,
                                       release_unread_pins, stream_named, with_transfer)
from agentserve.engine.http.chat import start_chat
from agentserve.engine.model.tools import StreamingToolParser

__all__ = ["create_response"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(g: Generation) -> dict[str, Any]:
    read, written = prompt_cache(g)
    return {"input_tokens": g.prompt_tokens,
            "input_tokens_details": {"cached_tokens": read, "cache_write_tokens": written},
            "output_tokens": g.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": g.prompt_tokens + g.completion_tokens}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str
               ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _envelope(rid: str, req: ResponsesRequest, model: str, created: int) -> dict[str, Any]:
    """The response object around its output (what the request asked for, echoed; times in
    integer seconds, as the real API sends them)."""
    return {"id": rid, "object": "response", "created_at": created, "completed_at": None,
            "model": model, "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": msgspec.to_builtins(req.tool_choice) or "auto",
            "tools": msgspec.to_builtins(req.tools or []), "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None, "store": False, "background": False,
            "text": msgspec.to_builtins(req.text) if req.text and req.text.format
            else {"format": {"type": "text"}},
            "truncation": "disabled", "user": req.user, "prompt_cache_key": req.prompt_cache_key,
            "output": [], "usage": None}


def _finished(env: dict[str, Any], g: Generation, output: list[dict[str, Any]]) -> dict[str, Any]:
    cut = g.finish_reason == "length"
    return {**env, "status": "incomplete" if cut else "completed", "output": output,
            "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(g)}


async def create_response(request: web.Request, engine: EngineClient, metrics: ServerMetrics,
                          body: bytes) -> web.StreamResponse:
    arrival = time.monotonic()
    rid, eid = request_ids(request, "resp", sep="_")
    req = decode(body, ResponsesRequest)
    run = await start_chat(request, engine, metrics, to_chat(req), eid, arrival)
    env = _envelope(rid, req, engine.model_name, int(time.time()))
    g = run.gens[0]
    if req.stream:
        seq = [0]
        return await stream_named(request, _numbered(_events(env, g, run.parser()), seq),
                                  lambda e: {"type": "error", "code": str(e.status), "param": e.param,
                                             "message": e.message, "sequence_number": seq[0]})
    texts, _, _ = await collect(run.gens)
    content, calls = run.calls(texts[0], g.finish_reason)
    status = "incomplete" if g.finish_reason == "length" else "completed"
    output = [_message_item(_id("msg"), content, status)] if content else []
    output += [_call_item(_id("fc"), c.id, c.name, c.arguments, status) for c in calls]
    release_unread_pins(request, engine, run.gens)
    return json_response(with_transfer(_finished(env, g, output), run.gens))


def _numbered(events: AsyncIterator[dict[str, Any]], seq: list[int]
              ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Name each event by its type and number it (``sequence_number``; ``seq[0]`` is the
    next number, for an error event)."""
    async def gen() -> AsyncIterator[tuple[str, dict[str, Any]]]:
        async with contextlib.aclosing(events):
            async for data in events:
                yield data["type"], {**data, "sequence_number": seq[0]}
                seq[0] += 1
    return gen()


async def _events(env: dict[str, Any], g: Generation, parser: StreamingToolParser | None
                  ) -> AsyncIterator[dict[str, Any]]:
    """The Responses event stream: created, in_progress, per output item added / deltas /
    done, then completed (or incomplete)."""
    output: list[dict[str, Any]] = []  # items done
    item: dict[str, Any] | None = None  # the open item

    def close() -> list[dict[str, Any]]:
        nonlocal item
        if item is None:
            return []
        it, item = item, None
        n, out = len(output), []
        if it["type"] == "message":
            text = it["content"][0]["text"]
            base = {"item_id": it["id"], "output_index": n, "content_index": 0}
            out += [{"type": "response.output_text.done", **base, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", **base, "part": it["content"][0]}]
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": it["id"],
                        "output_index": n, "arguments": it["arguments"]})
        it["status"] = "completed"
        output.append(it)
        return out + [{"type": "response.output_item.done", "output_index": n, "item": it}]

    def open_(new: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal item
        out = close()
        item = new
        out.append({"type": "response.output_item.added", "output_index": len(output),
                    "item": {**new, "content": []} if new["type"] == "message" else dict(new)})
        if new["type"] == "message":
            out.append({"type": "response.content_part.added", "item_id": new["id"],
                        "output_index": len(output), "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})
        return out

    async with contextlib.aclosing(pieces(g, parser)) as stream:
        async for p in stream:
            if p.kind == "start":
                yield {"type": "response.created", "response": env}
                yield {"type": "response.in_progress", "response": env}
            elif p.kind == "text":
                if item is None or item["type"] != "message":
                    for ev in open_(_message_item(_id("msg"), "", "in_progress")):
                        yield ev
                item["content"][0]["text"] += p.text
                yield {"type": "response.output_text.delta", "item_id": item["id"],
                       "output_index": len(output), "content_index": 0, "delta": p.text,
                       "logprobs": []}
            elif p.kind == "call":
                for ev in open_(_call_item(_id("fc"), p.call_id, p.name, "", "in_progress")):
                    yield ev
            elif item is not None:  # arguments of the open call
                item["arguments"] += p.text
                yield {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                       "output_index": len(output), "delta": p.text}
    for ev in close():
        yield ev
    done = _finished(env, g, output)
    if done["status"] == "incomplete":
        for it in output:
            it["status"] = "incomplete"
    yield {"type": f"response.{done['status']}", "response": done}
