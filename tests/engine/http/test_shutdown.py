"""SIGTERM drains: an in-flight stream completes, new requests are refused, the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from agentserve.cluster.procs import start_engine


def _stream(url: str, out: dict) -> None:
    body = json.dumps({"model": "agentserve-tiny", "prompt": list(range(20, 120)), "max_tokens": 200,
                       "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out["lines"] = [ln for ln in r.read().decode().splitlines() if ln.startswith("data: ")]


def test_sigterm_drains_in_flight_then_exits(tmp_path) -> None:
    eng = start_engine(tmp_path)
    try:
        eng.wait_healthy(120)
        out: dict = {}
        t = threading.Thread(target=_stream, args=(eng.url, out))
        t.start()
        time.sleep(0.5)  # the stream is running
        eng.popen.send_signal(signal.SIGTERM)
        t.join(120)
        assert eng.popen.wait(60) == 0
    finally:
        eng.stop()
    assert out["lines"][-1] == "data: [DONE]"
    finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in out["lines"][:-1]
                if json.loads(ln[6:]).get("choices")]
    assert finishes[-1] == "length"


def _serve(*flags: str) -> subprocess.CompletedProcess:
    cli = str(Path(sys.executable).parent / "agentserve")
    return subprocess.run([cli, "serve", *flags], capture_output=True, text=True, timeout=120)


def test_startup_errors_are_one_line_and_exit_2() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = _serve("--port", str(port))
        assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert "engine ready" not in r.stderr  # refused before the model was loaded
        assert time.monotonic() - t0 < 60
    r = _serve("--model", "/nonexistent/model", "--port", "0")
    assert r.returncode == 2 and "no config.json" in r.stderr and "Traceback" not in r.stderr


def _long_request(url: str, stream: bool, out: dict) -> None:
    body = json.dumps({"prompt": list(range(20, 60)), "max_tokens": 20000, "ignore_eos": True,
                       "stream": stream, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out["status"] = r.status
            out["lines"] = []
            for line in r:  # each event as it comes: the test waits for the first
                if line.strip():
                    out["lines"].append(line.decode().strip())
    except urllib.error.HTTPError as e:
        out["status"], out["body"] = e.code, json.loads(e.read())
    except OSError as e:  # a closed connection is an answer too, not a hang
        out["error"] = repr(e)


def test_sigterm_cuts_requests_at_the_drain_deadline(tmp_path) -> None:
    """Generations longer than --drain-timeout: on SIGTERM they get that long, then each is
    answered (streams with an error event, a plain request with 503) and the process exits
    soon after, not when they would have finished."""
    drain = 2.0
    eng = start_engine(tmp_path, extra=["--drain-timeout", str(drain)])
    try:
        eng.wait_healthy(120)
        outs = [{} for _ in range(4)]
        threads = [threading.Thread(target=_long_request, args=(eng.url, i < 3, outs[i]))
                   for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(o.get("lines") for o in outs[:3]) and time.monotonic() < deadline:
            time.sleep(0.05)  # the streams have started
        t0 = time.monotonic()
        eng.popen.send_signal(signal.SIGTERM)
        code = eng.popen.wait(drain + 15 + 10)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "a client still waits after the server exited"
    finally:
        eng.stop()
    assert code == 0 and drain <= took < drain + 10, (code, took, eng.log_tail())
    for o in outs[:3]:
        assert o["status"] == 200 and o["lines"][-1] == "data: [DONE]", o
        err = json.loads(next(ln for ln in o["lines"] if '"error"' in ln)[6:])["error"]
        assert "drain timeout" in err["message"] and err["type"] == "service_unavailable", err
    assert outs[3]["status"] == 503 and "drain timeout" in outs[3]["body"]["error"]["message"]


def test_hard_exit_backstop_ends_a_process_something_holds() -> None:
    """`hard_exit_after` ends the process at its deadline even though a non-daemon thread
    would keep it alive for ten minutes (as a worker thread stuck in a stop routine)."""
    code = ("import threading, time\n"
            "from agentserve.api.httpbounds import hard_exit_after\n"
            "hard_exit_after(1.0, 'test shutdown')\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    assert "test shutdown did not finish within 1 s; exiting now" in r.stderr
