"""Paused conversations: device only vs CPU tier (LRU) vs CPU tier (session policy).

Workload: synthesized production-shaped agent sessions (``agentserve.workload.synth``,
profile ``sweep`` = fresh Claude Code sessions, sub-agent groups included) written to a
JSONL trace, or ``--trace FILE``. Pauses are the trace's idle gaps (production: 2 s
median, 24 s p90), times ``--gap-scale``, capped at ``--gap-cap``.

Sizing: ``live_kv`` simulates the closed-loop replay offline (K sessions at once, the
recorded pauses, ~``--service-s`` per request) and averages, over the run, the summed
current context of every live session (main agent + running sub-agents), in scaled
tokens. For each ratio R the device pool is ``live / R`` tokens and the CPU tier
``--cpu-x x live`` tokens worth of bytes (``--kv-bytes-per-token``, tiny model: 4096):
a CPU tier smaller than the sessions' footprint, so its retention policy matters.

For each (R, config) it starts ``agentserve serve``, runs ``agentserve bench --mode
sessions`` and reads TTFT p50/p90 (all requests, and resumed requests = every request
of a session but its first), output tok/s from the records, and restored / stored bytes,
tier hit tokens, evictions and restore decisions from /metrics. JSON + a table.

    .venv/bin/python benchmarks/kvtier_sessions.py --ratios 1.5,3,5 --sessions 16 \\
        --token-scale 4 --duration 50 --out bench-out/kvtier_sessions.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

CLI = str(Path(sys.executable).parent / "agentserve")
CONFIGS = {"device": None, "cpu-lru": "lru", "cpu-session": "session"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not up after {timeout}s")


def scrape(url: str) -> dict[str, float]:
    """agentserve:kv_* and vllm:prefix_cache_* counters, summed per name{label}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith(("agentserve:kv_", "vllm:prefix_cache_")):
            head, _, val = ln.rpartition(" ")
            try:
                out[head] = out.get(head, 0.0) + float(val)
            except ValueError:
                pass
    return out


def metric(m: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] in (name, name + "_total")
               and label in k)


# ---- offline sizing -------------------------------------------------------------------
def _scaled(tokens: int, ts: int, bs: int = 64) -> int:
    return max(1, round(tokens * ts / bs))


def session_timeline(s, ts: int, gap_scale: float, cap: float, service: float):
    """[(start, end, context tokens)] of every request of a session, on its own clock."""
    from agentserve.workload.replay_plan import idle_gap, step_end, step_start, steps_of
    from agentserve.workload.schema import TraceRequest

    out, now = [], 0.0
    steps = steps_of(s)
    prev = step_start(steps[0]) if steps else 0.0
    for st in steps:
        now += idle_gap(step_start(st) - prev, gap_scale, cap)
        if isinstance(st, TraceRequest):
            out.append((now, now + service, _scaled(st.input_tokens + st.output_tokens, ts)))
            now += service
        else:
            ends = []
            for sub in st:
                t, pe = now, 0.0
                for r in sub.requests:
                    t += idle_gap(r.t - pe, gap_scale, cap)
                    out.append((t, t + service, _scaled(r.input_tokens + r.output_tokens, ts)))
                    t += service
                    pe = r.t + (r.api_time or 0.0)
                ends.append(t)
            now = max(ends, default=now)
        prev = step_end(st)
    return out, now


def live_kv(sessions, k: int, ts: int, gap_scale: float, cap: float, duration: float,
            service: float) -> dict:
    """Mean and p90 over the run of the summed live context of the sessions in flight."""
    grid = np.linspace(0, duration, 200)
    live = np.zeros_like(grid)
    workers = [0.0] * k
    heapq.heapify(workers)
    for s in sessions:
        t0 = heapq.heappop(workers)
        if t0 >= duration:
            break
        reqs, length = session_timeline(s, ts, gap_scale, cap, service)
        # Each agent's (main or sub-agent) context lives from its request until the next.
        # Approximation: a session's footprint = its latest main context + running subs.
        for i, (a, b, ctx) in enumerate(reqs):
            nxt = reqs[i + 1][0] if i + 1 < len(reqs) else length
            live[(grid >= t0 + a) & (grid < t0 + max(nxt, b))] += ctx
        heapq.heappush(workers, t0 + length + service)
    steady = live[grid >= duration * 0.25]
    return {"mean": float(steady.mean()), "p90": float(np.percentile(steady, 90))}


# ---- one run ---------------------------------------------------------------------------
def summarize(out_dir: Path, duration: float) -> dict:
    recs = [json.loads(ln) for ln in (out_dir / "requests.jsonl").read_text().splitlines() if ln]
    ok = [r for r in recs if r.get("ttft") is not None and not r.get("error")]
    ok.sort(key=lambda r: r["start"])
    seen: set[str] = set()
    resumed = []
    for r in ok:
        (resumed if r["session_id"] in seen else []).append(r)
        seen.add(r["session_id"])
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else None)
    t_all, t_res = [r["ttft"] for r in ok], [r["ttft"] for r in resumed]
    s = json.loads((out_dir / "summary.json").read_text())[0]
    return {"requests_ok": len(ok), "requests_failed": len(recs) - len(ok),
            "resumed_requests": len(resumed),
            "ttft_p50_s": pct(t_all, 50), "ttft_p90_s": pct(t_all, 90),
            "resumed_ttft_p50_s": pct(t_res, 50), "resumed_ttft_p90_s": pct(t_res, 90),
            "output_tok_s": s["output_tok_s"], "input_tokens": sum(r["input_tokens"] for r in ok),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
            "bench_duration_s": s.get("duration_s")}


