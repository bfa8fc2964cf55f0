"""Captured prefix reuse per routing policy: 4 of our engines behind `agentserve route`.

For each policy, fresh engines (KV capacity smaller than the live working set) and a
fresh router are started, then `agentserve bench --mode sessions` replays the same
sessions through the router. Reported per policy: captured reuse (cached / reusable,
from the replay's summary), the engines' own hits/queries, request balance (busiest
over idlest engine, from the router's decisions), TTFT p50/p90, output tok/s.

    .venv/bin/python benchmarks/router_captured_reuse.py --out bench-out/router_reuse.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.router.procs import PY, free_port, our_engine, router, stop, wait_http

POLICIES = {
    "round-robin": {"policy": "round-robin"},
    "least-loaded": {"policy": "least-loaded"},
    "approx-prefix": {"policy": "approx-prefix"},
    "precise-prefix": {"policy": "precise-prefix"},
    # the previous default: precise + speculative, max picker, affinity as tie-break
    "precise+speculative (max)": {"policy": "precise-prefix", "scorers": {"session": 0.1},
                                  "options": {"speculative_ttl_s": 2.0}},
    # default: precise + speculative + sticky until saturated (wait, penalty 2 s; a
    # session moves only to an endpoint with >= 2 fewer active sessions) + new sessions
    # by estimated wait, session balance and live sessions' request rate + rebalancing
    # (a session moves off an endpoint sent 1.1x the requests of the least loaded, while
    # live-session request rates allow, within a recompute budget of 1.5% of reuse)
    # + prefix 2 (config.PRESETS)
    "default": {"policy": "default"},
    # the default before rebalancing: new sessions by recent requests, no moves for balance
    "default without rebalance (before)": {"policy": "default",
                                           "picker": {"rebalance_slack": None},
                                           "scorers": {"rate": 0.0, "requests": 0.5}},
    # rebalancing with new sessions by recent requests instead of rate
    "default, requests .5 for rate": {"policy": "default",
                                      "scorers": {"rate": 0.0, "requests": 0.5}},
    "default, requests .5 for rate, rebalance .2": {
        "policy": "default", "picker": {"rebalance_slack": 0.2},
        "scorers": {"rate": 0.0, "requests": 0.5}},
    # variants of default (README)
    "default without wait": {"policy": "default", "scorers": {"wait": 0.0, "requests": 0.0}},
    "default, wait 2": {"policy": "default", "scorers": {"wait": 2.0, "requests": 0.0}},
    "default without rate": {"policy": "default", "scorers": {"rate": 0.0}},
    # new sessions keep each endpoint's mix of session sizes alike (tokens and count)
    "default, size mix": {"policy": "default", "scorers": {
        "wait": 0.25, "session_tokens": 1.0, "balance": 0.5, "requests": 0.0}},
    "default, moves by wait only": {"policy": "default",
                                    "picker": {"moves_must_balance": False}},
    "default, force moves 15 s": {"policy": "default", "picker": {"force_move_s": 15.0}},
    "default + session tokens .5": {"policy": "default", "scorers": {"session_tokens": 0.5}},
    "default, requests .5 for balance": {"policy": "default",
                                         "scorers": {"balance": 0.0, "requests": 0.5}},
    "default, balance 1": {"policy": "default", "scorers": {"balance": 1.0}},
    # new sessions to the fewest recent requests, guarded by live sessions and wait
    "default, place by requests": {"policy": "default",
                                   "picker": {"place_by": "requests", "place_slack": 1}},
    # sessions count as active for a fixed 60 s after their last turn (before liveness.py)
    "default, fixed 60 s session window": {"policy": "default",
                                           "options": {"session_pause_quantile": None}},
}


# The router with every decision logged (one JSON line: session, prompt length, pick,
# reason, and each candidate's prefix/wait/sessions/score), for the loss analysis below.
_TRACED_ROUTER = r"""
import json, os, sys, time, typer
from agentserve.router import core
from agentserve.router.cli import route
log = open(os.environ["AGENTSERVE_DECISION_LOG"], "w", buffering=1)
orig = core.Router.decide
def decide(self, req, exclude=None):
    if getattr(self.picker, "_traced", None) is not self:
        p, pick = self.picker, self.picker.pick
        def traced(cands, scores):
            self._last = (cands, scores)
            return pick(cands, scores)
        p.pick, p._traced = traced, self
    d = orig(self, req, exclude)
    cands, scores = self._last
    log.write(json.dumps({"t": time.monotonic(), "session": req.session, "len": d.prompt_len,
        "url": d.url, "reason": d.reason, "pred": d.predicted_cached, "cands": [
            {"url": c.url, "w": round(c.weighted_blocks, 1), "tot": c.total_blocks,
             "wait": round(c.est_wait_s, 3), "sess": c.active_sessions, "tok": c.active_tokens,
             "pend": c.pending_prefill, "rr": round(c.recent_requests, 1),
             "ar": round(c.active_rate, 3), "sr": round(c.session_rate, 3),
             "score": round(s, 3)} for c, s in zip(cands, scores)],
        "budget": round(getattr(self.picker, "rebalance_budget", 0) * getattr(self.picker, "reused", 0)
                        - getattr(self.picker, "spent", 0))}) + "\n")
    return d
