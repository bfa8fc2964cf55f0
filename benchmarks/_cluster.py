"""A local `agentserve up` cluster for the reliability suites (fuzz, soak, chaos).

`UpCluster` runs `agentserve up --topology T --state FILE` as a child process, waits for
the state file, and stops the whole tree on exit (SIGTERM to `up`, which stops its
processes; SIGKILL after a bound). `proc_stats` reads one process's RSS, open fds and
threads from /proc; `engine_metrics` reads the gauges of an engine's /metrics that say
whether it is idle and holds KV. Everything here waits with a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from collections.abc import Callable
from typing import Any

from agentserve.cluster.procs import agentserve_cmd, free_port

# what `engine_metrics` returns, by Prometheus name
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


class UpCluster:
    """`agentserve up` as a child: `start()` waits for --state, `stop()` ends it all.

    `env` is added to the launcher's environment (its engines and router inherit it:
    e.g. ``AGENTSERVE_KV_TRANSFER_TOKEN`` to sign params, ``AGENTSERVE_OPERATOR_KEY``)."""

    def __init__(self, run_dir: Path, topology: str = "1P1D", engine_args: str = "",
                 env: dict[str, str] | None = None, port: int | None = None,
                 extra: list[str] | None = None) -> None:
        self.run_dir, self.topology = run_dir, topology
        self.state_path = run_dir / "state.json"
        self.port = port or free_port()
        self.cmd = agentserve_cmd("up", "--topology", topology, "--port", str(self.port),
                                  "--state", str(self.state_path), "--run-dir",
                                  str(run_dir / "run"), "--engine-args", engine_args,
                                  *(extra or []))
        self.env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen | None = None
        self.first: dict[str, Any] = {}  # the state when the cluster first served

    def start(self, timeout: float = 240.0) -> dict[str, Any]:
        """Start and wait for the state file (every process healthy); returns it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state_path.unlink(missing_ok=True)
        log = open(self.run_dir / "up.log", "ab")
        self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env,
                                      start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.state_path.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(f"agentserve up exited ({self.popen.returncode}); "
                                   f"log {self.run_dir / 'up.log'}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agentserve up not serving after {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)
        self.first = self.state()
        return self.first

    def state(self) -> dict[str, Any]:
        """The launcher's --state JSON now (router, router_pid, engines[url, role, pid, ...])."""
        return json.loads(self.state_path.read_text())

    def engines(self, role: str | None = None) -> list[dict[str, Any]]:
        """The engines of the first state, optionally of one role."""
        return [e for e in self.first["engines"] if role is None or e["role"] == role]

    def pids(self) -> dict[str, int]:
        """name -> pid now, the router included (the launcher's own as "up")."""
        st = self.state()
        out = {e["name"]: e["pid"] for e in st["engines"]}
        out["router"] = st["router_pid"]
        if self.popen is not None:
            out["up"] = self.popen.pid
        return out

    def restarts(self) -> dict[str, Any]:
        """What changed since start: restart counts, replaced pids, whether `up` is alive.
        Empty `restarted` and `replaced` and ``up_alive`` true: nothing crashed."""
        st, first = self.state(), self.first
        restarted = {e["name"]: e["restarts"] for e in st["engines"] if e.get("restarts")}
        if st.get("router_restarts"):
            restarted["router"] = st["router_restarts"]
        was = {e["name"]: e["pid"] for e in first["engines"]} | {"router": first["router_pid"]}
        now = {e["name"]: e["pid"] for e in st["engines"]} | {"router": st["router_pid"]}
        replaced = sorted(n for n in was if now.get(n) != was[n] or not pid_alive(now.get(n, 0)))
        return {"restarted": restarted, "replaced": replaced,
                "up_alive": self.popen is not None and self.popen.poll() is None}

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = (self.run_dir / "up.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM `up` (it stops router then engines), SIGKILL its group after `timeout`."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        return self.popen.returncode

    def __enter__(self) -> UpCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    """A live process, not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def proc_stats(pid: int) -> dict[str, int] | None:
    """{"rss_kib", "fds", "threads"} of a live process from /proc; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    rss = next((int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmRSS:")), 0)
    return {"rss_kib": rss, "fds": fds, "threads": threads}


def engine_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The `GAUGES` of an engine's /metrics (summed over label sets); raises if unreachable."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(urls: list[str], timeout: float = 60.0) -> dict[str, dict[str, float]]:
    """Poll each engine until it has no running or waiting request and holds no KV, or
    `timeout` passes; returns the last reading of each (the caller judges it)."""
    deadline = time.monotonic() + timeout
    while True:
        seen: dict[str, dict[str, float]] = {}
        for url in urls:
            try:
                seen[url] = engine_metrics(url)
            except OSError as e:
                seen[url] = {"error": str(e)}  # type: ignore[dict-item]
        if all("error" not in m and not any(m.values()) for m in seen.values()) \
                or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def run_suite(args: argparse.Namespace, run: Callable[[argparse.Namespace, Path], dict],
              table: Callable[[dict], str], prefix: str) -> int:
    """A suite's main: ``run(args, work)`` in ``args.work`` (or a temporary folder), its
    result to ``args.out`` as JSON, its table printed; exit code 0 when ``result["ok"]``."""
    if args.work is not None:
        result = run(args, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            result = run(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1