def run_one(name: str, kv_tokens: int, cpu_gib: float, a: argparse.Namespace, trace: str,
            out_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [CLI, "serve", "--port", str(port), "--kv-cache-tokens", str(kv_tokens),
             "--max-num-batched-tokens", str(a.max_batched), "--log-level", "warning"]
    if CONFIGS[name]:
        serve += ["--kv-cpu-gib", f"{cpu_gib:.6f}", "--kv-cpu-policy", CONFIGS[name]]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        wait_up(url, proc)
        bench = [CLI, "bench", "--url", url, "--trace", trace, "--mode", "sessions",
                 "--sessions", str(a.sessions), "--token-scale", str(a.token_scale),
                 "--duration", str(a.duration), "--max-output", str(a.max_output),
                 "--gap-scale", str(a.gap_scale), "--gap-cap", str(a.gap_cap),
                 "--request-timeout", str(a.request_timeout), "--out", str(out_dir)]
        subprocess.run(bench, check=False, timeout=a.duration + a.request_timeout + 120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        m = scrape(url)
    finally:
        proc.terminate()
        proc.wait(30)
    r = summarize(out_dir, a.duration)
    gib = 2**30
    r.update({
        "restored_gib": metric(m, "agentserve:kv_restore_bytes") / gib,
        "stored_gib": metric(m, "agentserve:kv_store_bytes", 'tier="cpu"') / gib,
        "cpu_hit_tokens": metric(m, "agentserve:kv_tier_hit_tokens", 'tier="cpu"'),
        "gpu_hit_tokens": metric(m, "agentserve:kv_tier_hit_tokens", 'tier="gpu"'),
        "cpu_evictions": metric(m, "agentserve:kv_tier_evictions", 'tier="cpu"'),
        "restore_decisions": metric(m, "agentserve:kv_restore_decisions", 'choice="restore"'),
        "stores_skipped": metric(m, "agentserve:kv_stores_skipped"),
        "recompute_decisions": metric(m, "agentserve:kv_restore_decisions", 'choice="recompute"'),
        "wall_s": time.monotonic() - t0})
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="Weka JSONL; default: synthesize")
    ap.add_argument("--profile", default="sweep")
    ap.add_argument("--synth-sessions", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ratios", default="1.5,3,5")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--token-scale", type=int, default=4)
    ap.add_argument("--duration", type=float, default=50)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--gap-scale", type=float, default=1.0)
    ap.add_argument("--gap-cap", type=float, default=30)
    ap.add_argument("--service-s", type=float, default=0.3, help="sizing: seconds per request")
    ap.add_argument("--cpu-x", type=float, default=1.0, help="CPU tier size / live KV")
    ap.add_argument("--kv-bytes-per-token", type=int, default=4096, help="tiny model: 4096")
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="bench-out/kvtier_sessions.json")
    a = ap.parse_args()
    from agentserve.workload.traces import load_sessions, write_sessions

    trace = a.trace
    if trace is None:
        from agentserve.workload.synth import synthesize
        trace = str(Path(a.out).parent / f"kvtier_sessions_{a.profile}_{a.synth_sessions}_s{a.seed}.jsonl")
        if not Path(trace).exists():
            write_sessions(synthesize(a.profile, a.synth_sessions, seed=a.seed), trace)
    sessions = load_sessions(trace).sessions
    live = live_kv(sessions, a.sessions, a.token_scale, a.gap_scale, a.gap_cap, a.duration,
                   a.service_s)
    cpu_tokens = int(a.cpu_x * live["mean"])
    cpu_gib = cpu_tokens * a.kv_bytes_per_token / 2**30
    res: dict = {"args": vars(a), "trace": trace, "live_kv_tokens": live,
                 "cpu_tier_tokens": cpu_tokens, "cpu_tier_gib": cpu_gib, "runs": {}}
    print(f"live KV ~{live['mean']:.0f} tokens (p90 {live['p90']:.0f}); CPU tier {cpu_tokens} "
          f"tokens = {cpu_gib:.4f} GiB", flush=True)
    for r in map(float, a.ratios.split(",")):
        kv_tokens = int(live["mean"] / r)
        for name in a.configs.split(","):
            out_dir = Path(a.out).parent / f"kvtier_sessions_{r:g}x_{name}"
            v = res["runs"][f"{r:g}x/{name}"] = {"kv_cache_tokens": kv_tokens,
                                                 **run_one(name, kv_tokens, cpu_gib, a, trace, out_dir)}
            print(f"{r:g}x {name}: {json.dumps(v)}", flush=True)
            Path(a.out).write_text(json.dumps(res, indent=2))
    print(table(res))


def table(res: dict) -> str:
    lines = ["| live/device | config | requests | TTFT p50 s | TTFT p90 s | resumed TTFT p50 s | "
             "out tok/s | restored GiB | stored GiB |", "|---|---|---|---|---|---|---|---|---|"]
    f = (lambda x, p=3: "-" if x is None else f"{x:.{p}f}")
    for k, v in res["runs"].items():
        ratio, name = k.split("/")
        lines.append(f"| {ratio} | {name} | {v['requests_ok']} | {f(v['ttft_p50_s'])} | "
                     f"{f(v['ttft_p90_s'])} | {f(v['resumed_ttft_p50_s'])} | {f(v['output_tok_s'], 1)} | "
                     f"{f(v['restored_gib'], 4)} | {f(v['stored_gib'], 4)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
