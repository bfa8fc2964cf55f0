"""A local P/D cluster in one command: N prefill + M decode (or K aggregated) engines + router.

`agentserve up --topology 1P1D` starts every engine as its own process group
(`agentserve.cluster.procs`), each with a KV-event PUB port, a KV-event replay port and
(prefill/decode roles) a KV transfer server on a fixed port, writes the router's YAML
(endpoints with roles, event and replay addresses) into a run folder, starts `agentserve
route` on it, waits for every /health, prints a status table and, with `--state FILE`,
writes ``{"router": URL, "router_pid", "engines": [{"url", "role", "pid", "restarts"}]}``.
SIGINT/SIGTERM stop the router first, then the engines (SIGTERM to each group, SIGKILL
after a bound): no orphans.

Supervision (`supervisor.py`): an engine or the router that dies is started again with
the same command, ports and log, after a backoff of 0.5 s doubling to 10 s; the state
file is rewritten with the new pid. The router re-admits a restarted engine at its next
passing health check and rebuilds that engine's part of the index from its replay socket;
a restarted router rebuilds the whole index the same way before it listens. A process
that exits more than `--max-restarts` times in 5 minutes is given up on; the cluster then
stops by itself if that leaves no router or no decode-capable engine.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from agentserve.cluster.procs import ManagedProcess, ProcessError, agentserve_cmd, free_port, start_process
from agentserve.cluster.supervisor import RestartPolicy, Supervised


@dataclass(slots=True, frozen=True)
class Topology:
    prefill: int = 0
    decode: int = 0
    both: int = 0

    @property
    def roles(self) -> list[str]:
        return ["prefill"] * self.prefill + ["decode"] * self.decode + ["both"] * self.both


def parse_topology(text: str) -> Topology:
    """``NPMD`` (e.g. 1P1D, 2P1D) or ``N`` (N aggregated engines)."""
    t = text.strip().upper()
    if t.isdigit() and int(t) > 0:
        return Topology(both=int(t))
    m = re.fullmatch(r"(\d+)P(\d+)D", t)
    if m and int(m[1]) > 0 and int(m[2]) > 0:
        return Topology(prefill=int(m[1]), decode=int(m[2]))
    raise ValueError(f"--topology must look like 1P1D, 2P1D, NPMD or N (aggregated), got {text!r}")


@dataclass(slots=True)
class EngineSpec:
    name: str
    role: str
    port: int
    events_port: int
    host: str = "127.0.0.1"
    replay_port: int | None = None  # KV-event replay ROUTER socket (index rebuilds)
    transfer_port: int | None = None  # KV transfer server (prefill/decode roles)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Cluster:
    """The processes of one `agentserve up`, in start order (engines, then router)."""

    run_dir: Path
    host: str = "127.0.0.1"
    port: int = 8080
    model: str | None = None
    engine_args: list[str] = field(default_factory=list)
    engines: list[tuple[EngineSpec, ManagedProcess]] = field(default_factory=list)
    router: ManagedProcess | None = None
    # the P/D engines' and the router's shared secret: $AGENTSERVE_KV_TRANSFER_TOKEN, else new
    token: str = field(default_factory=lambda: os.environ.get("AGENTSERVE_KV_TRANSFER_TOKEN")
                       or secrets.token_hex(16))
    threads: str = "1"  # OMP_NUM_THREADS of each engine (the cores shared out)
    restarts: dict[str, int] = field(default_factory=dict)  # name -> restarts so far

    def start(self, topo: Topology, health_timeout: float = 180.0) -> None:
        """Start everything and wait for health; on any failure stop what started."""
        try:
            self.threads = str(max(1, (os.cpu_count() or 1) // max(1, len(topo.roles))))
            for i, role in enumerate(topo.roles):
                transfer = free_port() if role in ("prefill", "decode") else None
                spec = EngineSpec(f"{role}{i}", role, free_port(), free_port(), self.host,
                                  free_port(), transfer)
                self.engines.append((spec, self.start_engine(spec)))
            for _, proc in self.engines:
                proc.wait_healthy(health_timeout)
            self.write_router_config()
            self.router = self.start_router()
            self.router.wait_healthy(health_timeout)
        except BaseException:
            self.stop()
            raise

    def start_engine(self, spec: EngineSpec) -> ManagedProcess:
        """Start (or restart: same ports, flags and log) one engine; not waited for."""
        args = ["serve", "--host", spec.host, "--port", str(spec.port), "--role", spec.role,
                "--kv-events-endpoint", f"tcp://{spec.host}:{spec.events_port}"]
        if spec.replay_port is not None:
            args += ["--kv-events-replay-endpoint", f"tcp://{spec.host}:{spec.replay_port}"]
        if spec.transfer_port is not None:
            args += ["--kv-transfer-port", str(spec.transfer_port)]
        if self.model:
            args += ["--model", self.model]
        env = {"AGENTSERVE_KV_TRANSFER_TOKEN": self.token, "OMP_NUM_THREADS": self.threads}
        return start_process(spec.name, agentserve_cmd(*args, *self.engine_args),
                             self.run_dir / f"{spec.name}.log", spec.url, env,
                             die_with_parent=True)

    def start_router(self) -> ManagedProcess:
        """Start (or restart) the router on `router.yaml`; not waited for. It signs P/D
        legs with the cluster's token (from its environment, never on the command line)."""
        cmd = agentserve_cmd("route", "--config", str(self.run_dir / "router.yaml"),
                             "--host", self.host, "--port", str(self.port),
                             "--tokenizer", _tokenizer_source(self.model))
        return start_process("router", cmd, self.run_dir / "router.log",
                             f"http://{self.host}:{self.port}",
                             {"AGENTSERVE_KV_TRANSFER_TOKEN": self.token},
                             die_with_parent=True)

    def write_router_config(self) -> Path:
        eps = []
        for s, _ in self.engines:
            ep = {"url": s.url, "role": s.role, "kv_events": f"tcp://{s.host}:{s.events_port}"}
            if s.replay_port is not None:
                ep["replay"] = f"tcp://{s.host}:{s.replay_port}"
            eps.append(ep)
        path = self.run_dir / "router.yaml"
        path.write_text(yaml.safe_dump({"policy": "default", "endpoints": eps}, sort_keys=False))
        return path

    def replace(self, name: str, proc: ManagedProcess) -> None:
        """A restarted process takes the dead one's place (state, status, stop)."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        if name == "router":
            self.router = proc
            return
        self.engines = [(s, proc if s.name == name else p) for s, p in self.engines]

    def state(self) -> dict:
        assert self.router is not None and self.router.url is not None
        return {"router": self.router.url, "router_pid": self.router.pid,
                "router_restarts": self.restarts.get("router", 0),
                "engines": [{"url": s.url, "role": s.role, "pid": p.pid, "name": s.name,
                             "restarts": self.restarts.get(s.name, 0)} for s, p in self.engines]}

    def write_state(self, path: Path) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")  # readers never see half a file
        tmp.write_text(json.dumps(self.state(), indent=2))
        tmp.replace(path)

    def stop(self) -> None:
        """Router first (no new requests), then the engines; each group SIGTERM then SIGKILL."""
        if self.router is not None:
            self.router.stop()
        for _, proc in reversed(self.engines):
            proc.stop()

    def supervised(self, policy: RestartPolicy) -> list[Supervised]:
        """One `Supervised` per process (engines, then the router), restarting in place."""
        sups = [Supervised(s.name, p, lambda s=s: self.start_engine(s), policy)
                for s, p in self.engines]
        assert self.router is not None
        return sups + [Supervised("router", self.router, self.start_router, policy)]


def _tokenizer_source(model: str | None) -> str:
    """The router's --tokenizer for the engines' --model: the folder, or the GGUF file a
    preset name (smollm2-135m) resolves to; the built-in tiny model's folder when None."""
    if not model:
        return _tiny_dir()
    from agentserve.engine.model.gguf import resolve_model

    return str(resolve_model(model))


