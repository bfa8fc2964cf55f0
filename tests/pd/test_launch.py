"""`agentserve up`: a real 1P1D cluster as processes; P/D legs; prefill killed; clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from agentserve.launch import Topology, parse_topology
from agentserve.procs import agentserve_cmd, free_port
from tests.pd.test_pd_engine import TOKEN, post


def test_parse_topology() -> None:
    assert parse_topology("1P1D") == Topology(prefill=1, decode=1)
    assert parse_topology("2p1d") == Topology(prefill=2, decode=1)
    assert parse_topology("3") == Topology(both=3)
    assert parse_topology("2P1D").roles == ["prefill", "prefill", "decode"]
    for bad in ("0", "P1D", "1P0D", "x"):
        with pytest.raises(ValueError):
            parse_topology(bad)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_up_1p1d_pd_fallback_and_clean_stop(tmp_path: Path) -> None:
    state, port = tmp_path / "state.json", free_port()
    cmd = agentserve_cmd("up", "--topology", "1P1D", "--port", str(port), "--state", str(state),
                         "--run-dir", str(tmp_path / "run"), "--engine-args",
                         "--kv-cache-tokens 8192 --max-model-len 1024")
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "AGENTSERVE_KV_TRANSFER_TOKEN": TOKEN})  # post signs
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not state.exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "cluster not healthy in 120 s"
            time.sleep(0.3)
        st = json.loads(state.read_text())
        assert st["router"] == f"http://127.0.0.1:{port}"
        eng = {e["role"]: e for e in st["engines"]}
        assert set(eng) == {"prefill", "decode"}
        pids = [e["pid"] for e in st["engines"]]
        body = {"prompt": list(range(5, 305)), "max_tokens": 5, "temperature": 0}
        via_router = post(st["router"], body)["choices"][0]["text"]
        leg = post(eng["prefill"]["url"], {**body, "max_tokens": 1,
                                           "kv_transfer_params": {"do_remote_decode": True}})
        params = leg["kv_transfer_params"]
        assert params["remote_port"] and params["remote_block_ids"]
        # Claude Code's and Codex's APIs take the P/D path too (the router renders them to
        # see what the decode engine lacks)
        msg = post(st["router"], {"max_tokens": 3, "temperature": 0, "messages": [
            {"role": "user", "content": "fix the bug " * 150}]}, "/v1/messages")
        assert msg["type"] == "message" and msg["usage"]["output_tokens"] == 3
        out = post(st["router"], {"max_output_tokens": 3, "temperature": 0,
                                  "input": "run the tests " * 150}, "/v1/responses")
        assert out["object"] == "response" and out["usage"]["output_tokens"] == 3
        os.kill(eng["prefill"]["pid"], signal.SIGKILL)  # prefill engine dies before the pull
        time.sleep(2.5)  # the launcher has seen it die: the cluster must keep serving
        assert up.poll() is None, "launcher stopped the cluster when one prefill engine died"
        got = post(eng["decode"]["url"], {**body, "kv_transfer_params": params})
        assert got["choices"][0]["text"] == via_router  # decode recomputed locally
        again = post(st["router"], {**body, "prompt": list(range(9, 309))})  # prefill down:
        assert again["choices"][0]["finish_reason"] == "length"  # the router falls back
        router_metrics = urllib.request.urlopen(st["router"] + "/metrics").read().decode()
        assert 'agentserve_router_pd_requests_total{path="disaggregated"} 3.0' in router_metrics
        assert 'agentserve_router_pd_requests_total{path="fallback"} 1.0' in router_metrics
        up.send_signal(signal.SIGTERM)  # the launcher notices the dead engine anyway
        up.wait(60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "engine processes left behind"
