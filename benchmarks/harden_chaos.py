"""Claim: a P/D cluster with a process killed -9 every 30 s loses no request that had not
started, ends every broken stream with a clear error, leaks no KV, and its router's index
is exact again after each restart.

Starts `agentserve up --topology 2P1D` (tiny model) with `--state`, replays `--sessions`
agent sessions through the router (closed loop: each turn re-sends the whole context plus
a short user message; streamed chat completions and Anthropic messages, alternating by
session; `_chaos_client.py`), and every `--kill-every` s for `--minutes` kills -9 one
process: either prefill engine, the decode engine or the router, in a seeded order (each
round of four kills is a shuffle of all four; `--victims` gives the order instead). A kill
waits for the previous victim to be back (the launcher restarts it on its ports; its new
pid in the state file) and checked, so each kill is of a serving cluster.

Checks (exit 1 when one fails), in the JSON's `checks`:
- lost_unstarted = 0: a turn that failed before its stream began (refused or reset while
  the router was down, a 5xx) is retried as an SDK does (`--tries` within `--retry-window`
  s, backoff) and must succeed; 0 4xx;
- a started stream that broke ends with a clear error (an error event, or a connection
  closed before the API's end marker), never a hang: every read has `--read-timeout`;
- after each restart, the next turn of each probe session (quiet sessions whose prefix
  the decode engine holds) has x-agentserve-predicted-cached == the engine's cached
  tokens (> 0); after a router restart that is its very next turn (the index rebuilt from
  the engines' replay sockets), after an engine restart within one more turn (a restarted
  decode engine first pulls the prefix back);
- every kill restarted (state file restart counts = kills), `up` still serving;
- no leaked KV: the load stopped, each engine's /metrics reaches kv usage 0, running 0,
  waiting 0 (within `--transfer-timeout` + 30 s: pins of a request whose router died
  between its legs expire then); no process left after `up` stops.

    .venv/bin/python benchmarks/harden_chaos.py --minutes 10 --kill-every 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _chaos_client import AgentSession, Outcome, RetryPolicy, error_kind, send_turn  # noqa: E402
from _cluster import UpCluster, pid_alive, wait_idle  # noqa: E402

HERE = Path(__file__).resolve().parent


def victim_plan(names: list[str], n: int, seed: int, explicit: str) -> list[str]:
    """`n` victims: `explicit` (comma list, cycled) or seeded shuffles of all of `names`."""
    if explicit:
        order = [v.strip() for v in explicit.split(",") if v.strip()]
        unknown = sorted(set(order) - set(names))
        if unknown:
            raise SystemExit(f"--victims: unknown {unknown}; the processes are {names}")
        return [order[i % len(order)] for i in range(n)]
    rng, out = random.Random(seed), []
    while len(out) < n:
        rnd = list(names)
        rng.shuffle(rnd)
        out += rnd
    return out[:n]


def kind_of(name: str) -> str:
    return name.rstrip("0123456789")


def pid_restarts(st: dict[str, Any], name: str) -> tuple[int, int]:
    """(pid, restarts) of one process in the launcher's state."""
    if name == "router":
        return st["router_pid"], st.get("router_restarts", 0)
    e = next(e for e in st["engines"] if e["name"] == name)
    return e["pid"], e.get("restarts", 0)


def kill(cl: UpCluster, name: str) -> dict[str, Any]:
    """SIGKILL the process now serving as `name` (checked to be an agentserve process)."""
    pid, restarts = pid_restarts(cl.state(), name)
    try:  # (a pid the launcher has not replaced yet could be reused by anything)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid_alive(pid) else b""
    except OSError:
        cmdline = b""
    if b"agentserve" not in cmdline:
        raise RuntimeError(f"{name} (pid {pid}) is not running; the launcher's state is stale")
    os.kill(pid, signal.SIGKILL)
    return {"victim": name, "kind": kind_of(name), "pid": pid, "restarts_before": restarts}


