#!/usr/bin/env python3
"""Soak a local cluster: a long mixed load leaves memory, fds, threads and KV where they were.

Starts `agentserve up --topology 1P1D` (or `--topology 2`) and runs `--clients` agent-like
clients through the router for `--minutes` (30 by default): multi-turn sessions on all
four APIs, streamed and not, forced tool calls answered on the next turn, clients that
leave mid-stream, bad requests (benchmarks/_soakload.py). Every `--sample-s` seconds
(10; a run shorter than 100 s samples ten times) it reads each process's RSS, open fds and
threads from /proc (the launcher, the router, each engine) and each engine's KV usage
and running/waiting requests. After the load it waits for the engines to go idle and
samples once more.

Reported per process: RSS at the end of warm-up (the first 10% of the run) and at the
end, and the growth between them (target < 5%); fds and threads first (after warm-up) /
last / max. Checks: no request failed but the bad ones (each a 4xx), KV usage 0 after
the load, no process restarted, fds and threads back within a small bound of where they
were after warm-up, RSS growth under `--rss-limit-pct`. JSON (`--out`) and a table; exits
1 if a check fails. `make test` runs it for half a minute (tests/test_harden_suites.py).

    python benchmarks/harden_soak.py [--minutes 30] [--clients 4] [--topology 1P1D]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _cluster import UpCluster, run_suite, engine_metrics, proc_stats, wait_idle  # noqa: E402
from _soakload import Client  # noqa: E402

ENGINE_ARGS = "--kv-cache-tokens 32768 --max-model-len 4096 --max-tokens-limit 64"
FD_SLACK, THREAD_SLACK = 16, 8  # "flat": pooled keep-alive sockets and worker threads come and go


def sample(cluster: UpCluster, t0: float) -> dict[str, Any]:
    """One reading of every process and engine, stamped with seconds since the start."""
    procs: dict[str, Any] = {}
    for name, pid in cluster.pids().items():
        st = proc_stats(pid)
        procs[name] = None if st is None else {**st, "pid": pid}
    kv: dict[str, Any] = {}
    for e in cluster.engines():
        try:
            kv[e["name"]] = engine_metrics(e["url"])
        except OSError as ex:
            kv[e["name"]] = {"error": str(ex)}
    return {"t": round(time.monotonic() - t0, 1), "procs": procs, "engines": kv}


def summarize(samples: list[dict[str, Any]], warm_t: float) -> dict[str, Any]:
    """Per process: RSS growth from the end of warm-up to the end; fds and threads. A
    process that was restarted is judged from its last incarnation's first sample at or
    after warm-up (and marked `restarted`)."""
    out: dict[str, Any] = {}
    for name, b in samples[-1]["procs"].items():
        mine = [s["procs"][name] for s in samples if s["t"] >= warm_t and s["procs"].get(name)
                and b and s["procs"][name]["pid"] == b["pid"]]
        if not (b and mine):
            out[name] = {"error": "not sampled (process gone?)"}
            continue
        a, series = mine[0], mine
        pids = {s["procs"][name]["pid"] for s in samples if s["procs"].get(name)}
        out[name] = {"restarted": len(pids) > 1, "rss_mib_warm": round(a["rss_kib"] / 1024, 1),
                     "rss_mib_end": round(b["rss_kib"] / 1024, 1),
                     "rss_growth_pct": round(100 * (b["rss_kib"] - a["rss_kib"]) / a["rss_kib"], 2),
                     "rss_mib_max": round(max(x["rss_kib"] for x in series) / 1024, 1),
                     "fds": [a["fds"], b["fds"], max(x["fds"] for x in series)],
                     "threads": [a["threads"], b["threads"], max(x["threads"] for x in series)]}
    return out


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cluster = UpCluster(work, args.topology, ENGINE_ARGS)
    t_start = time.monotonic()
    cluster.start()
    duration = args.minutes * 60
    period = min(args.sample_s, max(1.0, duration / 10))
    stop, lock = threading.Event(), threading.Lock()
    counts: Counter = Counter()
    failures: list[dict[str, Any]] = []
    try:
        router = cluster.first["router"]
        clients = [Client(router, i, stop, counts, failures, lock, args.seed)
                   for i in range(args.clients)]
        threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
        t0 = time.monotonic()
        samples = [sample(cluster, t0)]
        for t in threads:
            t.start()
        while time.monotonic() - t0 < duration:
            time.sleep(min(period, max(0.0, duration - (time.monotonic() - t0))))
            samples.append(sample(cluster, t0))
        stop.set()
        for t in threads:
            t.join(120)  # each request is bounded by its deadline (90 s)
        load_s = time.monotonic() - t0
        idle = wait_idle([e["url"] for e in cluster.engines()], timeout=60)
        samples.append(sample(cluster, t0))
        restarts = cluster.restarts()
    finally:
        cluster.stop()
    procs = summarize(samples, duration * 0.1)
    engines = {e["name"] for e in cluster.engines()}
    growth = max((p.get("rss_growth_pct", 0.0) for n, p in procs.items()
                  if n in engines or n == "router"), default=0.0)
    flat = all("error" not in p and p["fds"][1] <= p["fds"][0] + FD_SLACK
               and p["threads"][1] <= p["threads"][0] + THREAD_SLACK for p in procs.values())
    kv_leaked = [u for u, m in idle.items() if "error" in m or any(m.values())]
    crashed = bool(restarts["restarted"] or restarts["replaced"] or not restarts["up_alive"])
    out = {"minutes": args.minutes, "topology": args.topology, "clients": args.clients,
           "load_s": round(load_s, 1), "wall_s": round(time.monotonic() - t_start, 1),
           "sample_s": period, "samples": len(samples), "requests": dict(counts),
           "first_failures": failures, "processes": procs, "rss_growth_pct_max": growth,
           "fds_threads_flat": flat, "kv_after": idle, "kv_leaked": kv_leaked,
           "restarts": restarts, "crashes": int(crashed), "series": samples}
    out["ok"] = bool(not counts["failed"] and counts["ok"] and not kv_leaked and not crashed
                     and flat and growth < args.rss_limit_pct)
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"{'process':10} {'RSS MiB warm':>12} {'end':>7} {'growth':>8} "
             f"{'fds first/last/max':>19} {'threads f/l/m':>14}"]
    for name, p in r["processes"].items():
        if "error" in p:
            lines.append(f"{name:10} {p['error']}")
            continue
        name += "*" if p["restarted"] else ""
        lines.append(f"{name:10} {p['rss_mib_warm']:>12} {p['rss_mib_end']:>7} "
                     f"{p['rss_growth_pct']:>7}% {'/'.join(map(str, p['fds'])):>19} "
                     f"{'/'.join(map(str, p['threads'])):>14}")
    lines += [f"{r['minutes']} min, {r['clients']} clients, {r['samples']} samples every "
              f"{r['sample_s']:g} s; requests {r['requests']}",
              f"RSS growth max {r['rss_growth_pct_max']}% (engines, router); fds/threads flat: "
              f"{r['fds_threads_flat']}; crashes {r['crashes']} (*: restarted, judged from its "
              "last start)",
              "KV after: " + ", ".join(f"{u}: {m}" for u, m in r["kv_after"].items()),
              "PASS" if r["ok"] else "FAIL"]
    lines += [f"  failure: {json.dumps(f)[:400]}" for f in r["first_failures"][:3]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4, help="concurrent agent sessions")
    ap.add_argument("--topology", default="1P1D", help="1P1D, or N aggregated engines")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-limit-pct", type=float, default=5.0,
                    help="RSS growth (end of warm-up to the end) that fails the run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/harden_soak.json")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the cluster's state and logs here (default: a temporary folder)")
    return run_suite(ap.parse_args(), soak, table, "harden-soak-")


if __name__ == "__main__":
    sys.exit(main())
