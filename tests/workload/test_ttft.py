"""TTFT as AIPerf 0.13.0 measures it: from just before the request is sent to the first SSE
chunk that carries output (content, reasoning, or a tool call's name/arguments); a role-only
first delta (`content: ""`, vLLM's and our engine's first chat chunk) and a usage-only chunk
never start the clock. A scripted loopback server sends each chunk at a set time, so a wrong
choice of chunk shows as a TTFT off by the gap before the real first token."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from agentserve.workload.record import RequestRecord
from agentserve.workload.replay_http import Target
from tests.conftest import API_KEY

GAP = 0.25  # seconds between the role delta and the first token: far above loopback jitter
ITL = 0.02


def chat(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
         "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


async def scripted(script: list[tuple[float, dict | str]]):
    """A server answering every POST with `script`: (sleep before, chunk or "[DONE]")."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delay, item in script:
            if delay:
                await asyncio.sleep(delay)
            data = item if isinstance(item, str) else json.dumps(item)
            await resp.write(f"data: {data}\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, "http://127.0.0.1:%d" % runner.addresses[0][1]


async def measure(script: list[tuple[float, dict | str]], api: str = "chat") -> RequestRecord:
    runner, url = await scripted(script)
    try:
        async with Target(url, api=api, model="m") as t:
            rec = RequestRecord(request_id="r0", session_id="s", turn=0)
            await t.send(rec, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
                           0.0)
        return rec
    finally:
        await runner.cleanup()


def tokens(*texts: str) -> list[tuple[float, dict]]:
    return [(ITL, chat({"content": x})) for x in texts]


async def test_role_delta_does_not_start_the_clock() -> None:
    rec = await measure([(0, chat({"role": "assistant", "content": ""})),
                         (GAP, chat({"content": "a"})), *tokens("b", "c"), (0, USAGE), (0, "[DONE]")])
    assert rec.ok, rec.error
    assert GAP <= rec.ttft < GAP + 0.15  # the first content chunk, not the role delta at ~0
    assert rec.chunk_times[0] == rec.ttft and len(rec.chunk_times) == 3  # role and usage carry none
    assert rec.output_tokens == 3 and rec.input_tokens == 7


async def test_usage_chunk_before_content_does_not_start_the_clock() -> None:
    # vLLM's continuous usage stats put usage on chunks; one without choices carries no token.
    early = dict(USAGE, usage={"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7})
    rec = await measure([(0, early), (0, chat({"role": "assistant"})), (GAP, chat({"content": "a"})),
                         *tokens("b"), (0, USAGE), (0, "[DONE]")])
    assert rec.ok, rec.error
    assert GAP <= rec.ttft < GAP + 0.15 and len(rec.chunk_times) == 2


@pytest.mark.parametrize("delta", [
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\""}}]},
    {"reasoning_content": "hm"},
    {"reasoning": "hm"},
], ids=["tool-name", "tool-args", "reasoning_content", "reasoning"])
async def test_tool_call_and_reasoning_deltas_are_output(delta: dict) -> None:
    # AIPerf counts these as content responses (endpoints/openai_chat.py), so its TTFT for an
    # answer that opens with a tool call is the first tool-call delta; so is ours.
    rec = await measure([(0, chat({"role": "assistant", "content": ""})), (GAP, chat(delta)),
                         (GAP, chat({"content": "x"})), (0, USAGE), (0, "[DONE]")])
    assert rec.ok, rec.error
    assert GAP <= rec.ttft < 2 * GAP and len(rec.chunk_times) == 2


async def test_empty_tool_call_delta_is_not_output() -> None:
    # A tool-call delta with neither name nor arguments (a bare index) carries no text.
    rec = await measure([(0, chat({"role": "assistant", "content": ""})),
                         (0, chat({"tool_calls": [{"index": 0, "function": {}}]})),
                         (GAP, chat({"content": "a"})), (0, USAGE), (0, "[DONE]")])
    assert GAP <= rec.ttft < GAP + 0.15 and len(rec.chunk_times) == 1


async def test_completions_empty_text_is_not_output() -> None:
    def comp(text: str) -> dict:
        return {"id": "c", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    rec = await measure([(0, comp("")), (GAP, comp("a")), (ITL, comp("b")), (0, "[DONE]")], api="completions")
    assert rec.ok, rec.error
    assert GAP <= rec.ttft < GAP + 0.15 and len(rec.chunk_times) == 2 and rec.output_tokens == 2


async def test_our_engine_opens_with_a_role_delta_then_tokens(served) -> None:
    """Our engine's chat stream opens as vLLM's: a role delta with `content: ""`, written
    just before the first token's chunk (chat.py `_chat_events`), then one chunk per text
    piece. The bench counts the token chunks only, as AIPerf does."""
    body = {"model": served.engine.model_name, "stream": True, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": "hello there " * 20}],
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        async with s.post(served.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            events = [json.loads(line[6:]) async for line in r.content
                      if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"].get("content")  # the first token follows it
    with_text = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]

    async with Target(served.url, api="chat", api_key=API_KEY) as t:
        rec = RequestRecord(request_id="r1", session_id="s", turn=0)
        await t.send(rec, body, 0.0)
    assert rec.ok, rec.error
    assert rec.output_tokens == 8 and len(rec.chunk_times) == len(with_text)  # greedy: same stream
    assert rec.ttft == rec.chunk_times[0] > 0
