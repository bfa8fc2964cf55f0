"""Generation and SSE streaming, shared by the handlers (serving_completions.py, serving_chat.py).

A `Generation` runs one prompt through the engine and turns its token deltas into
text deltas (incremental detokenizer + stop strings), observing latency metrics.
Leaving its iteration early for any reason (stop string, client gone, task
cancelled) closes the engine's generator, which aborts the request and frees its
KV blocks. Client disconnects are noticed both by failed SSE writes and by
checking the transport between engine steps (non-streaming requests too).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec
from aiohttp import web

from agentserve.engine.model.constrained import GrammarError, compile_json_grammar
from agentserve.engine.core.engine import EngineDraining
from agentserve.engine.http.metrics import RequestTimer, ServerMetrics
from agentserve.api.openai import (APIError, StreamOptions, _Sampling,
                                        check_length, prompt_logprobs_of)
from agentserve.engine.core.request import RequestOutput, SamplingParams, TokenLogprobs
from agentserve.engine.core.steptrace import request_trace
from agentserve.prompt.tokenizer import IncrementalDetokenizer, Tokenizer


# What a generation hands out per engine step: text, the logprobs of the tokens behind it,
# and those tokens' ids (when asked for: vLLM's return_token_ids).
Delta = tuple[str, list[TokenLogprobs], list[int]]


class EngineClient(Protocol):
    """The part of `agentserve.engine.core.engine.AsyncEngine` the server uses."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, session_id: str | None = None
                 ) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> Any: ...


def sampling_params(req: _Sampling, max_tokens: int, tok: Tokenizer,
                    sample: int = 0) -> SamplingParams:
    """Request fields -> engine SamplingParams (ranges already checked by `check_sampling`;
    here what needs the tokenizer or the resolved max_tokens). ``sample``: which of the
    request's ``n`` samples; a seeded request's sample j draws with seed + j, as vLLM's
    parallel sampling does, so each sample is reproducible and they differ."""
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    bad = [k for k in bias if not 0 <= k < tok.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias token id {bad[0]} is out of range [0, {tok.vocab_size})",
                       "logit_bias")
    if req.min_tokens > max_tokens and not is_prefill_leg(req.kv_transfer_params):
        # (a prefill leg makes its one token whatever the request's min_tokens)
        raise APIError(400, f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})",
                       "min_tokens")
    stop_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < tok.vocab_size]
    if bad:  # (it would never match: a silent no-op for the caller)
        raise APIError(400, f"stop_token_ids token id {bad[0]} is out of range [0, {tok.vocab_size})",
                       "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        seed=None if req.seed is None else req.seed + sample, stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0, logit_bias=bias or None, min_tokens=min(req.min_tokens, max_tokens),
        min_tokens_blocked=sorted(set(tok.eos_token_ids) | set(stop_ids)) if req.min_tokens else [],
        prompt_logprobs=prompt_logprobs_of(req))


