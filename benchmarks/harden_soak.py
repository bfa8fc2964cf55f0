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

`--variants asis,arena2,trim` compares router builds side by side under the same load at
the same time: beside the cluster's own router (left idle), one extra router per variant on
the same router.yaml, each with its own environment (`VARIANTS`) and `--clients` clients.
For each variant router it also keeps /proc/PID/smaps_rollup and the mappings of
/proc/PID/smaps (by class: [heap], anonymous mmaps, files) after warm-up and at the end,
and the mappings that grew most, to say where RSS growth lives.

    python benchmarks/harden_soak.py [--minutes 30] [--clients 4] [--topology 1P1D]
    python benchmarks/harden_soak.py --minutes 25 --variants asis,arena2,trim,bpe0
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
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

from agentserve.cluster.procs import ManagedProcess, agentserve_cmd, free_port, start_process  # noqa: E402

ENGINE_ARGS = "--kv-cache-tokens 32768 --max-model-len 4096 --max-tokens-limit 64"
FD_SLACK, THREAD_SLACK = 16, 8  # "flat": pooled keep-alive sockets and worker threads come and go
TRIM, NO_TRIM = {"AGENTSERVE_ROUTER_MALLOC_TRIM_S": "30"}, {"AGENTSERVE_ROUTER_MALLOC_TRIM_S": "0"}
# --variants: name -> the router's environment (router/memtrim.py; glibc's MALLOC_ARENA_MAX)
VARIANTS: dict[str, dict[str, str]] = {
    "asis": NO_TRIM,                                   # before: no trim, glibc's default arenas
    "arena2": {**NO_TRIM, "MALLOC_ARENA_MAX": "2"},    # at most 2 malloc arenas
    "trim": TRIM,                                      # malloc_trim(0) every 30 s
    "arena2trim": {**TRIM, "MALLOC_ARENA_MAX": "2"},
    "bpe0": {**NO_TRIM, "AGENTSERVE_ROUTER_BPE_CACHE": "0"},  # tokenizers' BPE word cache off
    "bpe1k": {**TRIM, "AGENTSERVE_ROUTER_BPE_CACHE": "1000"},  # ... 1,000 words (default 10,000)
    # Python objects from glibc malloc instead of pymalloc's 1 MiB arenas (which keep every
    # pool they ever touched resident); then a trim can return them too
    "sysmalloc": {**NO_TRIM, "PYTHONMALLOC": "malloc"},
    "sysmalloctrim": {**TRIM, "PYTHONMALLOC": "malloc"},
    # router/memtrace.py: tracemalloc's top growth lines every 120 s into the work folder
    "tracemalloc": {**NO_TRIM, "AGENTSERVE_ROUTER_TRACEMALLOC": "{work}/memtrace.txt",
                    "AGENTSERVE_ROUTER_TRACEMALLOC_S": "120"},
}


def sample(cluster: UpCluster, t0: float, extra: dict[str, int] | None = None) -> dict[str, Any]:
    """One reading of every process (the cluster's and `extra`, name -> pid) and engine,
    stamped with seconds since the start."""
    procs: dict[str, Any] = {}
    for name, pid in {**cluster.pids(), **(extra or {})}.items():
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