def _tiny_dir() -> str:
    from agentserve.engine.model.tiny import default_model_dir

    return str(default_model_dir())


def status_table(cluster: Cluster) -> "object":
    """A rich Table of the running processes (URL, role, pid, log)."""
    from rich.table import Table

    table = Table(title=f"agentserve cluster - router {cluster.router.url if cluster.router else '-'}")
    for col in ("name", "role", "url", "pid", "log"):
        table.add_column(col)
    rows = [(s.name, s.role, s.url, p) for s, p in cluster.engines]
    if cluster.router is not None:
        rows.append(("router", "router", cluster.router.url or "", cluster.router))
    for name, role, url, proc in rows:
        table.add_row(name, role, url, str(proc.pid), str(proc.log_path))
    return table


TICK_S = 0.25  # how often the launcher looks at its processes


def watch(cluster: Cluster, sups: list[Supervised], stop: threading.Event,
          state: Path | None, say: Callable[[str], None]) -> int:
    """Supervise until `stop` is set (0) or the cluster can no longer serve (1): the
    router, or every engine that can decode, was given up on. A prefill engine (or one of
    several decoders) given up on does not stop it: the router routes around it (prefill
    legs fall back to local prefill), as in a deployment where one replica fails."""
    decoders = {s.name for s, _ in cluster.engines if s.role in ("decode", "both")}
    while not stop.wait(TICK_S):
        for sup in sups:
            msg = sup.tick()
            if msg is None:
                continue
            say(f"[yellow]{sup.name}[/yellow] {msg}")
            if sup.state == "starting":  # a new process: stop() and the status must see it
                cluster.replace(sup.name, sup.proc)
            elif sup.state == "running" and state is not None:
                cluster.write_state(state)  # its new pid, once it serves
        failed = {sup.name for sup in sups if sup.state == "failed"}
        if "router" in failed or decoders <= failed:
            say("[red]the router or every decode engine is gone for good; stopping the "
                "cluster[/red]")
            return 1
    return 0


def up(topology: str, model: str | None, host: str, port: int, state: Path | None,
       run_dir: Path | None, engine_args: str = "", health_timeout: float = 180.0,
       max_restarts: int = 5) -> int:
    """Run the cluster in the foreground until SIGINT/SIGTERM; returns an exit code."""
    from rich.console import Console

    console = Console()
    topo = parse_topology(topology)
    run_dir = run_dir or Path(f".agentserve/run-{os.getpid()}")
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(run_dir.resolve(), host, port, model, shlex.split(engine_args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"starting {topology}: {len(topo.roles)} engines + router, logs in {run_dir}")
    try:
        cluster.start(topo, health_timeout)
    except ProcessError as e:
        console.print(f"[red]cluster failed to start:[/red] {e}")
        return 1
    try:
        console.print(status_table(cluster))
        if state is not None:
            cluster.write_state(state)
        console.print(f"router ready at [bold]{cluster.state()['router']}[/bold] (Ctrl-C stops all)")
        policy = RestartPolicy(max_restarts=max_restarts, health_timeout_s=health_timeout)
        return watch(cluster, cluster.supervised(policy), stop, state, console.print)
    finally:
        console.print("stopping cluster...")
        cluster.stop()
