"""How much a long, cached agent turn arriving stalls the streams already decoding.

Agent traffic re-sends a 100K+ token context every turn; nearly all of it is cached, but the
engine still has to find that out: hash the prompt's blocks and match them. Work done for
that on the engine's core thread delays every running stream's next token. This script
starts `agentserve serve`, caches one long context, starts `--streams` decoding streams, and
while they run sends `--turns` requests that re-read the cached context plus one new block
(one at a time). It reports the streams' inter-chunk gaps while those turns arrive, next to
a quiet baseline from the same streams, and the turns' TTFT.

    .venv/bin/python benchmarks/long_prompt_stall.py --context 60000 --turns 12
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from agentserve.cluster.procs import start_engine

STREAM_TOKENS = 20_000  # per decoding stream: outlasts the run (~7 ms a token here)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def stream(url: str, prompt: list[int], max_tokens: int, arrivals: list[float]) -> None:
    """Read one stream until it ends or the server goes away (it is killed at the end)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:  # a refused request raises here
        try:
            for line in r:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
        except OSError:
            pass  # the server was killed at the end of the run


def gaps_in(arrivals: list[list[float]], t0: float, t1: float) -> np.ndarray:
    out = []
    for a in arrivals:
        for x, y in zip(a, a[1:], strict=False):
            if t0 <= y <= t1:
                out.append(y - x)
    return np.array(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=60_000,
                    help="tokens (the tiny model's cold prefill of 60K takes ~1 min on 2 cores)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--port", type=int, default=None, help="default: any free port")
    ap.add_argument("--out", default="bench-out/long_prompt_stall.json")
    a = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    eng = start_engine(Path(tmp.name), port=a.port,
                       extra=["--kv-cache-tokens", str(2 * a.context + a.streams * STREAM_TOKENS
                                                         + 4096)])
    url = eng.url
    try:
        eng.wait_healthy(120)
        rng = random.Random(0)
        context = [rng.randrange(5, 4000) for _ in range(a.context)]
        post(url, {"prompt": context, "max_tokens": 1})  # cache it
        arrivals: list[list[float]] = [[] for _ in range(a.streams)]
        threads = [threading.Thread(target=stream, daemon=True,
                                    args=(url, [7 + i] * 64, STREAM_TOKENS, arrivals[i]))
                   for i in range(a.streams)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # streams settle
        q0 = time.monotonic()
        time.sleep(4.0)
        q1 = time.monotonic()
        ttfts = []
        for _ in range(a.turns):
            turn = context + [rng.randrange(5, 4000) for _ in range(16)]
            t = time.monotonic()
            r = post(url, {"prompt": turn, "max_tokens": 1})
            ttfts.append(time.monotonic() - t)
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= a.context - 16, r
        b1 = time.monotonic()
        quiet, busy = gaps_in(arrivals, q0, q1), gaps_in(arrivals, q1, b1)
    finally:  # the streams are still running: no drain wanted
        eng.stop(timeout=0)
        tmp.cleanup()

    def stats(x: np.ndarray) -> dict:
        return {"n": int(x.size), "p50": float(np.percentile(x, 50)),
                "p99": float(np.percentile(x, 99)), "max": float(x.max())}

    res = {"args": vars(a), "quiet_gap_ms": stats(quiet), "busy_gap_ms": stats(busy),
           "turn_ttft_ms": stats(np.array(ttfts) * 1e3)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    t = Table(title=f"{a.streams} streams decoding while {a.turns} turns re-read a cached "
                    f"{a.context:,}-token context")
    for c in ("", "n", "p50 ms", "p99 ms", "max ms"):
        t.add_column(c, justify="right")
    for name, key in (("stream gaps, quiet", "quiet_gap_ms"), ("stream gaps, turns arriving",
                                                              "busy_gap_ms"),
                      ("turn TTFT", "turn_ttft_ms")):
        s = res[key]
        t.add_row(name, str(s["n"]), f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}")
    Console(width=120).print(t)


if __name__ == "__main__":
    main()