def smaps(pid: int) -> dict[str, Any] | None:
    """/proc/PID/smaps_rollup's Rss, Anonymous, Private_Dirty (KiB) and every mapping of
    /proc/PID/smaps as start address -> [name, Rss KiB] (name "[anon]" when it has none);
    None once the process is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return None
    keep = ("Rss:", "Anonymous:", "Private_Dirty:")
    out: dict[str, Any] = {f.split()[0][:-1]: int(f.split()[1]) for f in rollup
                           if f.startswith(keep)}
    maps: dict[str, list] = {}
    cur: list | None = None
    for line in lines:
        head = line.split(None, 1)[0] if line.strip() else ""
        if head and not head.endswith(":"):  # "start-end perms offset dev inode [path]"
            parts = line.split(None, 5)
            cur = maps[parts[0].split("-")[0]] = [parts[5].strip() if len(parts) > 5 else "[anon]", 0]
        elif head == "Rss:" and cur is not None:
            cur[1] = int(line.split()[1])
    out["maps"] = maps
    return out


def map_class(name: str) -> str:
    """[heap] (the main arena's brk), [anon] (mmaps: thread arenas, large blocks, pymalloc
    arenas), [stack], or file (code and data of shared objects)."""
    return name if name in ("[heap]", "[anon]", "[stack]") else "file"


def smaps_growth(a: dict[str, Any], b: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Where RSS grew between two `smaps` readings: rollup fields, per class, top mappings."""
    classes: dict[str, list[int]] = {}
    for m, snap in ((0, a), (1, b)):
        for name, rss in snap["maps"].values():
            c = classes.setdefault(map_class(name), [0, 0])
            c[m] += rss
    grown = sorted(((b["maps"][k][1] - a["maps"].get(k, [None, 0])[1], k, b["maps"][k][0],
                     k not in a["maps"]) for k in b["maps"]), reverse=True)[:top]
    gone = sum(rss for k, (_, rss) in a["maps"].items() if k not in b["maps"])
    return {"rollup_kib": {f: [a[f], b[f], b[f] - a[f]] for f in ("Rss", "Anonymous", "Private_Dirty")},
            "by_class_kib": {c: [v[0], v[1], v[1] - v[0]] for c, v in sorted(classes.items())},
            "mappings": [len(a["maps"]), len(b["maps"])], "unmapped_rss_kib": gone,
            "top_growth": [{"start": k, "name": n, "grew_kib": g, "new": new}
                           for g, k, n, new in grown if g > 0]}


