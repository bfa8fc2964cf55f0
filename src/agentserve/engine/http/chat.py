"""The /v1/chat/completions handler: chat template, tool calls, streaming deltas.

Tools are rendered into the prompt and parsed out of the answer unless tool_choice
is "none" (then they are neither rendered nor parsed). "required" and a named
function add a grammar constraint (constrained.py); every tool schema is checked
by compiling it, so a bad schema is a 400 whatever the tool_choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from agentserve.prompt.chat import chat_messages, chat_prompt_ids
from agentserve.engine.model.constrained import GrammarConstraint, GrammarError, compile_tool_grammar
from agentserve.engine.model.logprobs import chat_logprobs, prompt_logprobs
from agentserve.engine.http.metrics import ServerMetrics
from agentserve.api.openai import (APIError, ChatRequest, NamedToolChoice, StreamOptions,
                                        check_chat, decode, stop_list)
from agentserve.api.request_id import request_ids
from agentserve.engine.http.serving import (EngineClient, Generation, client_alive, collect,
                                       json_response, merge, pd_max_tokens, release_unread_pins,
                                       resolve_max_tokens, response_format_grammar,
                                       sampling_params, session_of, stream_sse, sum_usage,
                                       usage_mode, with_transfer)
from agentserve.prompt.tokenizer import Tokenizer
from agentserve.api.kv_transfer import admit, policy_of
from agentserve.engine.model.tools import (StreamingToolParser, ToolCall, parse_cut_calls,
                                          parse_tool_calls)


def tool_grammar(tok: Tokenizer, tools: list[dict[str, Any]], req: ChatRequest) -> str | None:
    """Validate the tool schemas; the grammar for "required" or a named function."""
    choice = req.tool_choice or "auto"
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    try:
        grammar = compile_tool_grammar(tok, tools, name, req.parallel_tool_calls)
        return None if choice == "auto" else grammar
    except GrammarError as e:
        raise APIError(400, str(e), "tools") from None


@dataclass(slots=True)
class ChatRun:
    """A chat request under way: its prompt's ids and one generation per sample."""

    ids: list[int]
    gens: list[Generation]
    use_tools: bool  # tool calls are parsed out of the answers
    forced: bool = False  # decoding is constrained to calls ("required" or a named function)
    name: str | None = None  # the named function

    def parser(self) -> StreamingToolParser | None:
        """A streaming parser for one answer (None without tools)."""
        return StreamingToolParser(self.forced, self.name) if self.use_tools else None

    def calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer. A constrained one is read by the streaming
        parser, so both answers agree: no content, and a call cut short (max_tokens, a stop
        string) keeps its partial arguments (no markup in the content), as vLLM."""
        if not self.use_tools:
            return text, []
        if self.forced:
            return parse_cut_calls(text, self.name)
        return parse_tool_calls(text)


async def create_chat(request: web.Request, engine: EngineClient, metrics: ServerMetrics,
                      body: bytes) -> web.StreamResponse:
    arrival = time.monotonic()
    cid, eid = request_ids(request, "chatcmpl")
    req = decode(body, ChatRequest)
    run = await start_chat(request, engine, metrics, req, eid, arrival)
    tok, ids, gens = engine.tokenizer, run.ids, run.gens
    base = {"id": cid, "object": "chat.completion", "created": int(time.time()),
            "model": engine.model_name}
    if req.stream:
        base["object"] = "chat.completion.chunk"
        return await stream_sse(request, _chat_events(base, gens, run, req.stream_options,
                                                      tok if req.logprobs else None))
    texts, lps, out_ids = await collect(gens)
    choices = []
    for i, (g, text) in enumerate(zip(gens, texts)):
        content, calls = run.calls(text, g.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        finish = "tool_calls" if calls and g.finish_reason == "stop" else g.finish_reason
        choices.append({"index": i, "message": message, "finish_reason": finish,
                        "logprobs": chat_logprobs(tok, lps[i]) if req.logprobs else None,
                        **({"token_ids": out_ids[i]} if req.return_token_ids else {})})
    release_unread_pins(request, engine, gens)
    answer = {**base, "choices": choices, "usage": sum_usage(gens, len(gens))}
    if req.prompt_logprobs is not None:  # (vLLM puts them beside the choices: one prompt)
        answer["prompt_logprobs"] = prompt_logprobs(tok, gens[0].prompt_logprobs or [None])
    if req.return_token_ids:  # (the same, with the choices' own token_ids)
        answer["prompt_token_ids"] = ids
    return json_response(with_transfer(answer, gens))


async def start_chat(request: web.Request, engine: EngineClient, metrics: ServerMetrics,
                     req: ChatRequest, eid: str, arrival: float) -> ChatRun:
    """Check ``req``, render its prompt (chat template, tools), compile its grammar and set
    up one generation per sample (not started: iterating one runs it). Shared by
    /v1/chat/completions, /v1/messages and /v1/responses, which differ only in their
    answers' shapes."""
    check_chat(req)
    admit(req.kv_transfer_params, request.headers, policy_of(engine))  # an internal path
    tok = engine.tokenizer
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [msgspec.to_builtins(t) for t in req.tools or []] if use_tools else None
    ids = await chat_prompt_ids(engine, chat_messages(req.messages), tools,
                                req.add_generation_prompt, req.continue_final_message)
    requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    max_tokens = pd_max_tokens(req.kv_transfer_params,
                               resolve_max_tokens(len(ids), requested, None, engine.max_model_len,
                                                  getattr(engine, "max_tokens_limit", 0)))
    if tools:
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, "response_format json_object / json_schema cannot be combined "
                           "with tools (a tool call is not that JSON); send tool_choice 'none' "
                           "or drop one of them", "response_format")
        grammar = await asyncio.to_thread(tool_grammar, tok, tools, req)
    else:
        grammar = await asyncio.to_thread(response_format_grammar, req, tok)
    choice = req.tool_choice
    named = choice.function.name if tools and isinstance(choice, NamedToolChoice) else None
    gens = []
    for j in range(req.n):  # n samples: n engine requests over one prompt (computed once)
        params = sampling_params(req, max_tokens, tok, j)
        params.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if grammar is not None:  # one matcher per sample: it follows that sample's output
            params.constraint = GrammarConstraint(tok, grammar)
        gens.append(Generation(engine, metrics, eid if req.n == 1 else f"{eid}-{j}", ids, params,
                               stop_list(req.stop), client_alive(request), arrival,
                               session_of(request, req.user), req.kv_transfer_params,
                               bool(req.return_token_ids)))
    return ChatRun(ids, gens, use_tools, bool(tools) and grammar is not None, named)


