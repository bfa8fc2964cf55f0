"""Claim: the replay client is not the bottleneck.

Against `benchmarks/stub_server.py` in its own process, the client (this process: one
event loop, so one core) sustains >= 1,000 concurrent agent sessions and >= 5,000 streamed
chunks/s with < 1 GiB RSS, and adds < 1 ms to the TTFT it measures at 500 concurrent streams.

TTFT overhead is measured against the stub's own clock: the stub stamps, with
`time.perf_counter` (CLOCK_MONOTONIC, shared by processes on one host), when it received
each request and when it wrote its first chunk, keyed by the X-Request-Id we send.
  overhead = client TTFT - (stub first-chunk write - stub receipt)
It is what the client and loopback add to the server's own TTFT.

    python benchmarks/replay_client.py --out bench-results/replay_client.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from rich.console import Console
from rich.table import Table

from agentserve.workload.replay import BenchConfig, BenchRun, run_client
from agentserve.workload.schema import Session, TraceRequest

HERE = Path(__file__).resolve().parent


def start_stub(ttft: float, itl: float) -> tuple[subprocess.Popen, str]:
    """The stub in its own process; returns it and its URL once it listens."""
    p = subprocess.Popen([sys.executable, str(HERE / "stub_server.py"), "--port", "0", "--ttft", str(ttft),
                          "--itl", str(itl)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline() if p.stdout else ""
    if not line.startswith("READY"):
        p.kill()
        raise RuntimeError(f"stub did not start: {line!r}")
    return p, f"http://127.0.0.1:{line.split()[1]}"


def sessions(n: int, turns: int, out: int, gap: float, blocks: int = 8, seed: int = 0) -> list[Session]:
    """n sessions whose context grows by one 64-token block per turn; recorded gap `gap` s.

    Output lengths vary (out/2 .. 3*out/2) so streams drift apart: identical lengths would
    make every stream end in the same instant, a lock-step burst no real engine produces.
    """
    rng = np.random.default_rng(seed)
    return [Session(f"s{i}", 64, [TraceRequest(t=j * (1.0 + gap), input_tokens=64 * (blocks + j),
                                               output_tokens=int(rng.integers(out // 2, 3 * out // 2 + 1)),
                                               hash_ids=list(range(blocks + j)), api_time=1.0)
                                  for j in range(turns)]) for i in range(n)]


def proc_cpu_s(pid: int) -> float:
    """utime + stime of another process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # clock ticks; 100 Hz on Linux


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def stub_stats(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/stub/stats") as r:
        return await r.json()


def send_tracer(sent: dict[str, float]) -> aiohttp.TraceConfig:
    """Stamp when aiohttp has handed each request's body to the socket (keyed by X-Request-Id)."""
    tc = aiohttp.TraceConfig()

    async def on_start(session, ctx, params) -> None:  # type: ignore[no-untyped-def]
        ctx.rid = params.headers.get("X-Request-Id")

    async def on_chunk(session, ctx, params) -> None:  # type: ignore[no-untyped-def]
        sent[ctx.rid] = time.perf_counter()

    tc.on_request_start.append(on_start)
    tc.on_request_chunk_sent.append(on_chunk)
    return tc


async def phase(name: str, cfg: BenchConfig, url: str, stub_pid: int) -> tuple[dict, BenchRun]:
    run = BenchRun(cfg)
    c0, w0, s0 = cpu_s(), time.perf_counter(), proc_cpu_s(stub_pid)
    stages = await run.run()
    wall, cpu, stub_cpu = time.perf_counter() - w0, cpu_s() - c0, proc_cpu_s(stub_pid) - s0
    chunks = sum(len(r.chunk_times) for r in run.records)
    st = await stub_stats(url)
    return {"phase": name, "wall_s": wall, "client_cpu_s": cpu, "client_cpu_util": cpu / wall,
            "stub_cpu_util": stub_cpu / wall,
            "requests_ok": stages[0]["requests_ok"], "requests_failed": stages[0]["requests_failed"],
            "chunks": chunks, "chunks_per_s": chunks / stages[0]["duration_s"],
            # CPU cost per chunk, request overhead included: what one core could sustain.
            "client_cpu_us_per_chunk": cpu / max(1, chunks) * 1e6,
            "client_chunks_per_core_s": chunks / cpu if cpu > 0 else None,
            "stub_max_in_flight": st["max_in_flight"],
            "sessions_started": stages[0].get("sessions_started")}, run


def ttft_overhead(run: BenchRun, st: dict, sent: dict[str, float], first_wave: int) -> dict:
    """Where the client's TTFT goes beyond the stub's own, per request, in ms.

    client = (start stamp -> body on the socket) + (stub's first-chunk write -> client stamp):
    the time the client itself adds. total = client TTFT - stub TTFT, which also holds the
    stub's own HTTP parsing and loop delay. The first wave (all C connections opened at
    once) is left out of the `steady` figures.
    """
    rows = []
    for r in sorted(run.records, key=lambda r: r.start):
        rid = r.request_id
        if r.ok and r.ttft is not None and rid in st["first_sent"] and rid in sent:
            got, first, start = st["received"][rid], st["first_sent"][rid], run.t0 + r.start
            rows.append(((sent[rid] - start) * 1e3, (start + r.ttft - first) * 1e3,
                         (r.ttft - (first - got)) * 1e3))
    a = np.array(rows).reshape(-1, 3)
    steady = a[first_wave:]
    q = (lambda x, p: float(np.percentile(x, p)) if x.size else None)
    out: dict = {"samples": int(len(a)), "steady_samples": int(len(steady))}
    for name, col in (("pre_send", a[:, 0]), ("recv", a[:, 1]), ("client", a[:, 0] + a[:, 1]),
                      ("total", a[:, 2]), ("steady_client", steady[:, 0] + steady[:, 1]),
                      ("steady_total", steady[:, 2])):
        out[f"{name}_ms_p50"], out[f"{name}_ms_p99"] = q(col, 50), q(col, 99)
    return out


async def main(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="replay_client-"))  # the runs' own files are not the result
    results: dict = {"claim": "replay client: >=1000 sessions, >=5000 chunks/s, <1 GiB RSS, <1 ms TTFT overhead"}
    results["loadavg_before"] = os.getloadavg()
    results["cpus"] = os.cpu_count()
    p, url = start_stub(ttft=0.05, itl=args.session_itl)
    try:
        cfg = BenchConfig(url=url, trace_sessions=sessions(args.sessions, 50, args.out_tokens, 0.2),
                          mode="sessions", sessions=args.sessions, duration=args.duration, token_scale=4,
                          out=str(tmp / "sessions"), progress=False, plots=False)
        results["sessions"], _ = await phase("sessions", cfg, url, p.pid)
    finally:
        p.kill()
    p, url = start_stub(ttft=0.05, itl=args.itl)
    try:
        sent: dict[str, float] = {}
        cfg = BenchConfig(url=url, trace_sessions=sessions(args.streams, 50, args.out_tokens, 0.0),
                          mode="concurrency", concurrency=[args.streams], stage_duration=args.duration,
                          token_scale=4, out=str(tmp / "streams"), progress=False, plots=False,
                          trace_configs=[send_tracer(sent)])
        res, run = await phase("streams", cfg, url, p.pid)
        res.update(ttft_overhead(run, await stub_stats(url), sent, args.streams))
        results["streams"] = res
    finally:
        p.kill()
    results["loadavg_after"] = os.getloadavg()
    results["client_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def show(res: dict) -> None:
    t = Table(title=res["claim"])
    for col in ("phase", "ok", "failed", "in flight", "chunks/s", "chunks/s per client core", "client CPU",
                "stub CPU",
                "client TTFT add p50/p99 ms", "total vs stub p50/p99 ms"):
        t.add_column(col, justify="right")
    f = (lambda r, k: f"{r[k + '_ms_p50']:.2f} / {r[k + '_ms_p99']:.2f}" if r.get(k + "_ms_p50") is not None else "-")
    for k in ("sessions", "streams"):
        r = res[k]
        t.add_row(k, str(r["requests_ok"]), str(r["requests_failed"]), str(r["stub_max_in_flight"]),
                  f"{r['chunks_per_s']:,.0f}", f"{r['client_chunks_per_core_s']:,.0f}",
                  f"{r['client_cpu_util']:.0%}", f"{r['stub_cpu_util']:.0%}",
                  f(r, "steady_client"), f(r, "steady_total"))
    Console().print(t)
    Console().print(f"client max RSS: {res['client_max_rss_mib']:.0f} MiB; load average "
                    f"{res['loadavg_before'][0]:.1f} -> {res['loadavg_after'][0]:.1f} on {res['cpus']} CPUs")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1000, help="concurrent sessions (phase 1)")
    ap.add_argument("--streams", type=int, default=500, help="concurrent streams (phase 2)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per phase")
    ap.add_argument("--session-itl", type=float, default=0.08, help="stub chunk gap, sessions phase")
    ap.add_argument("--itl", type=float, default=0.1, help="stub chunk gap, streams phase")
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--out", default="bench-out/replay_client.json")
    a = ap.parse_args()
    r = run_client(main(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(r, indent=2))
    show(r)