def start_variants(cluster: UpCluster, work: Path, names: list[str]) -> dict[str, ManagedProcess]:
    """One router per variant on the cluster's router.yaml, each with its environment."""
    from agentserve.engine.model.tiny import default_model_dir

    out: dict[str, ManagedProcess] = {}
    for name in names:
        port = free_port()
        cmd = agentserve_cmd("route", "--config", str(work / "run" / "router.yaml"), "--host",
                             "127.0.0.1", "--port", str(port), "--tokenizer", str(default_model_dir()))
        env = {"AGENTSERVE_KV_TRANSFER_TOKEN": cluster.env["AGENTSERVE_KV_TRANSFER_TOKEN"],
               **{k: v.replace("{work}", str(work)) for k, v in VARIANTS[name].items()}}
        out[name] = start_process(f"router-{name}", cmd, work / f"router-{name}.log",
                                  f"http://127.0.0.1:{port}", env, die_with_parent=True)
    for p in out.values():
        p.wait_healthy(120)
    return out


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    names = [v for v in (args.variants or "").split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    env = {"AGENTSERVE_KV_TRANSFER_TOKEN": os.environ.get("AGENTSERVE_KV_TRANSFER_TOKEN")
           or secrets.token_hex(16)}
    cluster = UpCluster(work, args.topology, ENGINE_ARGS, env=env)
    t_start = time.monotonic()
    cluster.start()
    duration = args.minutes * 60
    period = min(args.sample_s, max(1.0, duration / 10))
    stop, lock = threading.Event(), threading.Lock()
    counts: dict[str, Counter] = {}
    failures: list[dict[str, Any]] = []
    variants: dict[str, ManagedProcess] = {}
    maps: dict[str, list[dict[str, Any] | None]] = {}
    try:
        variants = start_variants(cluster, work, names)
        targets = {f"router-{n}": p.url for n, p in variants.items()} or \
            {"router": cluster.first["router"]}
        extra = {f"router-{n}": p.pid for n, p in variants.items()}

        def watched() -> dict[str, int]:  # the routers whose smaps are kept
            return extra or {"router": cluster.pids()["router"]}
        threads = []
        for name, url in targets.items():
            counts[name] = Counter()
            threads += [threading.Thread(target=Client(url, i, stop, counts[name], failures, lock,
                                                       args.seed).run, daemon=True)
                        for i in range(args.clients)]
        t0 = time.monotonic()
        samples = [sample(cluster, t0, extra)]
        for t in threads:
            t.start()
        while time.monotonic() - t0 < duration:
            time.sleep(min(period, max(0.0, duration - (time.monotonic() - t0))))
            samples.append(sample(cluster, t0, extra))
            if not maps and samples[-1]["t"] >= duration * 0.1:
                maps = {n: [smaps(pid)] for n, pid in watched().items()}
        stop.set()
        for t in threads:
            t.join(120)  # each request is bounded by its deadline (90 s)
        load_s = time.monotonic() - t0
        idle = wait_idle([e["url"] for e in cluster.engines()], timeout=60)
        samples.append(sample(cluster, t0, extra))
        for n, pid in watched().items():
            maps.setdefault(n, [None]).append(smaps(pid))
        restarts = cluster.restarts()
    finally:
        for p in variants.values():
            p.stop()
        cluster.stop()
    procs = summarize(samples, duration * 0.1)
    engines = {e["name"] for e in cluster.engines()}
    judged = set(extra) or {"router"}
    growth = max((p.get("rss_growth_pct", 0.0) for n, p in procs.items()
                  if n in engines or n in judged), default=0.0)
    flat = all("error" not in p and p["fds"][1] <= p["fds"][0] + FD_SLACK
               and p["threads"][1] <= p["threads"][0] + THREAD_SLACK for p in procs.values())
    kv_leaked = [u for u, m in idle.items() if "error" in m or any(m.values())]
    crashed = bool(restarts["restarted"] or restarts["replaced"] or not restarts["up_alive"])
    total: Counter = sum(counts.values(), Counter())
    out = {"minutes": args.minutes, "topology": args.topology, "clients": args.clients,
           "load_s": round(load_s, 1), "wall_s": round(time.monotonic() - t_start, 1),
           "sample_s": period, "samples": len(samples), "requests": dict(total),
           "first_failures": failures, "processes": procs, "rss_growth_pct_max": growth,
           "fds_threads_flat": flat, "kv_after": idle, "kv_leaked": kv_leaked,
           "restarts": restarts, "crashes": int(crashed)}
    # where each judged router's memory grew, after warm-up to the end (None: not read)
    out["smaps"] = {n: smaps_growth(*m) if len(m) == 2 and None not in m else None
                    for n, m in maps.items()}
    if names:
        out["variants"] = {n: {"env": VARIANTS[n], "requests": dict(counts[f"router-{n}"]),
                               "smaps": out["smaps"].get(f"router-{n}")} for n in names}
    out["series"] = samples
    out["ok"] = bool(not total["failed"] and total["ok"] and not kv_leaked and not crashed
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
    for name, sm in r.get("smaps", {}).items():
        sm = sm or {}
        ro = sm.get("rollup_kib", {})
        v = r.get("variants", {}).get(name.removeprefix("router-"), {})
        lines.append(f"{name} {v.get('env', '')} requests {v.get('requests', r['requests'])}; "
                     "smaps KiB warm/end/+: "
                     + ", ".join(f"{f} {'/'.join(map(str, x))}" for f, x in ro.items()))
        lines.append("  by class: " + ", ".join(f"{c} {'/'.join(map(str, x))}"
                                                for c, x in sm.get("by_class_kib", {}).items()))
        lines.append("  top: " + ", ".join(f"{m['name']}@{m['start']}{'(new)' if m['new'] else ''} "
                                           f"+{m['grew_kib']}" for m in sm.get("top_growth", [])[:5]))
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
    ap.add_argument("--variants", default="",
                    help=f"compare routers side by side, comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/harden_soak.json")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the cluster's state and logs here (default: a temporary folder)")
    return run_suite(ap.parse_args(), soak, table, "harden-soak-")


if __name__ == "__main__":
    sys.exit(main())