core.Router.decide = decide
sys.argv = ["route", *sys.argv[1:]]
typer.run(route)
"""


def traced_router(port: int, config: Path, log: Path, decisions_log: Path):
    from tests.router.procs import start
    return start([PY, "-c", _TRACED_ROUTER, "--config", str(config), "--port", str(port)], log,
                 env={"AGENTSERVE_DECISION_LOG": str(decisions_log)})


def loss_analysis(records: Path, decisions_log: Path) -> dict:
    """Where reuse was lost: per request, reusable - cached, joined to its decision by
    (session, prompt length) in order; summed by the decision's reason and by whether
    the session moved away from its previous endpoint."""
    decs: dict[tuple, list[dict]] = {}
    for line in decisions_log.read_text().splitlines():
        d = json.loads(line)
        decs.setdefault((d["session"], d["len"]), []).append(d)
    last: dict[str, str] = {}
    out: dict[str, dict[str, float]] = {}
    recs = [json.loads(x) for x in records.read_text().splitlines()]
    for r in sorted(recs, key=lambda r: r["start"]):
        if r.get("error"):
            continue
        sess = f"{r['stage']}/{r['session_id']}"
        q = decs.get((sess, r["input_tokens"]))
        d = q.pop(0) if q else None
        if d is None:
            key = "unmatched"
        else:
            moved = sess in last and last[sess] != d["url"] and r["agent"] == "main"
            key = d["reason"] + ("+moved" if moved else "")
            if r["agent"] == "main":
                last[sess] = d["url"]
        o = out.setdefault(key, {"requests": 0, "reusable": 0, "lost": 0})
        o["requests"] += 1
        o["reusable"] += r["reusable_tokens"]
        o["lost"] += max(0, r["reusable_tokens"] - r["cached_tokens"])
    return out


def live_working_set(decisions_log: Path) -> dict[str, float]:
    """Tokens of the live sessions' latest prompts (a session is live from its first to
    its last routed request), sampled every second: mean (first 10 s and last 20 s left
    out: ramp-up and drain) and max. Compare with the engines' total device KV."""
    decs = [json.loads(x) for x in decisions_log.read_text().splitlines()]
    if not decs:
        return {}
    last = {d["session"]: d["t"] for d in decs}
    cur: dict[str, int] = {}
    t, i, samples = decs[0]["t"], 0, []
    while t < decs[-1]["t"]:
        while i < len(decs) and decs[i]["t"] <= t:
            cur[decs[i]["session"]] = decs[i]["len"]
            i += 1
        samples.append(sum(n for s, n in cur.items() if last[s] >= t))
        t += 1.0
    mid = samples[10:-20] if len(samples) > 60 else samples
    return {"mean": sum(mid) / len(mid), "max": max(samples)}


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        out[name] = sum(float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)",
                                                     text, re.MULTILINE))
    return out


def decisions(router_url: str) -> dict[str, float]:
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    per: dict[str, float] = {}
    for ep, v in re.findall(r'^agentserve_router_decisions_total{endpoint="([^"]+)"[^}]*} (\S+)',
                            text, re.MULTILINE):
        per[ep] = per.get(ep, 0.0) + float(v)
    return per


