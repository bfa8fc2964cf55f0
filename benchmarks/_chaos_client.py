"""The chaos suite's client: agent sessions over streamed chat and messages, retried as an
SDK retries, with every read bounded.

A turn's request is retried while it fails before its stream begins (refused or reset
while the router is down, a 5xx or 429 answer, no answer within the read timeout) up to
`RetryPolicy.tries` times within `window_s`, with doubling backoff, as the OpenAI and
Anthropic SDKs retry. Once a 200 stream has begun it is the user's: a break (an error
event, or a connection closed before the API's end marker: OpenAI's `data: [DONE]`,
Anthropic's `message_stop`) ends the turn with that error. A read that waits longer than
`read_timeout_s` is a hang (counted; the checks want none).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}
WORDS = ("read the file then run the tests and fix the failing import in the module where "
         "the parser builds its table of tokens from each line of the source while the "
         "cache keeps every block it has seen before so that a second request finds them "
         "again without computing the prefix once more").split()


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    """How a turn is retried before its stream begins, and how long any read may wait."""

    tries: int = 10
    window_s: float = 30.0  # no new try starts later than this after the first
    initial_s: float = 0.25
    max_s: float = 4.0
    read_timeout_s: float = 60.0  # the answer's head, and each chunk after it
    total_s: float = 300.0  # one try, whole


@dataclass(slots=True)
class Outcome:
    """One turn as the user saw it. `status`: ok | failed_started (the stream began, then
    broke with `error`) | lost (never started within the retry bound) | bad_status (a 4xx:
    the client's fault, which this load never makes)."""

    status: str = "lost"
    t0: float = 0.0  # time.monotonic() of the first try
    tries: int = 0
    hangs: int = 0  # tries or streams cut by the read timeout
    error: str = ""
    retry_errors: list[str] = field(default_factory=list)
    ttft_s: float | None = None  # first content of the try that started
    text: str = ""
    prompt_tokens: int = 0
    cached: int | None = None  # the engine's cached tokens (usage)
    predicted: int | None = None  # x-agentserve-predicted-cached, when the router sent it
    endpoint: str = ""
    pd: str = ""  # x-agentserve-pd (a P/D split, its prefill engine)


class AgentSession:
    """One agent's conversation: a long system prompt, then short user turns; each turn
    re-sends the whole context (the previous answers included) and adds a little."""

    def __init__(self, sid: str, api: str, seed: int, system_words: int = 220,
                 max_context: int = 3000) -> None:
        self.sid, self.api, self.max_context = sid, api, max_context
        self.rng, self.system_words, self.generation = random.Random(seed), system_words, 0
        self.system, self.messages = "", []
        self.reset()

    def reset(self) -> None:
        """A new conversation (the context reached `max_context` tokens)."""
        self.generation += 1
        words = [self.rng.choice(WORDS) for _ in range(self.system_words)]
        self.system = f"agent {self.sid}-{self.generation}: " + " ".join(words)
        self.messages: list[dict[str, str]] = []

    def next_turn(self, max_tokens: int) -> tuple[dict[str, Any], str]:
        """(request body, the new user message) of the next turn."""
        user = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(12, 30)))
        msgs = [*self.messages, {"role": "user", "content": user}]
        if self.api == "chat":
            body = {"messages": [{"role": "system", "content": self.system}, *msgs],
                    "stream_options": {"include_usage": True}}
        else:
            body = {"system": self.system, "messages": msgs}
        return {**body, "max_tokens": max_tokens, "stream": True, "temperature": 0}, user

    def commit(self, user: str, out: Outcome) -> None:
        """Keep a finished turn in the context; start over once the context is long."""
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": out.text or "ok"}]
        if out.prompt_tokens > self.max_context:
            self.reset()