def _chat_deltas(parser: StreamingToolParser | None, text: str, end: bool = False) -> list[dict]:
    if parser is None:
        return [{"content": text}] if text else []
    content, calls = parser.finish() if end else parser.feed(text)
    return ([{"content": content}] if content else []) + ([{"tool_calls": calls}] if calls else [])


async def _chat_events(base: dict[str, Any], gens: list[Generation], run: ChatRun,
                       opts: StreamOptions | None, lp_tok: Tokenizer | None
                       ) -> AsyncIterator[dict[str, Any]]:
    """Each choice: its role first (with its first text, so that an early error stays a
    plain JSON error), its deltas, then its finish; choices interleave as they come. With
    logprobs (``lp_tok``), a step's ride on its first chunk (an empty delta when the tool
    parser holds its text back), and so do its token ids, when asked for (the very first
    chunk then carries the prompt's, as vLLM)."""
    include_usage, every = usage_mode(opts)
    with_ids = bool(gens) and gens[0].token_ids
    prompt_ids: list[int] | None = gens[0].prompt_ids if with_ids else None

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None,
              lps: list | None = None, ids: list[int] | None = None) -> dict[str, Any]:
        nonlocal prompt_ids
        logprobs = chat_logprobs(lp_tok, lps) if lp_tok is not None and lps else None
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        extra = {"usage": sum_usage(gens, len(gens)) if every else None} if include_usage else {}
        if with_ids:
            choice["token_ids"] = ids or []
            if prompt_ids is not None:
                extra["prompt_token_ids"], prompt_ids = prompt_ids, None
        return {**base, "choices": [choice], **extra}

    parsers = [run.parser() for _ in gens]
    started = [False] * len(gens)
    async with contextlib.aclosing(merge([g.deltas() for g in gens])) as merged:
        async for i, d in merged:
            if not started[i]:
                started[i] = True
                yield chunk(i, {"role": "assistant", "content": ""})
            if d is not None:
                text, lps, ids = d
                out = _chat_deltas(parsers[i], text) or ([{}] if lps or ids else [])
                for k, delta in enumerate(out):
                    yield chunk(i, delta, lps=lps if k == 0 else None, ids=ids if k == 0 else None)
                continue
            for delta in _chat_deltas(parsers[i], "", end=True):  # choice i has ended
                yield chunk(i, delta)
            p, g = parsers[i], gens[i]
            calls = p is not None and p.calls
            yield chunk(i, {}, "tool_calls" if calls and g.finish_reason == "stop" else g.finish_reason)
    if include_usage:
        yield {**base, "choices": [], "usage": sum_usage(gens, len(gens))}
