"""Keep a local cluster's processes running: restart what dies, with bounded backoff.

Each supervised process is a small state machine advanced by `Supervised.tick` from the
launcher's loop (no threads, no blocking waits):

    running --exits--> waiting --delay--> starting --/health 200--> running
                          ^                  | exits or no health within the bound
                          +------------------+
    any exit when `max_restarts` restarts already happened within `window_s` --> failed

The delay before a restart starts at `initial_s` and doubles up to `max_s`; a process
that stays healthy for `reset_after_s` starts over at `initial_s`. A restarted process
gets the same command line, ports and environment (`start` is the launcher's own start
function), and its output goes on in the same log.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from agentserve.cluster.procs import ManagedProcess


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    """How often and how fast a dead process is started again."""

    max_restarts: int = 5  # 0: never restart
    window_s: float = 300.0  # ... within this long; one more exit gives up
    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0  # healthy this long: the next delay is initial_s again
    health_timeout_s: float = 180.0  # a restart that is not healthy by then failed


def probe(url: str, timeout_s: float = 0.5) -> bool:
    """One short /health check (the supervisor's loop must not stall on a slow process)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Supervised:
    """One process under supervision; `tick` returns what happened, for the status line."""

    name: str
    proc: ManagedProcess
    start: Callable[[], ManagedProcess]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    state: str = "running"  # running | waiting | starting | failed
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts
    delay_s: float = 0.0
    next_at: float = 0.0
    deadline: float = 0.0
    healthy_since: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.delay_s = self.policy.initial_s

    @property
    def restart_count(self) -> int:
        return len(self.restarts)

    def tick(self, now: float | None = None) -> str | None:
        """Advance the state machine once; a message when something changed."""
        now = time.monotonic() if now is None else now
        if self.state == "running":
            if self.proc.alive():
                if now - self.healthy_since >= self.policy.reset_after_s:
                    self.delay_s = self.policy.initial_s
                return None
            return self._exited(now, f"exited with code {self.proc.popen.returncode}")
        if self.state == "waiting" and now >= self.next_at:
            self.proc = self.start()
            self.restarts.append(now)
            self.delay_s = min(self.delay_s * 2, self.policy.max_s)
            self.state, self.deadline = "starting", now + self.policy.health_timeout_s
            return f"restarting (restart {self.restart_count}, pid {self.proc.pid})"
        if self.state == "starting":
            if not self.proc.alive():
                return self._exited(now, f"exited with code {self.proc.popen.returncode} "
                                    "while starting")
            if self.proc.url is not None and probe(self.proc.url):
                self.state, self.healthy_since = "running", now
                return f"back (pid {self.proc.pid}, restart {self.restart_count})"
            if now >= self.deadline:
                self.proc.stop()
                return self._exited(now, f"not healthy {self.policy.health_timeout_s:.0f} s "
                                    "after its restart")
        return None

    def _exited(self, now: float, why: str) -> str:
        p = self.policy
        recent = [t for t in self.restarts if now - t <= p.window_s]
        if len(recent) >= p.max_restarts:
            self.state = "failed"
            if not p.max_restarts:
                return f"{why}; not restarted (--max-restarts 0)"
            return (f"{why}; giving up after {len(recent)} restarts in {p.window_s:.0f} s "
                    f"(see its log: {self.proc.log_path})")
        self.state, self.next_at = "waiting", now + self.delay_s
        return f"{why}; restarting in {self.delay_s:.1f} s"
