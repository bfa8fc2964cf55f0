"""Where does a request's time to first token go, in our stack and in the simulator?

Runs the small-scale check's bench once (`sim_vs_bench.py`'s cluster: 2 aggregated tiny
engines behind the router; closed loop at `--concurrency`, or `--mode schedule`: the mooncake
trace at its recorded times) with the engines' request trace on (engine/core/steptrace.py), joins
each answered request's client record to the engine's stamps by its `X-Request-Id`, and splits
its TTFT into what happened between them (one clock: CLOCK_MONOTONIC, shared by the client,
the router and the engines on this machine):

| piece | from -> to | what runs there |
|---|---|---|
| to engine | client send -> the engine's HTTP handler | client, router, HTTP in |
| handler | handler -> the request handed to the core | JSON, tokens, hashing |
| inbox | handed -> taken off the core's inbox | the core thread's step in flight |
| queue | taken -> its first step began | batch budget, seats, in-flight prefix joins |
| prefill | first step -> the step with its first token ended | its prompt's chunks |
| to loop | that step's end -> the event loop has the token | the loop's turn (GIL) |
| to client | loop -> the client reads the token | SSE out, router relay, client |

The simulator runs the same workload with its engines' stamps recorded (`AggInstance.req_trace`)
and charges a request `path` (client send -> it reaches an engine: the profile's request
overhead, fixed + a prompt token, in order), `busy` (the profile's busy request path, when
the engine is stepping), `queue` and `prefill`. So the bench's `to engine + handler + to loop
+ to client` is what the simulator's `path` stands for, its `inbox + queue` what `busy +
queue` stands for; both sides are split by whether the engine was stepping when the request
reached it. The profile is fitted on the same cluster first (`--calibrate`, as the check's
runs are) or read (`--cpu-profile`).

    .venv/bin/python benchmarks/sim_request_path.py --mode schedule --stage 90 --token-scale 8 \
        --max-output 64 --calibrate --out benchmarks/results/sim_request_path_schedule.json
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sim_vs_bench import (  # benchmarks/: the same corpus, cluster and simulator set-up
    MOONCAKE,
    PROFILE,
    _calibrator,
    _engine_block,
    add_workload_args,
    calibrate_on,
    corpus,
    read_steps,
    sim_config,
    start_cluster,
    warm_up,
)

BENCH_PIECES = ("to engine", "handler", "inbox", "queue", "prefill", "to loop", "to client")
SIM_PIECES = ("path", "busy", "queue", "prefill")
# the bench's pieces each simulated piece stands for
STANDS_FOR = {"path": ("to engine", "handler", "to loop", "to client"),
              "busy + queue": ("inbox", "queue"), "prefill": ("prefill",)}


def engine_id_to_client(eid: str) -> str:
    """The client's X-Request-Id in an engine request id: ``cmpl-{id}-{8 hex}-{choice}``
    (api/request_id.py, serving_completions.py)."""
    body = eid.split("-", 1)[1]
    return body.rsplit("-", 2)[0]


def read_request_trace(work: Path) -> dict[str, dict]:
    """Engine stamps by client request id (`sim_calibrate_cpu.read_traces`' request records:
    the core's and the API thread's lines merged, with the engine that served it)."""
    _, reqs = _calibrator().read_traces(work / "steps")
    return {engine_id_to_client(r["id"]): r for r in reqs}


def busy_at(steps: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per engine (pid), its steps' [start, end) spans, in order."""
    by: dict[str, list[tuple[float, float]]] = {}
    for s in steps:
        by.setdefault(s["engine"].split(".")[1], []).append((s["t"], s["t"] + s["span"]))
    for v in by.values():
        v.sort()
    return by