def run_policy(name: str, raw: dict, a: argparse.Namespace, tmp: Path) -> dict:
    ports = [free_port() for _ in range(a.engines)]
    evs = [free_port() for _ in range(a.engines)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cfg = tmp / "router.yaml"
    cfg.write_text(yaml.safe_dump({**raw, "endpoints": [
        {"url": u, "kv_events": f"tcp://127.0.0.1:{e}", "block_size": 16,
         "capacity_blocks": a.kv_tokens // 16} for u, e in zip(urls, evs)]}))
    procs = [our_engine(p, e, tmp / f"e{i}.log", a.kv_tokens, a.engine_args.split(),
                        a.engine_threads or None)
             for i, (p, e) in enumerate(zip(ports, evs))]
    rport = free_port()
    try:
        for u, pr in zip(urls, procs):
            wait_http(u + "/health", pr)
        dlog = tmp / "decisions.jsonl"
        procs.append(traced_router(rport, cfg, tmp / "router.log", dlog) if a.keep
                     else router(rport, cfg, tmp / "router.log"))
        rurl = f"http://127.0.0.1:{rport}"
        wait_http(rurl + "/health", procs[-1], 60)
        out = tmp / "bench"
        load0 = os.getloadavg()
        subprocess.run([PY, "-m", "agentserve.cli", "bench", "--url", rurl, "--trace", a.trace,
                        "--mode", "sessions", "--sessions", str(a.sessions),
                        "--token-scale", str(a.token_scale), "--max-turns", str(a.max_turns),
                        "--gap-cap", str(a.gap_cap), "--max-output", str(a.max_output),
                        "--duration", str(a.duration), "--seed", str(a.seed),
                        "--out", str(out)]
                       + (["--max-input", str(a.max_input)] if a.max_input else []),
                       check=True, timeout=a.duration + 300, stdout=subprocess.DEVNULL)
        summ = json.loads((out / "summary.json").read_text())
        per = decisions(rurl)
        eng = [scrape(u) for u in urls]
        load1 = os.getloadavg()
    finally:
        stop(procs)
    extra = {}
    if a.keep:
        keep = Path(a.keep) / re.sub(r"[^A-Za-z0-9.+-]+", "_", name)
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(tmp, keep)
        extra["lost_by_reason"] = loss_analysis(out / "requests.jsonl", dlog)
        extra["live_working_set_tokens"] = live_working_set(dlog)
        extra["device_kv_tokens_total"] = a.kv_tokens * a.engines
    s = summ[0] if isinstance(summ, list) else summ  # summary.json: one object per stage
    hits = sum(e["vllm:prefix_cache_hits_total"] for e in eng)
    queries = sum(e["vllm:prefix_cache_queries_total"] for e in eng)
    counts = [per.get(u, 0.0) for u in urls]
    return {"policy": name, "captured_reuse": s.get("captured_reuse"),
            "cached_token_ratio": s.get("cached_token_ratio"),
            "reusable_ceiling_ratio": s.get("reusable_ceiling_ratio"),
            "engine_hits_over_queries": hits / queries if queries else None,
            "balance_max_over_min": max(counts) / max(1.0, min(counts)), "requests": counts,
            "requests_skipped": s.get("requests_skipped", 0),
            "ttft_p50_s": (s.get("ttft_s") or {}).get("p50"),
            "ttft_p90_s": (s.get("ttft_s") or {}).get("p90"),
            "output_tok_s": s.get("output_tok_s"),
            "requests_ok": s.get("requests_ok"), "sessions_started": s.get("sessions_started"),
            "loadavg_1m_start_end": [load0[0], load1[0]], **extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared" /
                                           "traces" / "weka-cc-sample.jsonl.gz"))
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--token-scale", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--max-input", type=int, default=None,
                    help="skip (and count) requests with more scaled input tokens, e.g. the "
                         "engines' context limit less --max-output; default: send them all "
                         "(the router answers prompts over every engine's limit with a 400)")
    ap.add_argument("--gap-cap", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--engine-args", default="", help="extra `agentserve serve` flags, e.g. "
                    "'--kv-cpu-gib 1 --kv-cpu-policy session' for a CPU tier below each engine")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="OMP_NUM_THREADS per engine (0: torch's default, a thread per core "
                         "in each engine); default: the cores split over the engines, as "
                         "`agentserve up` does")
    ap.add_argument("--seed", type=int, default=0, help="prompt token seed of the replay")
    ap.add_argument("--keep", default=None, help="keep each policy's bench output, router "
                    "decision log and logs under this folder (and report lost reuse by reason)")
    ap.add_argument("--out", default="bench-out/router_captured_reuse.json")
    a = ap.parse_args()
    if a.engine_threads is None:
        a.engine_threads = max(1, (os.cpu_count() or 1) // a.engines)
    rows = []
    for name in a.policies:
        with tempfile.TemporaryDirectory() as d:
            row = run_policy(name, POLICIES[name], a, Path(d))
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
