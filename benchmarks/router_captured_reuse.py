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
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.router.procs import PY, free_port, our_engine, router, stop, wait_http  # noqa: E402

POLICIES = {
    "round-robin": {"policy": "round-robin"},
    "least-loaded": {"policy": "least-loaded"},
    "approx-prefix": {"policy": "approx-prefix"},
    "precise-prefix": {"policy": "precise-prefix"},
    # the previous default: precise + speculative, max picker, affinity as tie-break
    "precise+speculative (max)": {"policy": "precise-prefix", "scorers": {"session": 0.1},
                                  "options": {"speculative_ttl_s": 2.0}},
    # default: precise + speculative + sticky until saturated (wait, penalty 2 s) +
    # session balance .5 + prefix 2 (see config.PRESETS)
    "default": {"policy": "default"},
    # tuning variants of default that lost (README)
    "sticky 1 s, prefix 1, balance 1": {"policy": "default", "scorers": {"prefix": 1.0,
                                        "balance": 1.0}, "picker": {"penalty_s": 1.0}},
    "sticky 2 s, prefix 2, balance 1": {"policy": "default", "scorers": {"balance": 1.0}},
}


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        out[name] = sum(float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)",
                                                     text, re.M))
    return out


def decisions(router_url: str) -> dict[str, float]:
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    per: dict[str, float] = {}
    for ep, v in re.findall(r'^agentserve_router_decisions_total{endpoint="([^"]+)"[^}]*} (\S+)',
                            text, re.M):
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
    procs = [our_engine(p, e, tmp / f"e{i}.log", a.kv_tokens, a.engine_args.split())
             for i, (p, e) in enumerate(zip(ports, evs))]
    rport = free_port()
    try:
        for u, pr in zip(urls, procs):
            wait_http(u + "/health", pr)
        procs.append(router(rport, cfg, tmp / "router.log"))
        rurl = f"http://127.0.0.1:{rport}"
        wait_http(rurl + "/health", procs[-1], 60)
        out = tmp / "bench"
        subprocess.run([PY, "-m", "agentserve.cli", "bench", "--url", rurl, "--trace", a.trace,
                        "--mode", "sessions", "--sessions", str(a.sessions),
                        "--token-scale", str(a.token_scale), "--max-turns", str(a.max_turns),
                        "--gap-cap", str(a.gap_cap), "--max-output", str(a.max_output),
                        "--duration", str(a.duration), "--out", str(out)],
                       check=True, timeout=a.duration + 300, stdout=subprocess.DEVNULL)
        summ = json.loads((out / "summary.json").read_text())
        per = decisions(rurl)
        eng = [scrape(u) for u in urls]
    finally:
        stop(procs)
    s = summ[0] if isinstance(summ, list) else summ  # summary.json: one object per stage
    hits = sum(e["vllm:prefix_cache_hits_total"] for e in eng)
    queries = sum(e["vllm:prefix_cache_queries_total"] for e in eng)
    counts = [per.get(u, 0.0) for u in urls]
    return {"policy": name, "captured_reuse": s.get("captured_reuse"),
            "cached_token_ratio": s.get("cached_token_ratio"),
            "reusable_ceiling_ratio": s.get("reusable_ceiling_ratio"),
            "engine_hits_over_queries": hits / queries if queries else None,
            "balance_max_over_min": max(counts) / max(1.0, min(counts)), "requests": counts,
            "ttft_p50_s": (s.get("ttft_s") or {}).get("p50"),
            "ttft_p90_s": (s.get("ttft_s") or {}).get("p90"),
            "output_tok_s": s.get("output_tok_s")}


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
    ap.add_argument("--gap-cap", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--engine-args", default="", help="extra `agentserve serve` flags, e.g. "
                    "'--kv-cpu-gib 1 --kv-cpu-policy session' for a CPU tier below each engine")
    ap.add_argument("--out", default="bench-out/router_captured_reuse.json")
    a = ap.parse_args()
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
