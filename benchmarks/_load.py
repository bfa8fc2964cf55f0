"""Small shared load generator for the engine benchmarks: N streamed completions at once.

Streams every request so TTFT is measured on the client, as a user sees it.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import aiohttp


def random_prompts(n: int, length: int, vocab: int = 4000, seed: int = 0) -> list[list[int]]:
    """Distinct token-id prompts (no shared prefix), ids away from the special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab - 16) for _ in range(length)] for _ in range(n)]


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
               max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "usage": usage}


async def fire(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Send all prompts at once; return wall time, output tok/s, TTFT median."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_one(s, url, model, p, max_tokens) for p in prompts])
        wall = time.perf_counter() - t0
    out_tokens = sum(r["usage"]["completion_tokens"] for r in res)
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
            "ttft_p50_s": statistics.median(r["ttft"] for r in res),
            "cached_tokens": sum(((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                                 for r in res)}


async def model_id(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]