class _Stream:
    """What one streamed answer said, parsed line by line (chat or messages)."""

    def __init__(self, api: str) -> None:
        self.api, self.event, self.done = api, "", False
        self.error: str | None = None
        self.text: list[str] = []
        self.cached: int | None = None
        self.prompt_tokens = 0
        self.first: float | None = None

    def line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r\n")
        if line.startswith("event: "):
            self.event = line[7:]
            return
        if not line.startswith("data: "):
            return
        if self.first is None:
            self.first = time.monotonic()
        if line == "data: [DONE]":
            self.done = self.api == "chat"
            return
        try:
            obj = json.loads(line[6:])
        except ValueError:
            self.error = self.error or f"undecodable event: {line[:80]!r}"
            return
        (self._chat if self.api == "chat" else self._messages)(obj)

    def _chat(self, obj: dict[str, Any]) -> None:
        if "error" in obj:
            self.error = str((obj["error"] or {}).get("message", obj["error"]))
        for ch in obj.get("choices") or []:
            self.text.append((ch.get("delta") or {}).get("content") or "")
        if usage := obj.get("usage"):
            self.prompt_tokens = usage.get("prompt_tokens", 0)
            self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    def _messages(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "message_start":
            usage = obj["message"]["usage"]
            self.cached = usage.get("cache_read_input_tokens")
            self.prompt_tokens = usage.get("input_tokens", 0) + (self.cached or 0)
        elif kind == "content_block_delta" and obj["delta"].get("type") == "text_delta":
            self.text.append(obj["delta"]["text"])
        elif kind == "error" or self.event == "error":
            self.error = str((obj.get("error") or {}).get("message", obj))
        elif kind == "message_stop":
            self.done = True


async def _try(http: aiohttp.ClientSession, url: str, api: str, body: dict[str, Any],
               headers: dict[str, str], policy: RetryPolicy, out: Outcome) -> str | None:
    """One try; None when it ended the turn (`out` filled), else why it may be retried."""
    timeout = aiohttp.ClientTimeout(total=policy.total_s, sock_connect=5,
                                    sock_read=policy.read_timeout_s)
    t0 = time.monotonic()
    try:
        async with http.post(url + PATHS[api], json=body, headers=headers,
                             timeout=timeout) as r:
            if r.status >= 500 or r.status == 429:
                return f"HTTP {r.status}: {(await r.text())[:160]}"
            if r.status != 200:
                out.status, out.error = "bad_status", f"HTTP {r.status}: {(await r.text())[:300]}"
                return None
            out.endpoint = r.headers.get("x-agentserve-endpoint", "")
            out.pd = r.headers.get("x-agentserve-pd", "")
            if (p := r.headers.get("x-agentserve-predicted-cached")) is not None:
                out.predicted = int(p)
            return await _read(r, api, t0, out)
    except asyncio.TimeoutError:
        out.hangs += 1
        return f"no answer within {policy.read_timeout_s:.0f} s (a hang)"
    except (aiohttp.ClientError, OSError) as e:
        return f"{type(e).__name__}: {e}"


async def _read(r: aiohttp.ClientResponse, api: str, t0: float, out: Outcome) -> None:
    """Read a begun stream to its end; the turn is ok or failed_started after it."""
    s = _Stream(api)
    out.status = "failed_started"
    try:
        async for raw in r.content:
            s.line(raw)
    except asyncio.TimeoutError:
        out.hangs += 1
        out.error = "no chunk within the read timeout (a hang)"
    except (aiohttp.ClientError, OSError) as e:
        out.error = f"connection closed mid-stream ({type(e).__name__})"
    out.ttft_s = None if s.first is None else s.first - t0
    out.text, out.cached, out.prompt_tokens = "".join(s.text), s.cached, s.prompt_tokens
    if not out.error:
        if s.error is not None:
            out.error = f"error event: {s.error}"
        elif not s.done:
            out.error = "stream ended before its end marker"
        else:
            out.status = "ok"
    return None


async def send_turn(http: aiohttp.ClientSession, url: str, api: str, body: dict[str, Any],
                    headers: dict[str, str], policy: RetryPolicy) -> Outcome:
    """Send one turn, retrying it while it has not started (bounded by `policy`)."""
    out = Outcome(t0=time.monotonic())
    delay = policy.initial_s
    while out.tries < policy.tries:
        out.tries += 1
        why = await _try(http, url, api, body, headers, policy, out)
        if why is None:
            return out
        out.retry_errors.append(why)
        if time.monotonic() + delay - out.t0 > policy.window_s:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, policy.max_s)
    out.status, out.error = "lost", out.retry_errors[-1] if out.retry_errors else "no try"
    return out


def error_kind(text: str) -> str:
    """An error text with its numbers and addresses folded, to count errors by kind."""
    return re.sub(r"\d+", "N", text)[:160]
