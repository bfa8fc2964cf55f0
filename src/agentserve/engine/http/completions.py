"""The /v1/completions handler: text or token-id prompts (or a list of them), n samples each."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from agentserve.prompt.chat import chat_prompts
from agentserve.engine.model.constrained import GrammarConstraint
from agentserve.engine.model.logprobs import completion_logprobs, echoed, prompt_logprobs
from agentserve.engine.http.metrics import ServerMetrics
from agentserve.api.openai import (APIError, CompletionRequest, StreamOptions,
                                        check_completion, check_prompt_ids, decode, stop_list)
from agentserve.api.request_id import request_ids
from agentserve.engine.http.serving import (EngineClient, Generation, client_alive, collect,
                                       json_response, merge, pd_max_tokens, release_unread_pins,
                                       resolve_max_tokens, response_format_grammar,
                                       sampling_params, session_of, stream_sse, sum_usage,
                                       usage_mode, with_transfer)
from agentserve.engine.core.request import TokenLogprobs
from agentserve.prompt.tokenizer import Tokenizer
from agentserve.api.kv_transfer import admit, policy_of


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(prompt: str | list[Any], tok: Tokenizer, add_special_tokens: bool = True,
                       encode: Callable[[str, bool], list[int]] | None = None) -> list[list[int]]:
    """Text, token ids, or a list of either -> one token-id list per prompt. Text gets the
    tokenizer's special tokens (a BOS, where its post-processor adds one) unless told not
    to, as vLLM and the router tokenize it; token ids are taken as sent. ``encode``:
    how text becomes ids (default ``tok.encode``; the server's is incremental)."""
    encode = encode or tok.encode
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, str) or (_is_ids(p) and p) for p in prompt):
        items = list(prompt)
    else:
        raise APIError(400, "prompt must be a non-empty string, a list of token ids, or a list "
                       "of those", "prompt")
    out = []
    for item in items:
        ids = encode(item, add_special_tokens) if isinstance(item, str) else item
        check_prompt_ids(ids, tok.vocab_size)
        out.append(ids)
    return out


def _prompt_texts(prompt: str | list[Any], ids: list[list[int]], tok: Tokenizer) -> list[str]:
    """Each prompt as echo shows it: a text prompt as sent, token ids decoded."""
    items = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)
    return [item if isinstance(item, str) else tok.decode(p, skip_special_tokens=False)
            for item, p in zip(items, ids)]


class _Echo:
    """``echo``: each choice's text starts with its prompt (and its logprobs with the
    prompt's); with max_tokens 0 that is all it holds (the engine makes one token, as
    vLLM's does, that is not shown)."""

    def __init__(self, texts: list[str], ids: list[list[int]], n: int, only: bool) -> None:
        self.texts, self.ids, self.n, self.only = texts, ids, n, only

    def head(self, i: int, g: Generation) -> tuple[str, list[TokenLogprobs | int]]:
        """Choice ``i``'s prompt text and logprob entries."""
        p = i // self.n
        return self.texts[p], echoed(self.ids[p], g.prompt_logprobs)