def stepping(spans: list[tuple[float, float]], t: float) -> bool:
    """Was a step in flight at `t`?"""
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def bench_pieces(records: list, t0: float, stamps: dict[str, dict],
                 spans: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Each answered request's pieces (seconds), its prompt and hit, and whether its engine
    was stepping when its handler began."""
    rows = []
    for rec in records:
        s = stamps.get(rec.request_id)
        if not rec.ok or rec.ttft is None or s is None or not {"recv", "tok", "first"} <= set(s):
            continue
        start = t0 + rec.start
        rows.append({"id": rec.request_id, "start": rec.start, "engine": s["engine"],
                     "n": s["n"], "hit": s["hit"], "ttft": rec.ttft,
                     "busy": stepping(spans.get(s["engine"], []), s["recv"]),
                     "to engine": s["recv"] - start, "handler": s["sub"] - s["recv"],
                     "inbox": s["adm"] - s["sub"], "queue": s["sched"] - s["adm"],
                     "prefill": s["tok"] - s["sched"], "to loop": s["first"] - s["tok"],
                     "to client": start + rec.ttft - s["first"]})
    return rows


def sim_pieces(records: list, stamps: dict[str, dict]) -> list[dict]:
    rows = []
    for rec in records:
        s = stamps.get(rec.request_id)
        if not rec.ok or rec.ttft is None or s is None or "tok" not in s:
            continue
        rows.append({"id": rec.request_id, "start": rec.start, "n": s["n"], "hit": s["hit"],
                     "ttft": rec.ttft, "busy_flag": s["busy"],
                     "path": s["route"] - rec.start, "busy": s["adm"] - s["route"],
                     "queue": s["sched"] - s["adm"], "prefill": s["tok"] - s["sched"]})
    return rows


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return {"n": len(xs), "mean": statistics.fmean(xs), "p10": q[0], "p50": statistics.median(xs),
            "p90": q[8]}


def summarize(bench: list[dict], sim: list[dict]) -> dict:
    """Per group (all, engine stepping or idle at arrival): each piece's quantiles on either
    side, and the simulated pieces against the bench pieces they stand for."""
    out = {}
    for group, bsel, ssel in (("all", lambda r: True, lambda r: True),
                              ("engine stepping", lambda r: r["busy"], lambda r: r["busy_flag"]),
                              ("engine idle", lambda r: not r["busy"], lambda r: not r["busy_flag"])):
        b = [r for r in bench if bsel(r)]
        s = [r for r in sim if ssel(r)]
        g = {"bench": {p: stats([r[p] for r in b]) for p in (*BENCH_PIECES, "ttft", "n", "hit")},
             "sim": {p: stats([r[p] for r in s]) for p in (*SIM_PIECES, "ttft", "n", "hit")},
             "stands_for": {}}
        for sp, bps in STANDS_FOR.items():
            g["stands_for"][sp] = {
                "sim": stats([sum(r[p] for p in sp.split(" + ")) for r in s]),
                "bench": stats([sum(r[p] for p in bps) for r in b])}
        out[group] = g
    return out


def print_summary(res: dict) -> None:
    con = Console(width=150)
    for group, g in res["summary"].items():
        t = Table(title=f"{res['label']}, {group}: bench {g['bench']['ttft']['n']} requests, "
                        f"simulator {g['sim']['ttft']['n']} (ms; mean / p10 / p50 / p90)")
        for c in ("piece", "bench", "simulator"):
            t.add_column(c, justify="right")

        def f(s: dict) -> str:
            return ("-" if not s.get("n") else
                    f"{1e3 * s['mean']:.1f} / {1e3 * s['p10']:.1f} / {1e3 * s['p50']:.1f} / "
                    f"{1e3 * s['p90']:.1f}")
        for p in BENCH_PIECES:
            t.add_row(p, f(g["bench"][p]), "")
        for p in SIM_PIECES:
            t.add_row(p, "", f(g["sim"][p]))
        for sp, v in g["stands_for"].items():
            t.add_row(f"[b]{sp}[/b] (bench: {' + '.join(STANDS_FOR[sp])})", f(v["bench"]),
                      f(v["sim"]))
        t.add_row("[b]TTFT[/b]", f(g["bench"]["ttft"]), f(g["sim"]["ttft"]))
        t.add_row("prompt tokens (not ms)", *(
            "-" if not g[k]["n"].get("n") else
            f"{g[k]['n']['mean']:.0f} mean, hit {g[k]['hit']['mean']:.0f}" for k in ("bench", "sim")))
        con.print(t)


def parser() -> argparse.ArgumentParser:
    """This script's flags (`sim_burst_probe.py` runs it with its own schedule)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["concurrency", "schedule"], default="schedule")
    ap.add_argument("--concurrency", type=int, default=8, help="--mode concurrency: clients")
    add_workload_args(ap)
    ap.add_argument("--trace", type=Path, default=MOONCAKE, help="--mode schedule: a mooncake trace")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--port", type=int, default=18_560)
    ap.add_argument("--calibration", choices=["server"], default="server", help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", action="store_true",
                    help="fit a cpu-local profile on the cluster before the bench and price with "
                         "it (else --cpu-profile)")
    ap.add_argument("--arrival-stretch", action="store_true",
                    help="with --calibrate: price with the arrival stretch it measures applied "
                         "(the model tried at stop 51, not adopted; docs/sim/notebook.md)")
    ap.add_argument("--cpu-profile", type=Path, default=PROFILE)
    ap.add_argument("--out", default="bench-out/sim_request_path.json")
    return ap


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse flags that cannot run, with the reason (argparse's exit 2)."""
    if a.mode == "schedule" and not a.trace.is_file():
        ap.error(f"--trace {a.trace}: no such file")
    if a.concurrency < 1:
        ap.error(f"--concurrency must be >= 1, got {a.concurrency}")
    if a.arrival_stretch and not a.calibrate:
        ap.error("--arrival-stretch measures the stretch in the calibration: add --calibrate")
    if not a.calibrate and not a.cpu_profile.is_file():
        ap.error(f"no calibrated profile at {a.cpu_profile}: pass --calibrate")


def measure(a: argparse.Namespace, watch: Callable[[Any], Callable[[], Any]] | None = None) -> dict:
    """One bench on a fresh traced cluster and the simulator on the same workload: the
    result `main` writes (each side's requests and their pieces under "requests").
    `watch(cluster)`, when given, is called as the bench starts and returns what to call as it
    ends; what that returns is the result's "watch" (`bench_t0`: the bench's clock zero)."""
    from agentserve.workload.replay import BenchConfig, BenchRun, run_client

    work = Path(tempfile.mkdtemp(prefix="sim_request_path_"))
    trace, sessions = corpus(a, work)
    a.workload_file = trace
    url = f"http://127.0.0.1:{a.port}"
    os.environ["AGENTSERVE_STEP_TRACE"] = str(work / "steps")
    try:
        cluster = start_cluster(a, work / "run")
    finally:
        os.environ.pop("AGENTSERVE_STEP_TRACE", None)
    try:
        if a.calibrate:
            profile, _ = calibrate_on(a, url)
            profile_path = work / "profile.json"
            profile_path.write_text(json.dumps(profile))
        else:
            warm_up(url)
            profile_path = a.cpu_profile
        load = (dict(trace=str(trace), mode="schedule", duration=a.stage) if a.mode == "schedule"
                else dict(trace_sessions=sessions, mode="concurrency", concurrency=[a.concurrency],
                          stage_duration=a.stage))
        run = BenchRun(BenchConfig(url=url, token_scale=a.token_scale, max_output=a.max_output,
                                   out=str(work / "bench"), progress=False, plots=False,
                                   seed=a.seed, **load))
        since = run.t0  # the calibration's requests and steps came before
        stop_watch = watch(cluster) if watch is not None else None
        try:
            run_client(run.run())
        finally:
            watched = stop_watch() if stop_watch is not None else None
        engine_block = _engine_block(cluster.engines[0][0].url)
    finally:
        cluster.stop()
    if a.calibrate:  # the engines have stopped: their traces are whole
        profile = _calibrator().with_arrival_stretch(profile, work / "steps", apply=a.arrival_stretch)
        profile_path.write_text(json.dumps(profile))
    steps, _ = read_steps(work, since=since)
    bench = bench_pieces(run.records, run.t0, read_request_trace(work), busy_at(steps))
    if not bench:
        sys.exit(f"no request joined its engine stamps under {work}: was the trace written?")

    summary, simulated = simulate(a, trace, sessions, Path(profile_path), engine_block)
    label = ("open loop" if a.mode == "schedule" else f"c{a.concurrency}")
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "label": label, "profile": json.loads(Path(profile_path).read_text()),
            "bench_ttft_p50_s": run.stages[0]["ttft_s"]["p50"],
            "sim_ttft_p50_s": summary["ttft_s"]["p50"],
            "joined": len(bench), "answered": sum(r.ok for r in run.records),
            "summary": summarize(bench, simulated),
            "requests": {"bench": bench, "sim": simulated},  # each request's pieces (s)
            "bench_t0": run.t0, "watch": watched, "engine_block": engine_block}


def simulate(a: argparse.Namespace, trace: Path, sessions: list, profile: Path,
             engine_block: int) -> tuple[dict, list[dict]]:
    """The simulator's side of `measure`: the same workload file priced with `profile`; its
    summary and each answered request's pieces (`sim_pieces`). Also what re-prices a recorded
    run under this checkout's model (`sim_burst_probe.py --resimulate`)."""
    from agentserve.sim.run import Simulation, session_stream
    from agentserve.sim.specs import CPU_PROFILE_ENV

    conc = 1 if a.mode == "schedule" else a.concurrency
    os.environ[CPU_PROFILE_ENV] = str(profile.resolve())
    try:
        cfg = sim_config(a, conc, trace, engine_block)
        stream = (session_stream(cfg.workload, max(8, 2 * cfg.concurrency), cfg.seed, cfg.token_scale)
                  if a.mode == "schedule" else
                  itertools.chain.from_iterable(itertools.repeat(sessions, 50)))
        sim = Simulation(cfg, stream)
        for agg in sim.aggs:
            agg.req_trace = {}
        summary = sim.run()
    finally:
        os.environ.pop(CPU_PROFILE_ENV, None)
    stamps = {k: v for agg in sim.aggs for k, v in (agg.req_trace or {}).items()}
    return summary, sim_pieces(sim.records, stamps)


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    check_args(ap, a)
    res = measure(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print_summary(res)
    print(f"{res['joined']} of {res['answered']} answered requests joined their engine stamps; "
          f"TTFT p50 bench {1e3 * res['bench_ttft_p50_s']:.1f} ms, simulator "
          f"{1e3 * res['sim_ttft_p50_s']:.1f} ms; wrote {a.out}")


if __name__ == "__main__":
    main()
