"""SIGTERM drains: an in-flight stream completes, new requests are refused, the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from agentserve.procs import start_engine


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
