"""TTFT breakdown of disaggregated requests (1P1D): router, prefill, KV transfer, first decode step.

Starts one ``--topology 1P1D`` cluster (`agentserve.cluster.launch.Cluster`, what `agentserve up`
runs), warms it, then sends one streamed request at a time (nothing else running, so
engine metric deltas belong to that request) for each prompt length (distinct random
token ids: no prefix-cache hits), ``--reps`` times. Per request:

* ``client TTFT``: request sent -> first content chunk, on the client;
* ``route``: the router's two picks, ``route_ms`` (prefill endpoint) +
  ``decode_route_ms`` (decode endpoint), from the ``x-agentserve-pd`` response header;
* ``prefill leg``: ``prefill_ms`` from the same header (router -> prefill engine ->
  router, prompt prefilled and pinned); ``prefill engine`` is that engine's own TTFT
  (``vllm:time_to_first_token_seconds_sum`` delta), the rest of the leg is HTTP/JSON;
* ``KV transfer``: the decode engine's ``agentserve:kv_transfer_pull_seconds_total``
  delta (the pull itself, socket -> cache blocks) and bytes pulled;
* ``first decode step``: client TTFT minus route, prefill leg and transfer (the brief's
  definition: everything after the pull, plus the hops). Split further with the decode
  engine's own TTFT delta: ``decode engine after pull`` = decode engine TTFT - pull
  (queueing for the pull thread, the local last partial block + final token, sampling);
  ``router/HTTP rest`` = client TTFT - route - prefill leg - decode engine TTFT
  (tokenizing in the router, relaying the decode leg and its first chunk).

Medians over reps are reported. Every process is stopped at the end.

    .venv/bin/python docs/studies/pd_ttft/pd_ttft.py --out docs/studies/pd_ttft/pd_ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the suite's helpers
from pd_itl import cluster, loadavg, model_id, prompt, scrape, stream

TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
PULL_S = "agentserve:kv_transfer_pull_seconds_total"
PULL_B = "agentserve:kv_transfer_received_bytes_total"
PULLS = "agentserve:kv_transfer_pulls_total"


def header_fields(h: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in h.split(";") if "=" in kv)


async def measure(a: argparse.Namespace, state: dict) -> tuple[list[dict], list]:
    url = state["router"]
    pre = next(e["url"] for e in state["engines"] if e["role"] == "prefill")
    dec = next(e["url"] for e in state["engines"] if e["role"] == "decode")
    rng = random.Random(a.seed)
    rows: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        model = await model_id(s, url)

        async def one(n: int) -> dict:
            b_pre, b_dec = await scrape(s, pre), await scrape(s, dec)
            rec = await stream(s, url, {"model": model, "prompt": prompt(n, rng),
                                        "max_tokens": a.max_tokens, "ignore_eos": True,
                                        "temperature": 0.0})
            await asyncio.sleep(0.05)  # let the engines' histograms see the request finish
            a_pre, a_dec = await scrape(s, pre), await scrape(s, dec)
            if rec["error"] or not rec["times"]:
                raise RuntimeError(f"request of {n} tokens failed: {rec['error']}")
            h = header_fields(rec["headers"].get("x-agentserve-pd", ""))
            if "prefill_ms" not in h:
                raise RuntimeError(f"request of {n} tokens was not disaggregated: {rec['headers']}")
            ttft = (rec["times"][0] - rec["t_send"]) * 1e3
            route = float(h.get("route_ms", 0)) + float(h.get("decode_route_ms", 0))
            prefill = float(h["prefill_ms"])
            pre_eng = (a_pre.get(TTFT_SUM, 0) - b_pre.get(TTFT_SUM, 0)) * 1e3
            pull = (a_dec.get(PULL_S, 0) - b_dec.get(PULL_S, 0)) * 1e3
            dec_eng = (a_dec.get(TTFT_SUM, 0) - b_dec.get(TTFT_SUM, 0)) * 1e3
            return {"prompt_tokens": n, "client_ttft_ms": ttft, "route_ms": route,
                    "route_prefill_pick_ms": float(h.get("route_ms", 0)),
                    "route_decode_pick_ms": float(h.get("decode_route_ms", "nan")),
                    "prefill_leg_ms": prefill, "prefill_engine_ms": pre_eng,
                    "kv_transfer_ms": pull,
                    "kv_pulls": a_dec.get(PULLS, 0) - b_dec.get(PULLS, 0),
                    "kv_bytes": a_dec.get(PULL_B, 0) - b_dec.get(PULL_B, 0),
                    "first_decode_step_ms": ttft - route - prefill - pull,
                    "decode_engine_ttft_ms": dec_eng,
                    "decode_engine_after_pull_ms": dec_eng - pull,
                    "router_http_rest_ms": ttft - route - prefill - dec_eng}

        for n in (512, 2048):  # warm-up: both engines, the pull path, the router
            await one(n)
        lengths = [int(x) for x in a.lengths.split(",")]
        for _ in range(a.reps):
            for n in lengths:
                rows.append(await one(n))
    return rows, lengths


FIELDS = ("client_ttft_ms", "route_ms", "prefill_leg_ms", "prefill_engine_ms", "kv_transfer_ms",
          "first_decode_step_ms", "decode_engine_after_pull_ms", "router_http_rest_ms", "kv_bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-args", default="", help="extra `agentserve serve` args for every engine")
    ap.add_argument("--out", default="docs/studies/pd_ttft/pd_ttft.json")
    a = ap.parse_args()
    t0 = time.time()
    load_start = loadavg()
    with cluster("1P1D", a.engine_args.split()) as c:
        rows, lengths = asyncio.run(measure(a, c.state()))
    summary = []
    for n in lengths:
        rs = [r for r in rows if r["prompt_tokens"] == n]
        summary.append({"prompt_tokens": n, "reps": len(rs),
                        **{f: round(statistics.median(r[f] for r in rs), 3) for f in FIELDS}})
    table = Table(title=f"1P1D TTFT breakdown (median of {a.reps}, ms; {os.cpu_count()} CPUs, "
                        f"load {load_start[0]})")
    cols = ("prompt", "client TTFT", "route", "prefill leg", "(prefill engine)", "KV transfer",
            "first decode step", "(decode after pull)", "(router/HTTP rest)", "KV MiB")
    for col in cols:
        table.add_column(col, justify="right")
    for m in summary:
        table.add_row(str(m["prompt_tokens"]), *[f"{m[f]:.1f}" if f != "route_ms" else f"{m[f]:.2f}"
                                                 for f in FIELDS[:-1]],
                      f"{m['kv_bytes'] / 2**20:.1f}")
    Console(width=160).print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "config": {k: v for k, v in vars(a).items() if k != "out"}, "cpu_count": os.cpu_count(),
        "loadavg_1m_5m_15m_start": load_start, "loadavg_1m_5m_15m_end": loadavg(),
        "total_wall_s": round(time.time() - t0, 1), "statistic": "median over reps",
        "definitions": {
            "route_ms": "router picks: prefill (route_ms) + decode (decode_route_ms), x-agentserve-pd",
            "prefill_leg_ms": "router-measured prefill leg (prefill_ms, x-agentserve-pd)",
            "prefill_engine_ms": "prefill engine's own TTFT (its vllm:time_to_first_token_seconds_sum delta)",
            "kv_transfer_ms": "decode engine agentserve:kv_transfer_pull_seconds_total delta",
            "first_decode_step_ms": "client TTFT - route - prefill leg - KV transfer",
            "decode_engine_after_pull_ms": "decode engine TTFT delta - KV transfer",
            "router_http_rest_ms": "client TTFT - route - prefill leg - decode engine TTFT"},
        "summary": summary, "requests": rows}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
