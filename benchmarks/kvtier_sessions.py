"""Paused conversations: device only vs CPU tier (LRU) vs CPU tier (session policy).

For each ratio R of live session KV to the device pool, starts `agentserve serve` with a
device pool of (sessions x est. context tokens / R), replays the Weka sample trace with
`agentserve bench --mode sessions` (its recorded pauses), and reads TTFT p50/p90 and
output tok/s from summary.json and restored bytes from /metrics. JSON + a table.

    .venv/bin/python benchmarks/kvtier_sessions.py --ratios 1.5,3,5 --sessions 8 \\
        --token-scale 1 --duration 60 --out bench-out/kvtier_sessions.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "weka-cc-sample.jsonl.gz"
CLI = str(Path(sys.executable).parent / "agentserve")
CONFIGS = {"device": [], "cpu-lru": ["--kv-cpu-gib", "1", "--kv-cpu-policy", "lru"],
           "cpu-session": ["--kv-cpu-gib", "1", "--kv-cpu-policy", "session"]}


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


def restored_bytes(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("agentserve:kv_restore_bytes_total{"))


def run_one(name: str, kv_tokens: int, a: argparse.Namespace, out_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [CLI, "serve", "--port", str(port),
             "--kv-cache-tokens", str(kv_tokens), "--log-level", "warning", *CONFIGS[name]]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, proc)
        bench = [CLI, "bench", "--url", url, "--trace", str(a.trace),
                 "--mode", "sessions", "--sessions", str(a.sessions), "--token-scale",
                 str(a.token_scale), "--duration", str(a.duration), "--max-output", str(a.max_output),
                 "--gap-cap", str(a.gap_cap), "--out", str(out_dir)]
        subprocess.run(bench, check=False, timeout=a.duration * 4 + 120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        restored = restored_bytes(url)
    finally:
        proc.terminate()
        proc.wait(30)
    s = json.loads((out_dir / "summary.json").read_text())[0]
    return {"ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
            "output_tok_s": s["output_tok_s"], "requests_ok": s.get("requests_ok"),
            "restored_gib": restored / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--ratios", default="1.5,3,5")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--token-scale", type=int, default=1)
    ap.add_argument("--context-tokens", type=int, default=2000,
                    help="estimated live context per session at this token scale")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--gap-cap", type=float, default=30)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="bench-out/kvtier_sessions.json")
    a = ap.parse_args()
    res: dict = {"args": vars(a), "runs": {}}
    for r in map(float, a.ratios.split(",")):
        kv_tokens = int(a.sessions * a.context_tokens / r)
        for name in a.configs.split(","):
            out_dir = Path(a.out).parent / f"kvtier_sessions_{r}x_{name}"
            res["runs"][f"{r}x/{name}"] = {"kv_cache_tokens": kv_tokens,
                                          **run_one(name, kv_tokens, a, out_dir)}
            Path(a.out).write_text(json.dumps(res, indent=2))
    print("| live/device | config | TTFT p50 s | TTFT p90 s | out tok/s | restored GiB |")
    print("|---|---|---|---|---|---|")
    for k, v in res["runs"].items():
        ratio, name = k.split("/")
        print(f"| {ratio} | {name} | {v['ttft_p50_s']:.3f} | {v['ttft_p90_s']:.3f} | "
              f"{v['output_tok_s']:.1f} | {v['restored_gib']:.4f} |")


if __name__ == "__main__":
    main()
