"""A minimal OpenAI-compatible streaming server for testing and benchmarking the replay client.

It streams SSE completions with a configurable TTFT, inter-chunk gap and tokens per chunk,
reports `usage.prompt_tokens_details.cached_tokens` from a toy block-level prefix cache,
serves `/metrics` with a few `vllm:` counters, and keeps what a test wants to assert:
the most requests in flight at once, arrival times, and per-request server timestamps
(`time.perf_counter`, which is CLOCK_MONOTONIC and so comparable across processes on
one host). `GET /stub/stats` returns them.

Run standalone: `python benchmarks/stub_server.py --port 0 --ttft 0.05 --itl 0.02`
(prints `READY <port>` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

MODEL = "stub-model"


@dataclass(slots=True)
class StubConfig:
    """Behaviour knobs; tests mutate them between runs."""

    ttft: float = 0.01  # seconds from request receipt to the first chunk
    itl: float = 0.002  # seconds between chunks
    tokens_per_chunk: int = 1
    default_max_tokens: int = 16
    fail_every: int = 0  # every Nth request gets HTTP `fail_status` (0: never)
    fail_status: int = 500
    cache_block: int = 4  # toy prefix cache granularity, in prompt tokens
    keep_timestamps: bool = True


@dataclass(slots=True)
class StubStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)  # perf_counter at receipt
    first_sent: dict[str, float] = field(default_factory=dict)  # X-Request-Id -> first chunk
    received: dict[str, float] = field(default_factory=dict)  # X-Request-Id -> receipt
    bodies: list[dict] = field(default_factory=list)  # request bodies, when keep_bodies
    hits: int = 0
    queries: int = 0


class StubServer:
    """aiohttp app with OpenAI completions/chat streaming, /v1/models, /metrics, /health."""

    def __init__(self, config: StubConfig | None = None, keep_bodies: bool = False) -> None:
        self.config = config or StubConfig()
        self.stats = StubStats()
        self.keep_bodies = keep_bodies
        self._cache: set[int] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stub/stats", self._stats)
        self.app = app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        # A short shutdown: tests stop the stub with streams still sleeping in it.
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _cached(self, prompt: list) -> int:
        """Longest cached prefix in whole blocks; then insert this prompt's blocks."""
        b = self.config.cache_block
        h, hit, missed = 0, 0, False
        for i in range(len(prompt) // b):
            h = hash((h, tuple(prompt[i * b:(i + 1) * b])))
            if not missed and h in self._cache:
                hit += b
            else:
                missed = True
                self._cache.add(h)
        self.stats.queries += len(prompt)
        self.stats.hits += hit
        return hit

    @staticmethod
    def _prompt_of(body: dict) -> list:
        if "messages" in body:
            return " ".join(str(m.get("content", "")) for m in body["messages"]).split()
        p = body.get("prompt", "")
        return p if isinstance(p, list) else str(p).split()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        cfg, st = self.config, self.stats
        now = time.perf_counter()
        rid = request.headers.get("X-Request-Id", str(st.requests))
        st.requests += 1
        n = st.requests
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            body = msgspec.json.decode(await request.read())
            if cfg.keep_timestamps:
                st.arrivals.append(now)
                st.received[rid] = now
            if self.keep_bodies:
                st.bodies.append(body)
            if cfg.fail_every and n % cfg.fail_every == 0:
                err = {"error": {"message": f"stub: injected failure on request {n}",
                                 "type": "InternalServerError", "code": cfg.fail_status}}
                return web.json_response(err, status=cfg.fail_status)
            return await self._stream(request, body, rid)
        finally:
            st.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, rid: str) -> web.StreamResponse:
        cfg = self.config
        prompt = self._prompt_of(body)
        cached = self._cached(prompt)
        out = int(body.get("max_tokens") or cfg.default_max_tokens)
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(cfg.ttft)
        enc = msgspec.json.encode
        sent, first = 0, True
        while sent < out:
            k = min(cfg.tokens_per_chunk, out - sent)
            ids = list(range(100 + sent, 100 + sent + k))
            text = "".join(f" t{i}" for i in ids)
            choice = ({"index": 0, "delta": {"content": text}, "token_ids": ids, "finish_reason": None}
                      if chat else {"index": 0, "text": text, "token_ids": ids, "finish_reason": None})
            sent += k
            if sent >= out:
                choice["finish_reason"] = "length"
            await resp.write(b"data: " + enc({"id": rid, "object": "chunk", "model": MODEL,
                                              "choices": [choice]}) + b"\n\n")
            if first:
                if cfg.keep_timestamps:
                    self.stats.first_sent[rid] = time.perf_counter()
                first = False
            if sent < out:
                await asyncio.sleep(cfg.itl)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": out,
                 "total_tokens": len(prompt) + out, "prompt_tokens_details": {"cached_tokens": cached}}
        await resp.write(b"data: " + enc({"id": rid, "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize over the stub's tokens (whitespace words), so chat benches can size
        their prompts here as against a real server."""
        body = await request.json()
        words = self._prompt_of(body)
        out: dict = {"count": len(words), "tokens": list(range(len(words))), "max_model_len": 1 << 20}
        if body.get("return_token_strs"):
            out["token_strs"] = [" " + w for w in words]
        return web.json_response(out)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        st, lab = self.stats, f'{{engine="0",model_name="{MODEL}"}}'
        text = (f"# TYPE vllm:prefix_cache_queries_total counter\n"
                f"vllm:prefix_cache_queries_total{lab} {float(st.queries)}\n"
                f"# TYPE vllm:prefix_cache_hits_total counter\n"
                f"vllm:prefix_cache_hits_total{lab} {float(st.hits)}\n"
                f"# TYPE vllm:num_preemptions_total counter\n"
                f"vllm:num_preemptions_total{lab} 0.0\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{lab} {min(1.0, len(self._cache) / 1e5)}\n")
        return web.Response(text=text, content_type="text/plain")

    async def _stats(self, request: web.Request) -> web.Response:
        st = self.stats
        return web.json_response({"requests": st.requests, "max_in_flight": st.max_in_flight,
                                  "first_sent": st.first_sent, "received": st.received})


async def _serve(args: argparse.Namespace) -> None:
    cfg = StubConfig(ttft=args.ttft, itl=args.itl, tokens_per_chunk=args.tokens_per_chunk,
                     fail_every=args.fail_every)
    server = StubServer(cfg)
    url = await server.start(args.host, args.port)
    print(f"READY {url.rsplit(':', 1)[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.02)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--fail-every", type=int, default=0)
    args = p.parse_args()
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