def response_format_grammar(req: _Sampling, tok: Tokenizer) -> str | None:
    """The grammar `response_format` asks for (json_object / json_schema), or None for text."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema if fmt.type == "json_schema" and fmt.json_schema else None
    try:
        return compile_json_grammar(tok, schema)
    except GrammarError as e:
        raise APIError(400, str(e), "response_format") from None


def resolve_max_tokens(num_prompt: int, requested: int | None, default: int | None,
                       max_model_len: int, limit: int = 0) -> int:
    """Explicit max_tokens must fit the context; a default is clamped to the room left
    (no default: all of it, as vLLM). ``limit`` (the server's --max-tokens-limit, 0: none)
    then lowers either, as vLLM's ``max_new_tokens`` in ``--generation-config`` does."""
    room = check_length(num_prompt, requested, max_model_len)
    n = room if requested is not None or default is None else min(default, room)
    return min(n, limit) if limit > 0 else n


class Generation:
    """One prompt in the engine, as text deltas; totals are read after iteration."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, request_id: str,
                 prompt_ids: list[int], params: SamplingParams, stop: list[str],
                 alive: Callable[[], bool], arrival: float, session_id: str | None = None,
                 kv_transfer: dict[str, Any] | None = None, token_ids: bool = False) -> None:
        self.engine, self.request_id, self.session_id = engine, request_id, session_id
        self.kv_transfer = kv_transfer
        self.kv_transfer_params: dict[str, Any] | None = None  # set by a finished prefill leg
        self.prompt_ids, self.params = prompt_ids, params
        self.detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids, stop,
                                            skip_ids=set(params.stop_token_ids),
                                            min_tokens=params.min_tokens)
        self.timer = RequestTimer(metrics, arrival)
        self.alive = alive
        self.prompt_tokens, self.cached_tokens, self.completion_tokens = len(prompt_ids), 0, 0
        self.finish_reason: str | None = None
        self.cached_by_tier: dict[str, int] | None = None
        self._lps: list[TokenLogprobs] = []  # of tokens not yet handed out with a delta
        self._ids: list[int] | None = [] if token_ids else None  # the same, their ids
        # the prompt's logprobs, when asked for: set with the first token (None at 0)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def token_ids(self) -> bool:
        """Whether its deltas carry their token ids (the request's return_token_ids)."""
        return self._ids is not None

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                     self.cached_by_tier)

    async def deltas(self) -> AsyncIterator[Delta]:
        """(text, logprobs of the tokens behind it, their ids) as they come; logprobs and
        ids are [] unless the request asked for them, and a token whose text is held back
        (a character in progress, a possible stop string) still hands its logprobs and id
        out with its step."""
        # The session id only travels when given, so engine clients without it still work.
        kw: dict[str, Any] = {"session_id": self.session_id} if self.session_id else {}
        if self.kv_transfer:
            kw["kv_transfer"] = self.kv_transfer
        stream = self.engine.generate(self.request_id, self.prompt_ids, self.params, **kw)
        rtrace = request_trace()  # None unless AGENTSERVE_STEP_TRACE is set (a diagnostic)
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if rtrace is not None:
                        rtrace.record({"api": self.request_id, "recv": self.timer.arrival,
                                       "first": time.perf_counter()})
                        rtrace = None  # the first output only
                    text = self._take(out)
                    if text or self._lps or self._ids:
                        lps, self._lps = self._lps, []
                        ids: list[int] = []
                        if self._ids:
                            ids, self._ids = self._ids, []
                        yield text, lps, ids
                    if self.finish_reason is not None:
                        break
                    if not self.alive():  # client gone: leaving the loop aborts the request
                        self.finish_reason = "abort"
                        break
        except EngineDraining as e:
            raise APIError(503, str(e)) from None
        finally:
            if self.finish_reason not in (None, "abort"):  # as vLLM: finished requests only
                self.timer.on_finish(time.monotonic())

    def _take(self, out: RequestOutput) -> str:
        """Fold one engine delta in; returns its text and sets finish_reason when done."""
        self.cached_tokens = out.num_cached_tokens
        self.cached_by_tier = out.cached_by_tier
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.logprobs:
            self._lps.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.new_token_ids:
            self.timer.on_tokens(out.time)
            self.completion_tokens += len(out.new_token_ids)
            if self._ids is not None:
                self._ids.extend(out.new_token_ids)
        text, stopped = self.detok.push(out.new_token_ids)
        if stopped:
            self.finish_reason = "stop"
        elif out.finished:
            if out.finish_reason == "error":
                raise APIError(500, f"engine error: {out.error}")
            self.finish_reason = out.finish_reason or "stop"
            text += self.detok.flush()
        return text


def usage(prompt: int, completion: int, cached: int,
          by_tier: dict[str, int] | None = None) -> dict[str, Any]:
    """OpenAI usage; with offload tiers, ``cached_tokens_by_tier`` (gpu/cpu/disk) is added."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if by_tier is not None:
        details["cached_tokens_by_tier"] = by_tier
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": details}


def sum_usage(gens: list[Generation], n: int = 1) -> dict[str, Any]:
    """Usage of a request's generations, ``n`` consecutive ones per prompt. As vLLM counts
    parallel sampling, a prompt counts once however many samples it has; its cached tokens
    are those of the sample that found the fewest (the one that computed the prompt: the
    others waited for it and hit it)."""
    tiers: dict[str, int] | None = None
    prompt = cached = 0
    for k in range(0, len(gens), n):
        g = min(gens[k:k + n], key=lambda x: x.cached_tokens)
        prompt, cached = prompt + g.prompt_tokens, cached + g.cached_tokens
        if g.cached_by_tier is not None:
            tiers = tiers or {}
            for t, m in g.cached_by_tier.items():
                tiers[t] = tiers.get(t, 0) + m
    return usage(prompt, sum(g.completion_tokens for g in gens), cached, tiers)


def is_prefill_leg(params: dict[str, Any] | None) -> bool:
    """`kv_transfer_params` of a P/D prefill leg (do_remote_decode)?"""
    return bool(params and params.get("do_remote_decode"))


def pd_max_tokens(params: dict[str, Any] | None, max_tokens: int) -> int:
    """A prefill leg produces one token, as vLLM's P/D proxy asks."""
    return 1 if is_prefill_leg(params) else max_tokens


def with_transfer(body: dict[str, Any], gens: list[Generation]) -> dict[str, Any]:
    """Add the prefill leg's ``kv_transfer_params`` to a response body, as vLLM does."""
    params = next((g.kv_transfer_params for g in gens if g.kv_transfer_params), None)
    return {**body, "kv_transfer_params": params} if params is not None else body


def release_unread_pins(request: web.Request, engine: EngineClient,
                        gens: list[Generation]) -> None:
    """A prefill leg whose client left before its answer: nobody will learn its params, so
    nobody would pull its pinned KV. Free it now instead of at --kv-transfer-timeout."""
    release = getattr(engine, "release_transfer", None)
    if release is None or client_alive(request)():
        return
    for g in gens:
        rid = (g.kv_transfer_params or {}).get("remote_request_id")
        if rid:
            release(str(rid))


def session_of(request: web.Request, user: str | None) -> str | None:
    """The agent session: ``x-session-id`` header, else the body's ``user`` (as the router)."""
    return request.headers.get("x-session-id") or user or None


async def merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta | None]]:
    """Interleave several delta streams as (index, delta); (index, None) marks an end.

    Closing the merged stream cancels the pumps, which closes every generation.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for d in streams[0]:
                yield 0, d
        yield 0, None
        return
    q: asyncio.Queue[tuple[int, Delta | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(s):
                async for d in s:
                    await q.put((i, d, None))
            await q.put((i, None, None))
        except Exception as e:  # re-raised in the consumer
            await q.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, d, err = await q.get()
            if err is not None:
                raise err
            left -= d is None
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(gens: list[Generation]
                  ) -> tuple[list[str], list[list[TokenLogprobs]], list[list[int]]]:
    """Run the generations to their ends: each one's whole text, logprobs and token ids
    (the last two empty unless asked for)."""
    texts, lps, ids = [""] * len(gens), [[] for _ in gens], [[] for _ in gens]
    async with contextlib.aclosing(merge([g.deltas() for g in gens])) as merged:
        async for i, d in merged:
            if d is not None:
                texts[i] += d[0]
                lps[i] += d[1]
                ids[i] += d[2]
    return texts, lps, ids


class SSE:
    """Server-sent events; the response is prepared lazily so that an error before
    the first chunk can still be a plain JSON error with a proper status."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None

    async def send(self, obj: dict[str, Any], event: str | None = None) -> None:
        """One event: ``data: JSON``, after an ``event: NAME`` line when named (Anthropic's)."""
        if self.resp is None:
            self.resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await self.resp.prepare(self.request)
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self.resp.write(head + b"data: " + msgspec.json.encode(obj) + b"\n\n")

    async def close(self) -> web.StreamResponse:
        assert self.resp is not None
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


