"""The chaos suite at a small size: a real `agentserve up --topology 2P1D`, the router and
the decode engine killed -9 under streamed agent sessions (benchmarks/harden_chaos.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_chaos_kills_lose_no_unstarted_request_leak_no_kv_and_keep_the_index(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "harden_chaos.py"), "--minutes", "1",
           "--kill-every", "12", "--victims", "router,decode2,router", "--sessions", "4",
           "--transfer-timeout", "10", "--run-dir", str(tmp_path / "run"), "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    failed = [name for name, ok in res["checks"].items() if not ok]
    assert not failed and r.returncode == 0, (failed, r.stdout[-3000:])
    kinds = res["kills_by_kind"]
    assert kinds.get("router", 0) >= 1 and kinds.get("decode", 0) >= 1, kinds
    req = res["requests"]
    assert req["lost_unstarted"] == 0 and req["hangs"] == 0 and req["bad_status"] == 0
    assert req["ok"] > 20 and req["retried"] >= 1  # the router's outage was retried through
    # every restart checked, each router restart's very next probe turn exact
    p = res["predictions"]
    assert p["router_restart_total"] >= 1 and p["router_restart_passed"] == p["router_restart_total"]
    assert p["probe_passed"] == p["probe_total"] == len(res["kills"])
    for k in res["kills"]:
        assert res["restarts"][k["victim"]] >= 1 and k["back_s"] is not None
    assert all(not any(m.values()) for m in res["idle"].values()), res["idle"]