async def create_completion(request: web.Request, engine: EngineClient,
                            metrics: ServerMetrics, body: bytes) -> web.StreamResponse:
    arrival = time.monotonic()
    cid, eid = request_ids(request, "cmpl")
    req = decode(body, CompletionRequest)
    check_completion(req)
    admit(req.kv_transfer_params, request.headers, policy_of(engine))  # an internal path
    session = session_of(request, req.user)
    prompts = await asyncio.to_thread(  # (a long text prompt's tokens: not the event loop's)
        completion_prompts, req.prompt, engine.tokenizer, req.add_special_tokens,
        lambda text, special: chat_prompts(engine).text_ids(text, special, session))
    if req.kv_transfer_params and len(prompts) > 1:
        raise APIError(400, "kv_transfer_params needs a single prompt", "kv_transfer_params")
    grammar = await asyncio.to_thread(response_format_grammar, req, engine.tokenizer)
    tok = engine.tokenizer
    echo = _Echo(_prompt_texts(req.prompt, prompts, tok), prompts, req.n,
                 req.max_tokens == 0) if req.echo else None
    gens, n = [], req.n
    for i, ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, 16, engine.max_model_len,
                                        getattr(engine, "max_tokens_limit", 0))
        max_tokens = max(pd_max_tokens(req.kv_transfer_params, max_tokens), 1)  # (echo: 0 -> 1)
        for j in range(n):  # choice i * n + j, as OpenAI orders them
            params = sampling_params(req, max_tokens, engine.tokenizer, j)
            params.logprobs = req.logprobs
            if grammar is not None:  # one matcher per sample: it follows that sample's output
                params.constraint = GrammarConstraint(engine.tokenizer, grammar)
            gens.append(Generation(engine, metrics, f"{eid}-{i * n + j}", ids, params,
                                   stop_list(req.stop), client_alive(request), arrival,
                                   session, req.kv_transfer_params,
                                   bool(req.return_token_ids)))
    base = {"id": cid, "object": "text_completion", "created": int(time.time()),
            "model": engine.model_name}
    if req.stream:
        return await stream_sse(request, _completion_events(
            base, gens, n, req.stream_options, tok if req.logprobs is not None else None,
            req.logprobs, echo))
    texts, lps, out_ids = await collect(gens)
    choices = []
    for i, g in enumerate(gens):
        text = texts[i]
        entries: list[TokenLogprobs | int] = list(lps[i])
        if echo is not None:
            head, head_lps = echo.head(i, g)
            text, entries = (head, head_lps) if echo.only else (head + text, head_lps + entries)
        choice = {"index": i, "text": text, "finish_reason": g.finish_reason,
                  "logprobs": None if req.logprobs is None
                  else completion_logprobs(tok, entries, 0, req.logprobs)[0]}
        if g.params.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tok, g.prompt_logprobs or [None])
        if req.return_token_ids:  # (echo with max_tokens 0: the token made is not shown)
            choice["prompt_token_ids"] = g.prompt_ids
            choice["token_ids"] = [] if echo is not None and echo.only else out_ids[i]
        choices.append(choice)
    release_unread_pins(request, engine, gens)
    return json_response(with_transfer({**base, "choices": choices, "usage": sum_usage(gens, n)},
                                       gens))


async def _completion_events(base: dict[str, Any], gens: list[Generation], n: int,
                             opts: StreamOptions | None, lp_tok: Tokenizer | None,
                             lp_k: int | None = None, echo: _Echo | None = None
                             ) -> AsyncIterator[dict[str, Any]]:
    """``lp_tok``: the tokenizer when the request asked for ``lp_k`` logprobs (else None). With
    ``echo`` a choice's first chunk (its last, if it had none before) starts with its prompt.
    With token ids asked for, each chunk carries its tokens' (``token_ids``) and a choice's
    first its prompt's (``prompt_token_ids``), as vLLM."""
    include_usage, every = usage_mode(opts)
    offsets = [0] * len(gens)  # each choice's text_offset so far
    unechoed = set(range(len(gens))) if echo is not None else set()
    unprompted = set(range(len(gens))) if gens and gens[0].token_ids else None
    async with contextlib.aclosing(merge([g.deltas() for g in gens])) as merged:
        async for i, d in merged:
            text, lps, ids = d if d is not None else ("", [], [])
            if echo is not None:
                if echo.only:
                    text, lps, ids = "", [], []
                if i in unechoed:
                    unechoed.discard(i)
                    head, head_lps = echo.head(i, gens[i])
                    text, lps = head + text, [*head_lps, *lps]
                elif d is not None and not text and not lps:
                    continue  # the token that echo-only hides
            finish = gens[i].finish_reason if d is None else None
            logprobs = None
            if lp_tok is not None and lps:
                logprobs, offsets[i] = completion_logprobs(lp_tok, lps, offsets[i], lp_k)
            choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
            if unprompted is not None:
                choice["token_ids"] = ids
                if i in unprompted:
                    unprompted.discard(i)
                    choice["prompt_token_ids"] = gens[i].prompt_ids
            extra = {"usage": sum_usage(gens, n) if every else None} if include_usage else {}
            yield {**base, "choices": [choice], **extra}
    if include_usage:
        yield {**base, "choices": [], "usage": sum_usage(gens, n)}
