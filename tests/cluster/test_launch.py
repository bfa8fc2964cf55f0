"""`agentserve up`: real clusters as processes; P/D legs; engines and the router killed
and restarted by the launcher; the index rebuilt; clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentserve.cluster.launch import Topology, parse_topology
from agentserve.cluster.procs import agentserve_cmd, free_port, start_process
from agentserve.cluster.supervisor import RestartPolicy, Supervised
from tests.kv.remote.test_pd_engine import TOKEN, post


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


def _state(path: Path, up: subprocess.Popen, until: Callable[[dict], bool],
           timeout: float = 120.0) -> dict:
    """The launcher's --state JSON once `until` holds (bounded; fails if `up` exits)."""
    deadline = time.monotonic() + timeout
    while True:
        assert up.poll() is None, up.stdout.read() if up.stdout else ""
        st = json.loads(path.read_text()) if path.exists() else None
        if st is not None and until(st):
            return st
        assert time.monotonic() < deadline, f"state not reached in {timeout:.0f} s: {st}"
        time.sleep(0.2)


@contextmanager
def _up(tmp_path: Path, topology: str, *flags: str) -> Iterator[tuple[subprocess.Popen, Path, set[int]]]:
    """`agentserve up` as a child; yields (process, state path, pids seen) and checks on
    exit that SIGTERM stops it and that no process it ever started is left."""
    state, port = tmp_path / "state.json", free_port()
    cmd = agentserve_cmd("up", "--topology", topology, "--port", str(port), "--state", str(state),
                         "--run-dir", str(tmp_path / "run"), "--engine-args",
                         "--kv-cache-tokens 8192 --max-model-len 1024", *flags)
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "AGENTSERVE_KV_TRANSFER_TOKEN": TOKEN})  # post signs
    pids: set[int] = set()
    try:
        yield up, state, pids
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "processes left behind"


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
          path: str = "/v1/completions") -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers) of one POST; error answers included."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def _healthy_in_router(router: str, url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(router + "/health", timeout=5) as r:
                if url in json.load(r)["healthy"]:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the router did not re-admit {url}"
        time.sleep(0.2)


def _metric(router: str, line: str) -> float:
    text = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
    return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_up_1p1d_pd_fallback_restarts_and_clean_stop(tmp_path: Path) -> None:
    """P/D legs on every API; the prefill engine killed (the router falls back, the
    launcher restarts it); the decode engine killed (a request is retried on the prefill
    engine, the decode engine is back within a bound and the router routes to it again)."""
    with _up(tmp_path, "1P1D") as (up, state, pids):
        st = _state(state, up, lambda st: True)
        eng = {e["role"]: e for e in st["engines"]}
        assert set(eng) == {"prefill", "decode"}
        pids |= {e["pid"] for e in st["engines"]} | {st["router_pid"]}
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
        # sent at once: the launcher waits 0.5 s before restarting it, and it takes seconds
        again = post(st["router"], {**body, "prompt": list(range(9, 309))})  # prefill down:
        assert again["choices"][0]["finish_reason"] == "length"  # the router falls back
        got = post(eng["decode"]["url"], {**body, "kv_transfer_params": params})
        assert got["choices"][0]["text"] == via_router  # decode recomputed locally
        router = st["router"]
        assert _metric(router, 'agentserve_router_pd_requests_total{path="disaggregated"}') == 3
        assert _metric(router, 'agentserve_router_pd_requests_total{path="fallback"}') == 1
        st = _state(state, up, lambda st: st["engines"][0]["restarts"] == 1)  # back, same url
        new = {e["role"]: e for e in st["engines"]}
        assert new["prefill"]["url"] == eng["prefill"]["url"]
        assert new["prefill"]["pid"] != eng["prefill"]["pid"]
        pids.add(new["prefill"]["pid"])
        _healthy_in_router(router, eng["prefill"]["url"])

        os.kill(eng["decode"]["pid"], signal.SIGKILL)  # the only decode engine dies
        code, out, hdr = _post(router, {**body, "prompt": list(range(20, 320))})
        assert code == 200, out  # not lost: retried on the prefill engine, served whole there
        assert hdr["x-agentserve-endpoint"] == eng["prefill"]["url"]
        t0 = time.monotonic()
        st = _state(state, up, lambda st: st["engines"][1]["restarts"] == 1, timeout=90)
        pids.add(st["engines"][1]["pid"])
        _healthy_in_router(router, eng["decode"]["url"])
        assert time.monotonic() - t0 < 90
        split = 'agentserve_router_pd_requests_total{path="disaggregated"}'
        before = _metric(router, split)
        code, out, hdr = _post(router, {**body, "prompt": list(range(40, 340))})
        assert code == 200 and hdr["x-agentserve-endpoint"] == eng["decode"]["url"]
        assert _metric(router, split) == before + 1  # a P/D request again, decoded there
        assert up.poll() is None


