"""SIGHUP makes a running `agentserve route` re-read its YAML config (endpoints added/removed)."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import yaml

from tests.router.procs import free_port, router, stop


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 while no endpoint is healthy: same body
        return json.loads(e.read())


def test_sighup_reloads_endpoints(tmp_path) -> None:
    old, new = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"policy": "round-robin", "endpoints": [{"url": old}]}))
    port = free_port()
    proc = router(port, cfg, tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        seen = None
        for _ in range(300):  # the router starts, then health checks mark `old` down
            try:
                seen = _health(url)
                if seen.get("unhealthy") == [old]:
                    break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        assert seen is not None and seen.get("unhealthy") == [old], seen
        cfg.write_text(yaml.safe_dump({"policy": "round-robin", "endpoints": [{"url": new}]}))
        proc.send_signal(signal.SIGHUP)
        for _ in range(300):
            seen = _health(url)
            if seen.get("unhealthy") == [new]:
                break
            time.sleep(0.1)
        assert seen.get("unhealthy") == [new], seen
        assert proc.poll() is None
    finally:
        stop([proc])
