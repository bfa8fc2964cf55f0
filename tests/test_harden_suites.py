"""The reliability suites at a small size: benchmarks/harden_fuzz.py (300 fuzzed requests
against a real `agentserve up --topology 1P1D`, beside sentinel streams) and
benchmarks/harden_soak.py (half a minute of mixed agent load). Their full-size runs
(10,000 requests; 30 minutes) are the README's reliability figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path, *args: str, timeout: float = 280) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out),
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["_exit"], result["_tail"] = proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:]
    return result


@pytest.mark.slow
def test_fuzz_small(tmp_path: Path) -> None:
    r = _run("harden_fuzz.py", tmp_path / "fuzz.json", "--requests", "300", "--seed", "3")
    assert r["requests"] == 300
    assert r["status_5xx"] == 0 and r["stream_5xx"] == 0, (r["first_5xx"], r["first_stream_5xx"])
    assert r["hangs"] == 0 and r["dropped"] == 0, (r["first_hangs"], r["first_dropped"])
    assert r["crashes"] == 0, r["processes"]
    assert r["sentinel"]["failed"] == 0 and r["sentinel"]["ok"] > 0, r["sentinel"]
    assert r["kv_leaked"] == [], r["kv_after"]
    every = {api for apis in r["by_target_api"].values() for api in apis}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"} <= every
    assert r["ok"] and r["_exit"] == 0, r["_tail"]


@pytest.mark.slow
def test_soak_small(tmp_path: Path) -> None:
    r = _run("harden_soak.py", tmp_path / "soak.json", "--minutes", "0.5",
             # half a minute has no steady state to judge RSS by; fds, threads, KV it has
             "--rss-limit-pct", "100")
    assert r["samples"] >= 8, r["samples"]
    assert r["requests"].get("ok", 0) > 0 and r["requests"].get("failed", 0) == 0, \
        r["first_failures"]
    assert r["crashes"] == 0, r["restarts"]
    assert r["kv_leaked"] == [], r["kv_after"]
    for name, p in r["processes"].items():
        assert "error" not in p, (name, p)
        assert p["fds"][1] <= p["fds"][0] + 16, (name, p["fds"])
        assert p["threads"][1] <= p["threads"][0] + 8, (name, p["threads"])
    assert r["ok"] and r["_exit"] == 0, r["_tail"]