async def stream_sse(request: web.Request,
                     events: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    """Write each event as it comes; errors after the first byte become an error event."""
    sse = SSE(request)
    try:
        async with contextlib.aclosing(events):
            async for obj in events:
                await sse.send(obj)
    except APIError as e:
        if sse.resp is None:
            raise
        await sse.send(e.body())
    except ConnectionResetError:  # client went away; closing `events` aborted the request
        return sse.resp or web.StreamResponse()
    if sse.resp is None:
        await sse.send({"choices": []})  # nothing was produced at all; keep the stream valid
    return await sse.close()


async def stream_named(request: web.Request, events: AsyncIterator[tuple[str, dict[str, Any]]],
                       error_event: Callable[[APIError], dict[str, Any]]) -> web.StreamResponse:
    """Named events (``event: NAME`` then ``data: JSON``, no ``[DONE]``: Anthropic's and the
    Responses API's streams); an error after the first byte is an ``error`` event."""
    sse = SSE(request)
    try:
        async with contextlib.aclosing(events):
            async for name, data in events:
                await sse.send(data, event=name)
    except APIError as e:
        if sse.resp is None:
            raise
        await sse.send(error_event(e), event="error")
    except ConnectionResetError:  # the client left; closing `events` aborted the request
        return sse.resp or web.StreamResponse()
    assert sse.resp is not None
    await sse.resp.write_eof()
    return sse.resp


def client_alive(request: web.Request) -> Callable[[], bool]:
    def alive() -> bool:
        transport = request.transport
        return transport is not None and not transport.is_closing()
    return alive


def json_response(obj: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status,
                        content_type="application/json")


def usage_mode(opts: StreamOptions | None) -> tuple[bool, bool]:
    """(a final usage chunk, usage so far in every chunk), as vLLM reads stream_options:
    continuous_usage_stats counts only with include_usage."""
    final = bool(opts and opts.include_usage)
    return final, final and bool(opts and opts.continuous_usage_stats)
