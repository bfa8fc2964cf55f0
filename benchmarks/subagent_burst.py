"""A burst of sub-agents under one shared prompt, decoding together, through the server.

Sub-agents of one group start together and share their prompt's head (the session's
sub-agent system prompt and tools, 6-10K tokens in the synthesized traces); each then reads
its own task. This script starts `agentserve serve` (tiny model), caches a `--head`-token
prompt, then sends `--streams` streaming completions at once, each the head plus `--own`
fresh tokens, and reports, over the window where all streams decode: their inter-token gap
(p50 over every gap, and each stream's mean), the burst's output tok/s, and how many context
tokens the engine did not read again (`agentserve:attn_read_shared_tokens`: decodes sharing a
prefix read it once).

    .venv/bin/python benchmarks/subagent_burst.py --head 8192 --own 1024 --streams 8
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from agentserve.cluster.procs import start_engine
from long_prompt_stall import post, stream  # benchmarks/: the same completions client
from sim_vs_bench import _attn_reads  # benchmarks/: the engines' attention read counters


def shared_tokens(url: str) -> float:
    """The engine's `agentserve:attn_read_shared_tokens` (0 for an engine without it)."""
    return _attn_reads([url]).get("shared", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=int, default=8192, help="tokens every stream's prompt shares")
    ap.add_argument("--own", type=int, default=1024, help="tokens of each stream's own after it")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="the engine's pool (default: what the burst needs + 4,096)")
    ap.add_argument("--port", type=int, default=None, help="default: any free port")
    ap.add_argument("--out", default="bench-out/subagent_burst.json")
    a = ap.parse_args()
    if min(a.head, a.own, a.streams, a.max_tokens) < 1:
        ap.error("--head, --own, --streams and --max-tokens must be positive")

    tmp = tempfile.TemporaryDirectory()
    need = a.kv_cache_tokens or a.head + a.streams * (a.own + a.max_tokens) + 4096
    eng = start_engine(Path(tmp.name), port=a.port, extra=["--kv-cache-tokens", str(need)])
    try:
        eng.wait_healthy(120)
        rng = random.Random(0)
        head = [rng.randrange(5, 4000) for _ in range(a.head)]
        post(eng.url, {"prompt": head, "max_tokens": 1})  # the group's prompt, cached
        before = shared_tokens(eng.url)
        arrivals: list[list[float]] = [[] for _ in range(a.streams)]
        threads = [threading.Thread(target=stream, args=(
            eng.url, head + [rng.randrange(5, 4000) for _ in range(a.own)], a.max_tokens, arr))
            for arr in arrivals]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        if any(t.is_alive() for t in threads) or any(len(x) < 2 for x in arrivals):
            raise RuntimeError("a stream did not finish within 600 s, or returned under 2 chunks")
        saved = shared_tokens(eng.url) - before
    finally:
        eng.stop(timeout=10)
        tmp.cleanup()

    t0 = max(x[0] for x in arrivals)  # every stream past its first token
    t1 = min(x[-1] for x in arrivals)  # none finished yet
    gaps = np.array([y - x for arr in arrivals for x, y in zip(arr, arr[1:]) if t0 <= x and y <= t1])
    if gaps.size == 0:
        raise RuntimeError("the streams never decoded together: raise --max-tokens")
    per_stream = [float(np.mean(np.diff([x for x in arr if t0 <= x <= t1]))) for arr in arrivals
                  if sum(t0 <= x <= t1 for x in arr) >= 2]
    res = {"args": vars(a), "gap_ms_p50": float(np.percentile(gaps, 50)) * 1e3,
           "gap_ms_p90": float(np.percentile(gaps, 90)) * 1e3,
           "stream_mean_gap_ms_p50": float(np.median(per_stream)) * 1e3,
           "together_tok_s": float(gaps.size / (t1 - t0)),
           "burst_wall_s": max(x[-1] for x in arrivals) - min(x[0] for x in arrivals),
           "attn_read_shared_tokens": saved}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    tab = Table(title=f"{a.streams} sub-agents decoding after a shared {a.head:,}-token prompt "
                      f"+ {a.own:,} own")
    tab.add_column("what")
    tab.add_column("value", justify="right")
    for k in ("gap_ms_p50", "gap_ms_p90", "stream_mean_gap_ms_p50", "together_tok_s",
              "burst_wall_s", "attn_read_shared_tokens"):
        tab.add_row(k, f"{res[k]:,.1f}")
    Console(width=120).print(tab)


if __name__ == "__main__":
    main()
