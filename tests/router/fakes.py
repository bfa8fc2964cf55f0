"""A fake OpenAI engine (aiohttp) for gateway tests: scriptable failures and delays."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer


class FakeEngine:
    """Answers completions/chat, streams N chunks, reports cached tokens; records calls."""

    def __init__(self, name: str, model: str = "tiny") -> None:
        self.name, self.model = name, model
        self.calls: list[dict] = []
        self.request_ids: list[str | None] = []  # X-Request-Id of each generate call
        self.status = 200  # HTTP status for generate calls
        self.error_message = "boom"  # the error object's message when status != 200
        self.delay_s = 0.0  # before the first byte
        self.chunk_gap_s = 0.0
        self.chunks = 3
        self.cancelled = 0
        self.waiting = 0
        self.max_model_len: int | None = None  # on the /v1/models card when set (as vLLM)
        self.die_after: int | None = None  # streams: drop the connection after N chunks
        self.server: TestServer | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = (f'vllm:num_requests_waiting{{model_name="{self.model}"}} {self.waiting}\n'
                f'vllm:num_requests_running{{model_name="{self.model}"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.25\n'
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n')
        return web.Response(text=text)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.status != 200:
            return web.json_response({"error": {"message": self.error_message}},
                                     status=self.status)
        usage = {"prompt_tokens": 10, "completion_tokens": self.chunks, "total_tokens": 13,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "text_completion", "model": self.model,
                                      "choices": [{"index": 0, "text": self.name}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                if i == self.die_after:  # as a killed engine: no [DONE], connection gone
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                chunk = {"choices": [{"index": 0, "text": f"{self.name}{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.chunk_gap_s)
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return resp

    async def start(self) -> str:
        self.server = TestServer(self.app(), handler_cancellation=True)
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