async def wait_back(cl: UpCluster, name: str, before: int, timeout: float) -> float | None:
    """Seconds until the state file shows `name` restarted and serving; None past timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pid_restarts(cl.state(), name)[1] > before:
                return time.monotonic() - t0
        except (OSError, ValueError):
            pass  # (replaced atomically; a read can still race the first write)
        await asyncio.sleep(0.2)
    return None


async def wait_routable(http: aiohttp.ClientSession, router: str, urls: list[str],
                        timeout: float = 60.0) -> bool:
    """The router answers /health and counts every engine healthy (re-admitted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with http.get(router + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if set(urls) <= set((await r.json()).get("healthy", [])):
                    return True
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            pass
        await asyncio.sleep(0.2)
    return False


async def probe(http: aiohttp.ClientSession, router: str, s: AgentSession,
                policy: RetryPolicy, turns: int) -> dict[str, Any]:
    """Up to `turns` turns of a quiet session until one carries the router's prediction;
    exact when that prediction equals the engine's cached tokens (and is not 0)."""
    seen = []
    for _ in range(turns):
        body, user = s.next_turn(4)
        out = await send_turn(http, router, "chat", body, {"x-session-id": s.sid}, policy)
        seen.append({"status": out.status, "predicted": out.predicted, "cached": out.cached,
                     "endpoint": out.endpoint, "pd": out.pd, "error": out.error})
        if out.status == "ok":
            s.commit(user, out)
            if out.predicted is not None:
                break
        await asyncio.sleep(0.5)  # a pulled prefix's BlockStored events reach the router
    last = seen[-1]
    exact = (last["status"] == "ok" and last["predicted"] is not None
             and last["predicted"] == last["cached"] and (last["cached"] or 0) > 0)
    return {"exact": exact, "turns": seen}


async def load(http: aiohttp.ClientSession, router: str, s: AgentSession, stop: asyncio.Event,
               outcomes: list[Outcome], policy: RetryPolicy, rng: random.Random) -> None:
    """One closed-loop agent: a turn, a short think, the next turn, until `stop`."""
    while not stop.is_set():
        body, user = s.next_turn(rng.randint(8, 40))
        out = await send_turn(http, router, s.api, body,
                              {"x-session-id": f"{s.sid}-{s.generation}"}, policy)
        outcomes.append(out)
        if out.status == "ok":
            s.commit(user, out)
        await asyncio.sleep(rng.uniform(0.05, 0.3))


async def chaos(cl: UpCluster, http: aiohttp.ClientSession, plan: list[str], probes: list[AgentSession],
                args: argparse.Namespace, policy: RetryPolicy, t0: float) -> list[dict[str, Any]]:
    """Kill the plan's victims every `kill_every` s until `minutes` have passed; after each,
    wait for the restart and re-admission and probe the index."""
    router, urls = cl.first["router"], [e["url"] for e in cl.first["engines"]]
    end, due, kills = t0 + args.minutes * 60, t0 + args.kill_every, []
    for name in plan:
        if due >= end:
            break
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        k = kill(cl, name)
        k["t_s"] = round(time.monotonic() - t0, 1)
        k["back_s"] = await wait_back(cl, name, k["restarts_before"], args.restart_timeout)
        if k["back_s"] is None:  # not restarted: the check fails; nothing more to learn
            kills.append({**k, "routable": False, "probes": [], "exact": False})
            break
        k["routable"] = await wait_routable(http, router, urls)
        turns = 1 if name == "router" else 2
        k["probes"] = [await probe(http, router, s, policy, turns) for s in probes]
        k["exact"] = all(p["exact"] for p in k["probes"])
        kills.append(k)
        due = max(due + args.kill_every, time.monotonic())
    return kills


async def drive(cl: UpCluster, args: argparse.Namespace) -> dict[str, Any]:
    """Warm the probes, run load and chaos for `minutes`, stop the load (bounded)."""
    router = cl.first["router"]
    policy = RetryPolicy(tries=args.tries, window_s=args.retry_window,
                         read_timeout_s=args.read_timeout)
    names = [e["name"] for e in cl.first["engines"]] + ["router"]
    plan = victim_plan(names, int(args.minutes * 60 // args.kill_every) + 1, args.seed, args.victims)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        probes = [AgentSession(f"probe{i}", "chat", args.seed * 1000 + i) for i in range(args.probes)]
        baseline = [await probe(http, router, s, policy, 3) for s in probes]
        stop, rng = asyncio.Event(), random.Random(args.seed)
        sessions = [AgentSession(f"s{i}", ("chat", "messages")[i % 2], args.seed * 1000 + 100 + i)
                    for i in range(args.sessions)]
        tasks = [asyncio.create_task(load(http, router, s, stop, outcomes, policy,
                                          random.Random(rng.random()))) for s in sessions]
        t0 = time.monotonic()
        kills = await chaos(cl, http, plan, probes, args, policy, t0)
        await asyncio.sleep(max(0.0, t0 + args.minutes * 60 - time.monotonic()))
        stop.set()
        bound = policy.window_s + 2 * policy.read_timeout_s + 30
        _, stuck = await asyncio.wait(tasks, timeout=bound)
        for t in stuck:
            t.cancel()
    first, last = (t0 + kills[0]["t_s"], t0 + kills[-1]["t_s"]) if kills else (t0, t0)
    return {"kills": kills, "outcomes": outcomes, "baseline": baseline, "stuck": len(stuck),
            "first_kill": first, "last_kill": last}


def p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(run: dict[str, Any], idle: dict[str, Any], final: dict[str, Any],
              up_alive: bool, orphans: list[int]) -> dict[str, Any]:
    """The report: counts, checks and the per-kill detail."""
    outs: list[Outcome] = run["outcomes"]
    by = Counter(o.status for o in outs)
    kills = run["kills"]
    killed = Counter(k["victim"] for k in kills)
    restarts = {e["name"]: e.get("restarts", 0) for e in final["engines"]}
    restarts["router"] = final.get("router_restarts", 0)
    preds = [o for o in outs if o.status == "ok" and o.predicted is not None]
    router_kills = [k for k in kills if k["kind"] == "router"]
    engine_kills = [k for k in kills if k["kind"] != "router"]
    requests = {"total": len(outs), "ok": by["ok"], "retried": sum(o.tries > 1 for o in outs),
                "retries": sum(o.tries - 1 for o in outs), "failed_started": by["failed_started"],
                "lost_unstarted": by["lost"], "bad_status": by["bad_status"],
                "hangs": sum(o.hangs for o in outs), "stuck_sessions": run["stuck"]}
    checks = {
        "kills_happened": bool(kills),
        "no_lost_unstarted": by["lost"] == 0,
        "no_4xx": by["bad_status"] == 0,
        "no_hangs": requests["hangs"] == 0 and run["stuck"] == 0,
        "baseline_exact": all(p["exact"] for p in run["baseline"]),
        "index_exact_after_router_restarts": all(k["exact"] for k in router_kills),
        "exact_after_engine_restarts": all(k["exact"] for k in engine_kills),
        "every_kill_restarted": all(k["back_s"] is not None and k["routable"] for k in kills)
        and all(restarts.get(n, 0) == c for n, c in killed.items()),
        "up_alive": up_alive,
        "served_after_last_kill": any(o.status == "ok" and o.t0 > run["last_kill"] for o in outs),
        "no_leaked_kv": all("error" not in m and not any(m.values()) for m in idle.values()),
        "no_orphans": not orphans,
    }
    return {
        "kills_by_kind": dict(Counter(k["kind"] for k in kills)), "restarts": restarts,
        "requests": requests,
        "failed_started_errors": dict(Counter(error_kind(o.error) for o in outs
                                              if o.status == "failed_started")),
        "lost_errors": [o.error for o in outs if o.status in ("lost", "bad_status")][:20],
        "retry_errors": dict(Counter(error_kind(e) for o in outs for e in o.retry_errors)),
        "ttft_p50_s": {"before_kills": p50([o.ttft_s for o in outs if o.status == "ok"
                                            and o.ttft_s and o.t0 < run["first_kill"]]),
                       "after_kills": p50([o.ttft_s for o in outs if o.status == "ok"
                                           and o.ttft_s and o.t0 >= run["first_kill"]])},
        "predictions": {"probe_passed": sum(k["exact"] for k in kills), "probe_total": len(kills),
                        "router_restart_passed": sum(k["exact"] for k in router_kills),
                        "router_restart_total": len(router_kills),
                        "load_exact": sum(o.predicted == o.cached for o in preds),
                        "load_checked": len(preds)},
        "idle": idle, "kills": kills, "baseline": run["baseline"],
        "checks": checks, "ok": all(checks.values()),
    }


def show(res: dict[str, Any]) -> None:
    c = Console()
    t = Table(title="chaos: 2P1D, a process killed -9 every "
                    f"{res['config']['kill_every']} s for {res['config']['minutes']} min")
    t.add_column("measure")
    t.add_column("value", justify="right")
    r, p = res["requests"], res["predictions"]
    rows = [("kills by kind", json.dumps(res["kills_by_kind"])),
            ("restarts (state file)", json.dumps(res["restarts"])),
            ("requests total / ok", f"{r['total']} / {r['ok']}"),
            ("retried (tries beyond the first)", f"{r['retried']} ({r['retries']})"),
            ("started, then failed (clear error)", str(r["failed_started"])),
            ("lost unstarted / 4xx / hangs", f"{r['lost_unstarted']} / {r['bad_status']} / {r['hangs']}"),
            ("TTFT p50 before / after kills (s)",
             f"{res['ttft_p50_s']['before_kills']} / {res['ttft_p50_s']['after_kills']}"),
            ("exact after restarts (router)", f"{p['probe_passed']}/{p['probe_total']} "
             f"({p['router_restart_passed']}/{p['router_restart_total']})"),
            ("load turns predicted exactly", f"{p['load_exact']}/{p['load_checked']}")]
    for row in rows:
        t.add_row(*row)
    c.print(t)
    for name, ok in res["checks"].items():
        c.print(f"{'[green]ok  ' if ok else '[red]FAIL'}[/] {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=float, default=30.0)
    ap.add_argument("--sessions", type=int, default=6, help="closed-loop agent sessions")
    ap.add_argument("--probes", type=int, default=2, help="quiet sessions checked after restarts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--victims", default="", help="kill order by the state file's names "
                    "(prefill0, prefill1, decode2, router), e.g. router,decode2 (cycled; "
                    "default: seeded shuffles of all four)")
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--retry-window", type=float, default=30.0)
    ap.add_argument("--read-timeout", type=float, default=60.0)
    ap.add_argument("--restart-timeout", type=float, default=120.0)
    ap.add_argument("--transfer-timeout", type=float, default=15.0,
                    help="engines' --kv-transfer-timeout (unpulled pins expire after it)")
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "harden_chaos.json")
    args = ap.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="harden-chaos-"))
    engine_args = (f"--kv-cache-tokens {args.kv_tokens} --max-model-len 4096 "
                   f"--kv-transfer-timeout {args.transfer_timeout}")
    # any one process can be the victim of every kill in 5 minutes: never given up on
    max_restarts = max(5, int(300 / args.kill_every) + 1)
    cl = UpCluster(run_dir, "2P1D", engine_args, {"AGENTSERVE_KV_TRANSFER_TOKEN": secrets.token_hex(16)},
                   extra=["--max-restarts", str(max_restarts)])
    t_start = time.monotonic()
    cl.start()
    pids: set[int] = set(cl.pids().values())
    try:
        run = asyncio.run(drive(cl, args))
        pids |= set(cl.pids().values())
        idle = wait_idle([e["url"] for e in cl.first["engines"]], args.transfer_timeout + 30)
        final, up_alive = cl.state(), cl.restarts()["up_alive"]
    finally:
        cl.stop()
    time.sleep(0.5)
    pids |= {k["pid"] for k in run["kills"]}
    res = summarize(run, idle, final, up_alive, sorted(p for p in pids if pid_alive(p)))
    res["config"] = {"topology": "2P1D", "minutes": args.minutes, "kill_every": args.kill_every,
                     "sessions": args.sessions, "probes": args.probes, "seed": args.seed,
                     "victims": args.victims or "seeded", "tries": args.tries,
                     "retry_window_s": args.retry_window, "read_timeout_s": args.read_timeout,
                     "engine_args": engine_args, "max_restarts": max_restarts,
                     "run_dir": str(run_dir), "wall_s": round(time.monotonic() - t_start, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    show(res)
    print(f"wrote {args.out}; logs in {run_dir}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
