"""SIGTERM drains: an in-flight stream completes, new requests are refused, the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

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
