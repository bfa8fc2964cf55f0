"""A P/D decode leg whose own CPU tier holds its context: restore locally + pull the rest,
against a decode engine without a tier (pull everything the device lost).

Three real engines on loopback (`agentserve serve`): one prefill engine P and two decode
engines with the same device pool (``--kv-cache-tokens``): ``tier`` has a CPU tier
(``--kv-cpu-gib``, ``--kv-store-on``, ``--store-on``), ``plain`` has none. Each round, for a fresh
context x of ``--context`` tokens and on both decode engines (in alternating order):

1. turn 1: x as a decode leg (prefill leg on P, decode leg pulls x);
2. a filler decode leg about the size of the device pool, which evicts x from the device
   (``tier``'s CPU tier holds it: stored as it filled, or as it was evicted);
3. turn 2 (measured): x + ``--delta`` new tokens as a decode leg. ``tier`` restores the part
   of x its CPU tier holds and pulls the rest from P; ``plain`` pulls everything past its
   device hit.

Measured on the decode engine for turn 2 (its metric deltas; one request at a time): the
client's time to first token of the decode leg (the prefill leg is not counted: it is the
same for both), KV bytes pulled from P, KV bytes restored from the CPU tier, and whether the
answer equals P's own (aggregated) answer. Medians over rounds; ``ratio`` = plain / tier.

    .venv/bin/python benchmarks/pd_local_restore.py --out benchmarks/results/pd_local_restore.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gc_pauses import gc_stats
from pd_itl import loadavg, prompt, scrape

from agentserve.api.kv_transfer import signed_headers
from agentserve.cluster.procs import ManagedProcess, agentserve_cmd, free_port, running, start_process

PULL_B = "agentserve:kv_transfer_received_bytes_total"
RESTORE_B = "agentserve:kv_restore_bytes_total"
PULL_S = "agentserve:kv_transfer_pull_seconds_total"
RESTORE_S = "agentserve:kv_restore_latency_seconds_sum"
TOKEN = "bench-local-restore"


def start(run_dir: Path, name: str, role: str, extra: list[str]) -> ManagedProcess:
    port = free_port()
    cmd = agentserve_cmd("serve", "--host", "127.0.0.1", "--port", str(port), "--role", role,
                         *extra)
    env = {"AGENTSERVE_KV_TRANSFER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    return start_process(name, cmd, run_dir / f"{name}.log", f"http://127.0.0.1:{port}", env)


def signed(params: dict) -> dict[str, str]:
    """The router's signature over a leg's kv_transfer_params (the engines refuse unsigned ones)."""
    return signed_headers(TOKEN, params)


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    headers = signed(body["kv_transfer_params"]) if "kv_transfer_params" in body else {}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {out}")
        return out


async def decode_leg(s: aiohttp.ClientSession, p: str, d: str, body: dict) -> tuple[float, str]:
    """Prefill leg on P, then the decode leg on D streamed: (D's TTFT in s, D's text)."""
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}}
    params = (await post(s, p, leg))["kv_transfer_params"]
    t0, first, text = time.perf_counter(), None, []
    async with s.post(d + "/v1/completions", headers=signed(params),
                      json={**body, "stream": True, "kv_transfer_params": params}) as r:
        if r.status != 200:
            raise RuntimeError(f"{d}: {r.status} {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{d}: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
    if first is None:
        raise RuntimeError(f"{d}: no tokens")
    return first - t0, "".join(text)


async def measure(a: argparse.Namespace, urls: dict[str, str]) -> list[dict]:
    rng = random.Random(a.seed)
    rows: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one_round(i: int, warm: bool) -> None:
            x, more = prompt(a.context, rng), prompt(a.delta, rng)
            filler = prompt(a.kv_cache_tokens - a.context // 4, rng)
            body = {"prompt": x + more, "max_tokens": a.max_tokens, "temperature": 0.0}
            ref = (await post(s, urls["P"], body))["choices"][0]["text"]
            order = ["tier", "plain"] if i % 2 == 0 else ["plain", "tier"]
            for name in order:
                d = urls[name]
                await decode_leg(s, urls["P"], d, {"prompt": x, "max_tokens": 2, "temperature": 0.0})
                await decode_leg(s, urls["P"], d, {"prompt": filler, "max_tokens": 2,
                                                   "temperature": 0.0})
                await asyncio.sleep(a.pause_s)  # the tool call between the turns
                before = await scrape(s, d)
                ttft, text = await decode_leg(s, urls["P"], d, body)
                after = await scrape(s, d)
                if not warm:
                    rows.append({"round": i, "engine": name, "ttft_ms": ttft * 1e3,
                                 "pulled_mib": (after.get(PULL_B, 0) - before.get(PULL_B, 0)) / 2**20,
                                 "restored_mib": (after.get(RESTORE_B, 0)
                                                  - before.get(RESTORE_B, 0)) / 2**20,
                                 "pull_ms": (after.get(PULL_S, 0) - before.get(PULL_S, 0)) * 1e3,
                                 "restore_ms": (after.get(RESTORE_S, 0)
                                                - before.get(RESTORE_S, 0)) * 1e3,
                                 "same_answer": text == ref})

        await one_round(-1, warm=True)
        for i in range(a.rounds):
            await one_round(i, warm=False)
        for name in ("tier", "plain"):  # full collections would show up as TTFT spikes
            rows.append({"engine": name, "gc": await gc_stats(s, urls[name])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=6144, help="tokens of the resumed context")
    ap.add_argument("--delta", type=int, default=512, help="new tokens of the resumed turn")
    ap.add_argument("--kv-cache-tokens", type=int, default=8192, help="each decode engine's pool")
    ap.add_argument("--kv-cpu-gib", type=float, default=0.5, help="the tier engine's CPU tier")
    ap.add_argument("--store-on", default="fill", choices=("fill", "evict"),
                    help="the tier's --kv-store-on (evict: the filler's eviction copies run on "
                         "the core thread as turn 2 allocates, and count in its TTFT)")
    ap.add_argument("--preset", default="tiny", help="tiny | small")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pause-s", type=float, default=0.0,
                    help="seconds between the filler and turn 2 (a tool call); write-through "
                         "copies of the filler still running then hold its device blocks, so "
                         "turn 2 waits for them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/pd_local_restore.json")
    a = ap.parse_args()
    t0, load_start = time.time(), loadavg()
    run_dir = Path(tempfile.mkdtemp(prefix="pd-local-restore-"))
    import subprocess
    subprocess.run(agentserve_cmd("model", "make-tiny", "--out", str(run_dir / "model"), "--preset",
                                  a.preset), check=True, capture_output=True)
    common = ["--model", str(run_dir / "model"), "--max-model-len", str(a.kv_cache_tokens)]
    dec = common + ["--kv-cache-tokens", str(a.kv_cache_tokens)]
    procs = {"P": start(run_dir, "prefill", "prefill",
                        common + ["--kv-cache-tokens", str(4 * a.kv_cache_tokens)]),
             "tier": start(run_dir, "decode-tier", "decode",
                           dec + ["--kv-cpu-gib", str(a.kv_cpu_gib), "--kv-store-on", a.store_on]),
             "plain": start(run_dir, "decode-plain", "decode", dec)}
    with running(procs, run_dir):
        rows = asyncio.run(measure(a, {k: p.url for k, p in procs.items()}))
    gc = {r["engine"]: r["gc"] for r in rows if "gc" in r}
    rows = [r for r in rows if "gc" not in r]
    summary = {}
    for name in ("tier", "plain"):
        rs = [r for r in rows if r["engine"] == name]
        summary[name] = {f: round(statistics.median(r[f] for r in rs), 3)
                         for f in ("ttft_ms", "pulled_mib", "restored_mib", "pull_ms", "restore_ms")}
        summary[name]["same_answer"] = all(r["same_answer"] for r in rs)
        summary[name]["gc"] = gc[name]
    pairs = [(p["ttft_ms"] / t["ttft_ms"]) for t in rows if t["engine"] == "tier"
             for p in rows if p["engine"] == "plain" and p["round"] == t["round"]]
    summary["paired_ttft_ratio_plain_over_tier"] = round(statistics.median(pairs), 3)
    table = Table(title=f"Decode leg of a resumed {a.context}+{a.delta}-token context, {a.preset} "
                        f"model, --kv-store-on {a.store_on} "
                        f"(median of {a.rounds}; {os.cpu_count()} CPUs, load {load_start[0]})")
    for col in ("decode engine", "TTFT ms", "pulled MiB", "(pull ms)", "restored MiB",
                "(restore ms)", "same answer"):
        table.add_column(col, justify="right")
    for name, label in (("plain", "no CPU tier: pull"), ("tier", "CPU tier: restore + pull")):
        m = summary[name]
        table.add_row(label, f"{m['ttft_ms']:.1f}", f"{m['pulled_mib']:.1f}", f"{m['pull_ms']:.1f}",
                      f"{m['restored_mib']:.1f}", f"{m['restore_ms']:.1f}", str(m["same_answer"]))
    Console(width=140).print(table)
    print(f"paired TTFT ratio plain / tier: {summary['paired_ttft_ratio_plain_over_tier']}")
    for name in ("tier", "plain"):
        g = gc[name]
        print(f"{name}: {g['gen2_count']:.0f} full GC(s), longest {g['gen2_max_s'] * 1e3:.1f} ms, "
              f"{g['frozen_objects']:.0f} objects frozen")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "config": {k: v for k, v in vars(a).items() if k != "out"}, "cpu_count": os.cpu_count(),
        "loadavg_1m_5m_15m_start": load_start, "loadavg_1m_5m_15m_end": loadavg(),
        "total_wall_s": round(time.time() - t0, 1), "summary": summary, "requests": rows},
        indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
