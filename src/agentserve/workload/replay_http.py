"""The replay client's HTTP side: one aiohttp session, streamed OpenAI requests, /metrics scrapes.

SSE is read line by line as it arrives and each `data:` line is decoded once with a
typed msgspec decoder that skips every field we do not need (text is never
concatenated, token ids are only counted). Times come from `time.perf_counter`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import aiohttp
import msgspec

from agentserve.workload.record import RequestRecord

METRICS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions",
           "vllm:kv_cache_usage_perc")


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content
    tool_calls: list[_ToolCall] | None = None

    def has_output(self) -> bool:
        """Whether this delta carries generated text: content, reasoning, or a tool call's
        name or arguments. A role-only first delta (`content: ""`, as vLLM and we send it)
        carries none."""
        if self.content or self.reasoning_content or self.reasoning:
            return True
        return any(t.function is not None and (t.function.name or t.function.arguments)
                   for t in self.tool_calls or ())


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None  # vLLM `return_token_ids`, our engine, the stub


class _Error(msgspec.Struct):
    message: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _chunk_tokens(chunk: _Chunk) -> int:
    """Tokens in one chunk: its token ids when sent, else 1 per choice with output.

    The first chunk with a token starts TTFT's clock, as in AIPerf 0.13.0: its TTFT is
    `content_responses[0].perf_ns - start_perf_ns` (metrics/types/ttft_metric.py), where a
    content response is an SSE message whose parsed data is not empty
    (common/models/record_models.py `content_responses`); a chat delta counts for its
    content, its reasoning or a tool call's name/arguments (endpoints/openai_chat.py
    `extract_chat_response_data`), so a role-only first delta and a usage-only chunk do not.
    """
    n = 0
    for c in chunk.choices:
        if c.token_ids is not None:
            n += len(c.token_ids)
        elif c.text or (c.delta is not None and c.delta.has_output()):
            n += 1
    return n


def connect_error(base: str, e: aiohttp.ClientError) -> str:
    """One line a user can act on: `cannot connect to URL: connection refused` (no aiohttp
    `ssl:default` noise); other client errors keep their own text."""
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error
        if isinstance(err, socket.gaierror):
            why = f"cannot resolve host {e.host!r}"
        elif err.errno:
            why = os.strerror(err.errno).lower()
        else:
            why = str(err) or type(err).__name__
        return f"cannot connect to {base}: {why}"
    return f"connection error: {type(e).__name__}: {e}"


def base_url(url: str) -> str:
    """Accept `http://h:p`, `http://h:p/` or `http://h:p/v1`."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def parse_prometheus(text: str, names: tuple[str, ...] = METRICS) -> dict[str, float]:
    """Sum each named metric over its label sets; counters may carry the `_total` suffix."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name.endswith("_total"):
            name = name[:-6]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


class Target:
    """An OpenAI-compatible endpoint reached through one aiohttp ClientSession."""

    def __init__(self, url: str, api: str = "completions", api_key: str | None = None,
                 model: str | None = None, request_timeout: float = 600.0, limit: int = 256,
                 trace_configs: list[aiohttp.TraceConfig] | None = None) -> None:
        self.base = base_url(url)
        self.api = api
        self.model = model
        self.request_timeout = request_timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._limit = limit
        self._trace_configs = trace_configs  # aiohttp request tracing, for client diagnostics
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Target":
        # Connector limit sized to the concurrency: more sockets than streams is waste,
        # fewer would queue requests inside the client and inflate TTFT.
        conn = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, ttl_dns_cache=3600)
        self.session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None),
                                             trace_configs=self._trace_configs)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    @property
    def endpoint(self) -> str:
        return f"{self.base}/v1/chat/completions" if self.api == "chat" else f"{self.base}/v1/completions"

    async def engines(self) -> int | None:
        """Engines behind the URL when it says (our router's /health lists them), else None.
        Also the run's first contact: an unreachable URL raises RuntimeError with one line."""
        assert self.session is not None
        try:
            async with self.session.get(f"{self.base}/health", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                data = await r.json(content_type=None) if r.status in (200, 503) else None
        except aiohttp.ClientConnectorError as e:
            raise RuntimeError(connect_error(self.base, e)) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None  # reachable, but no JSON health: not a router
        if isinstance(data, dict) and isinstance(data.get("healthy"), list):
            return len(data["healthy"]) + len(data.get("unhealthy") or [])
        return None

    async def resolve_model(self) -> str:
        """`--model`, else the first id served at /v1/models."""
        if self.model:
            return self.model
        assert self.session is not None
        async with self.session.get(f"{self.base}/v1/models", headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {self.base}/v1/models answered {r.status}; pass --model")
            data = await r.json()
        if not data.get("data"):
            raise RuntimeError(f"{self.base}/v1/models lists no model; pass --model")
        self.model = str(data["data"][0]["id"])
        return self.model

    async def scrape_metrics(self) -> dict[str, float]:
        """The vLLM counters we track, or {} when the target has no /metrics."""
        assert self.session is not None
        try:
            async with self.session.get(f"{self.base}/metrics",
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return {}
                return parse_prometheus(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return {}

    async def send(self, rec: RequestRecord, body: dict, t0: float) -> None:
        """Stream one request, filling `rec`; never raises except on cancellation."""
        assert self.session is not None
        # Prepare everything first, then stamp the start: TTFT is measured from the moment
        # the request is handed to the connection, as AIPerf does, not from JSON encoding.
        payload = msgspec.json.encode(body)
        headers = dict(self.headers, **{"X-Request-Id": rec.request_id})
        if body.get("user"):
            headers["x-session-id"] = str(body["user"])
        start = time.perf_counter()
        rec.start = start - t0
        try:
            async with asyncio.timeout(self.request_timeout):
                async with self.session.post(self.endpoint, data=payload, headers=headers) as resp:
                    rec.status = resp.status
                    if resp.status != 200:
                        rec.error = await _error_text(resp)
                    else:
                        await _read_stream(resp, rec, start)
        except TimeoutError:
            rec.error = f"timeout after {self.request_timeout:g}s (--request-timeout)"
        except aiohttp.ClientError as e:
            rec.error = connect_error(self.base, e)
        except asyncio.CancelledError:
            rec.error = "cancelled (run stopped before the response ended)"
            raise
        finally:
            rec.e2e = time.perf_counter() - start


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    """`HTTP 400: <the server's error message>` from an OpenAI error object, else the raw body."""
    raw = await resp.read()
    try:
        msg = msgspec.json.decode(raw).get("error", {}).get("message")
    except (msgspec.DecodeError, AttributeError):
        msg = None
    return f"HTTP {resp.status}: {msg or raw[:300].decode(errors='replace').strip() or resp.reason}"


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
    """Consume the SSE stream: chunk times and token counts, then the usage chunk.

    One await per network read, not per line: events that arrived together are split
    from the same buffer and share its arrival time (they did arrive together).
    """
    times, toks = rec.chunk_times, rec.chunk_tokens
    done = False
    usage: _Usage | None = None
    tail = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        lines = (tail + data).split(b"\n") if tail else data.split(b"\n")
        tail = lines.pop()  # an incomplete last line waits for the next read
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True  # read on to EOF: a fully read response returns its connection
                continue
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError as e:
                rec.error = f"bad SSE chunk: {e}"
                return
            if chunk.error is not None:
                rec.error = f"stream error: {chunk.error.message}"
                return
            if chunk.usage is not None:
                usage = chunk.usage
            n = _chunk_tokens(chunk)
            if n:
                if rec.ttft is None:
                    rec.ttft = now - start
                times.append(now - start)
                toks.append(n)
    _finish(rec, usage, done)


def _finish(rec: RequestRecord, usage: _Usage | None, done: bool) -> None:
    """Token counts from the usage chunk (authoritative) or the chunks themselves."""
    rec.output_tokens = sum(rec.chunk_tokens)
    if usage is not None:
        rec.output_tokens = usage.completion_tokens or rec.output_tokens
        rec.input_tokens = usage.prompt_tokens or rec.input_tokens
        if usage.prompt_tokens_details is not None:
            rec.cached_tokens = usage.prompt_tokens_details.cached_tokens or 0
    if not done:
        rec.error = "stream ended before data: [DONE]"
