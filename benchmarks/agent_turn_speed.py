"""An agent's next turn over a long cached context: TTFT and decode ITL, engine in-process.

Every turn of a coding agent re-reads its whole context: the context is a prefix-cache hit,
and the turn's cost is its new tokens (a tool result) attending to everything before them,
then decode steps over the whole context. For each context length this script prefills the
context once (the session so far), then times a turn that adds --new tokens: TTFT (the
chunked prefill of the new tokens over the cached context, then the first token) and the
median inter-token time of --steps decode steps. Engine defaults (2,048-token chunks).

    .venv/bin/python benchmarks/agent_turn_speed.py --ctx 32768,100000 --new 256,2048

To compare two trees, run the same command with PYTHONPATH pointing at each one's src/.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.core.sequence import Sequence


def _run(core, rid: str, prompt: list[int], max_tokens: int) -> tuple[Sequence, float, list[float]]:
    """Serve one request to completion in-process: (sequence, TTFT s, decode step times s)."""
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True))
    core.seqs[rid] = seq
    t0 = time.perf_counter()
    core.scheduler.add(seq)
    steps = 0
    while seq.num_output_tokens == 0:
        core.step([])
        steps += 1
        if steps > 10_000:
            raise RuntimeError("no first token after 10,000 steps")
    ttft = time.perf_counter() - t0
    gaps = []
    while seq.num_output_tokens < max_tokens:
        t = time.perf_counter()
        core.step([])
        gaps.append(time.perf_counter() - t)
        if len(gaps) > 10 * max_tokens:
            raise RuntimeError("decode did not finish")
    core.scheduler.finish(seq, seq.status)
    return seq, ttft, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--ctx", default="32768,100000", help="cached context lengths, comma-separated")
    ap.add_argument("--new", default="256,2048", help="new tokens per turn, comma-separated")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per turn")
    ap.add_argument("--repeats", type=int, default=3, help="turns per (ctx, new); medians reported")
    ap.add_argument("--out", default="bench-out/agent_turn_speed.json")
    args = ap.parse_args()
    from agentserve.engine.model.tiny import make_tiny

    ctxs = [int(x) for x in args.ctx.split(",")]
    news = [int(x) for x in args.new.split(",")]
    model = make_tiny(Path(tempfile.mkdtemp(prefix="agent-turn-")) / args.preset, preset=args.preset)
    kv_tokens = max(ctxs) + max(news) * (args.repeats + 1) + 64 * args.steps + 4096
    eng = AsyncEngine.from_args(model=str(model), kv_cache_tokens=kv_tokens)
    core, rng = eng.core, random.Random(0)
    _run(core, "warm", [rng.randrange(16, 4000) for _ in range(512)], 4)
    rows = []
    for ctx in ctxs:
        context = [rng.randrange(16, 4000) for _ in range(ctx)]
        _, cold, _ = _run(core, f"ctx{ctx}", context, 1)  # the session so far, now cached
        for new in news:
            ttfts, itls = [], []
            for r in range(args.repeats):  # each turn's new tokens differ: only the context hits
                tool_result = [rng.randrange(16, 4000) for _ in range(new)]
                seq, ttft, gaps = _run(core, f"t{ctx}-{new}-{r}", context + tool_result,
                                       args.steps + 1)
                if seq.num_cached_tokens < ctx - 64:  # all but the partly filled last block
                    raise RuntimeError(f"context not cached: {seq.num_cached_tokens} of {ctx}")
                ttfts.append(ttft)
                itls.append(statistics.median(gaps))
            rows.append({"ctx": ctx, "new": new, "cold_prefill_s": round(cold, 3),
                         "ttft_ms": round(statistics.median(ttfts) * 1e3, 1),
                         "itl_ms": round(statistics.median(itls) * 1e3, 2)})
    result = {"preset": args.preset, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    t = Table(title=f"agent turn over a cached context: {args.preset} float32, CPU")
    for col in ("context", "new tokens", "TTFT ms", "ITL ms", "context cold prefill s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['ctx']:,}", f"{r['new']:,}", f"{r['ttft_ms']:.1f}", f"{r['itl_ms']:.2f}",
                  f"{r['cold_prefill_s']:.1f}")
    Console().print(t)


if __name__ == "__main__":
    main()