def _turn(router: str, prompt: list[int], session: str) -> tuple[int, int, str]:
    """(predicted, reported cached tokens, endpoint) of one turn through the router."""
    code, out, hdr = _post(router, {"prompt": prompt, "max_tokens": 2, "temperature": 0},
                           {"x-session-id": session})
    assert code == 200, out
    return (int(hdr["x-agentserve-predicted-cached"]),
            out["usage"]["prompt_tokens_details"]["cached_tokens"], hdr["x-agentserve-endpoint"])


def test_up_restarted_router_rebuilds_its_index_from_the_engines(tmp_path: Path) -> None:
    """Two aggregated engines; sessions run turns; the router is killed -9 and the launcher
    restarts it: before it listens it rebuilds its prefix index from the engines' replay
    sockets, so its very next predictions of cached tokens are exact (and not zero). Then
    an engine is killed and restarted: the predictions stay exact."""
    with _up(tmp_path, "2") as (up, state, pids):
        st = _state(state, up, lambda st: True)
        pids |= {e["pid"] for e in st["engines"]} | {st["router_pid"]}
        router = st["router"]
        prompts = [[(7 * s + i) % 400 + 1 for i in range(300)] for s in range(3)]
        for turn in range(2):
            for s, p in enumerate(prompts):
                predicted, cached, _ = _turn(router, p, f"s{s}")
                assert predicted == cached, (turn, s, predicted, cached)
                p += [(11 * s + turn + i) % 400 + 1 for i in range(40)]
            time.sleep(0.3)  # the turn's BlockStored events reach the router
        os.kill(st["router_pid"], signal.SIGKILL)
        st = _state(state, up, lambda st: st["router_restarts"] == 1)
        pids.add(st["router_pid"])
        held = {}
        for s, p in enumerate(prompts):
            predicted, cached, held[s] = _turn(router, p, f"s{s}")
            assert predicted == cached and cached >= 256, (s, predicted, cached)
            p += [(13 * s + i) % 400 + 1 for i in range(40)]
        time.sleep(0.3)
        # an engine killed -9 and restarted empty: once re-admitted, the router holds none
        # of the dead process's blocks for it (rebuilt from the new one's replay socket)
        victim = next(e for e in st["engines"] if e["url"] == held[0])
        os.kill(victim["pid"], signal.SIGKILL)
        st = _state(state, up, lambda st: any(e["restarts"] for e in st["engines"]))
        pids |= {e["pid"] for e in st["engines"]}
        _healthy_in_router(router, victim["url"])
        for s, p in enumerate(prompts):
            predicted, cached, _ = _turn(router, p, f"s{s}")
            assert predicted == cached, (s, predicted, cached)
        assert up.poll() is None


_HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_supervisor_restarts_with_backoff_then_gives_up(tmp_path: Path) -> None:
    """A process that keeps dying is restarted on the same port after a doubling delay,
    counted, and given up on after max_restarts restarts within the window."""
    port = free_port()
    cmd = [sys.executable, "-c", _HEALTH_SERVER, str(port)]

    def start():
        return start_process("svc", cmd, tmp_path / "svc.log", f"http://127.0.0.1:{port}")

    policy = RestartPolicy(max_restarts=2, window_s=60, initial_s=0.2, max_s=0.3,
                           health_timeout_s=20)
    sup = Supervised("svc", start(), start, policy)
    procs = [sup.proc]
    try:
        for n in (1, 2):
            sup.proc.wait_healthy(20)
            os.kill(sup.proc.pid, signal.SIGKILL)
            sup.proc.popen.wait(5)
            msgs = []
            deadline = time.monotonic() + 30
            while sup.state != "running" or not msgs:
                assert time.monotonic() < deadline, (sup.state, msgs)
                if (m := sup.tick()) is not None:
                    msgs.append(m)
                time.sleep(0.05)
            procs.append(sup.proc)
            assert sup.restart_count == n and msgs[-1].startswith("back (pid")
            assert "restarting in 0.2 s" in msgs[0] if n == 1 else "restarting in 0.3 s" in msgs[0]
        os.kill(sup.proc.pid, signal.SIGKILL)
        sup.proc.popen.wait(5)
        msg = sup.tick()
        assert sup.state == "failed" and msg is not None and "giving up after 2 restarts" in msg
        never = Supervised("svc", start(), start, RestartPolicy(max_restarts=0))
        procs.append(never.proc)
        never.proc.wait_healthy(20)
        never.proc.stop()
        assert "not restarted" in (never.tick() or "") and never.state == "failed"
    finally:
        for p in procs:
            p.stop()


def test_up_killed_with_sigkill_leaves_no_orphans(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot stop its children: they stop themselves (the
    kernel's parent-death signal, `procs.bind_to_parent`), engine and router alike."""
    with _up(tmp_path, "1") as (up, state, pids):
        st = _state(state, up, lambda st: True)
        children = [st["router_pid"]] + [e["pid"] for e in st["engines"]]
        pids.update(children)
        up.kill()
        up.wait(10)
        deadline = time.monotonic() + 45
        while any(_alive(p) for p in children):
            assert time.monotonic() < deadline, "children outlived their launcher"
            time.sleep(0.2)
