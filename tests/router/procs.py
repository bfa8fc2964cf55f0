"""Start engines and the router as subprocesses for integration tests (bounded waits)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_excerpt(path: Path, tail: int = 3000, max_errors: int = 40) -> str:
    """A process log for a failure report: its error lines from anywhere (the root cause
    of a crash is often far above the final traceback), then its last `tail` characters."""
    text = path.read_text(errors="replace")
    errors = [ln for ln in text.splitlines()
              if "Error" in ln or "Exception" in ln or "error:" in ln.lower()][:max_errors]
    head = ("[error lines]\n" + "\n".join(errors) + "\n[tail]\n") if errors else ""
    return head + text[-tail:]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not up after {timeout}s")


def post(url: str, body: dict, headers: dict | None = None,
         timeout: float = 60) -> tuple[dict, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), dict(r.headers)


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def our_engine(port: int, ev_port: int, log: Path, kv_tokens: int = 16384,
               extra: list[str] | None = None, threads: int | None = None) -> subprocess.Popen:
    """One of our engines; `threads` caps its torch/OpenMP threads (as `agentserve up`
    does: engines sharing cores each with a thread per core oversubscribe them)."""
    return start([PY, "-m", "agentserve.cli", "serve", "--port", str(port), "--block-size", "16",
                  "--kv-cache-tokens", str(kv_tokens),
                  "--kv-events-endpoint", f"tcp://*:{ev_port}", *(extra or [])], log,
                 env={"OMP_NUM_THREADS": str(threads)} if threads else None)


def router(port: int, config: Path, log: Path, tokenizer: str | None = None) -> subprocess.Popen:
    cmd = [PY, "-m", "agentserve.router", "--config", str(config), "--port", str(port)]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return start(cmd, log)
