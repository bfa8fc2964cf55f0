"""Where does the cpu-local simulator's step model part from our engine's steps?

Runs the small-scale check's bench (`sim_vs_bench.py`: 2 aggregated tiny engines behind the
router, a synthesized `sweep` corpus, one concurrency) with the engines' step trace on
(`AGENTSERVE_STEP_TRACE`, engine/core/steptrace.py), then the simulator on the same corpus with
its aggregated engines' steps recorded, and compares, by kind of step (decode-only by batch
size, prefill beside decodes, prefill alone):

- how often each kind ran, in the bench and in the simulation;
- for the bench's own steps, the measured time (scheduling + forward + the rest) against the
  step model's time for exactly that batch (`PerfModel.measured_step`, the calibrated
  profile): where the model is short for the batches the bench runs;
- the gap between back-to-back steps the step itself does not account for (the core thread's
  loop: inbox, handing outputs to the event loop);
- how much longer a decode step runs when a new prompt reaches the engine during it
  (`arrival_split`: the API thread's work for the prompt shares the process's GIL with the
  core thread's step; the step model prices such a step as any other).

`--engine-args="--device cuda"` runs the engines on a lent GPU (pass a profile calibrated there
as --cpu-profile for the model columns; the arrival split normalises within the bench).

The calibrated profile is read, not refitted (`--cpu-profile`; `sim_vs_bench.py` writes it).

    .venv/bin/python benchmarks/sim_step_audit.py --concurrency 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentserve.sim.specs import CPU_PROFILE_DEFAULT
from sim_vs_bench import (  # benchmarks/: the same corpus, cluster and simulator set-up
    _engine_block,
    add_workload_args,
    corpus,
    read_steps,
    sim_config,
    start_cluster,
)

KINDS = ("dec 1", "dec 2", "dec 3-4", "dec 5-8", "dec 9+", "prefill + dec", "prefill")


def kind(n_dec: int, n_pre: int) -> str:
    if n_pre:
        return "prefill + dec" if n_dec else "prefill"
    return ("dec 1" if n_dec == 1 else "dec 2" if n_dec == 2 else "dec 3-4" if n_dec <= 4
            else "dec 5-8" if n_dec <= 8 else "dec 9+")


def summarize(steps: list[dict], model) -> dict:
    """Per kind: count, mean measured (or simulated) step, mean modelled step for the same
    batches (bench steps only), mean decode batch."""
    out: dict[str, dict] = {}
    for k in KINDS:
        mine = [s for s in steps if kind(len(s["dec"]), len(s["pre"])) == k]
        if not mine:
            continue
        row = {"n": len(mine), "step_ms": 1e3 * statistics.fmean(s["dt"] for s in mine),
               "dec_mean": statistics.fmean(len(s["dec"]) for s in mine),
               "dec_ctx_mean": statistics.fmean(x for s in mine for x in s["dec"]) if any(
                   s["dec"] for s in mine) else 0.0,
               "pre_tokens_mean": statistics.fmean(sum(n for n, _ in s["pre"]) for s in mine)}
        if model is not None:
            row["model_ms"] = 1e3 * statistics.fmean(model(s) for s in mine)
        out[k] = row
    return out


def arrival_split(steps: list[dict], model) -> dict:
    """Decode-only steps that ran back to back, by batch: those after which the engine's next
    step admits a new prompt ("before an arrival": the prompt reached the engine's API thread
    while the step ran, or in the gap after it) against those followed by another decode-only
    step ("steady"). The API thread shares the engine process's GIL with the core thread, so a
    prompt's handling (parsing, hashing, the chat template) can stretch the step it arrives
    in, which the step model does not price. A step's excess is its span less the model's
    price scaled to that batch's steady steps (their median span / model), so context and
    the box's speed cancel; `fit` regresses the excess on the arriving prompt's tokens."""
    import numpy as np

    pairs: dict[int, dict[str, list[tuple[dict, dict]]]] = {}
    for engine in sorted({s["engine"] for s in steps}):
        mine = [s for s in steps if s["engine"] == engine]  # read_steps keeps each file's order
        for s, nxt in itertools.pairwise(mine):
            if s["pre"] or not s["dec"] or s["span"] == s["dt"]:
                continue  # a prefill step, or the engine idled after it
            side = "before_arrival" if nxt["pre"] else "steady"
            pairs.setdefault(len(s["dec"]), {"before_arrival": [], "steady": []})[side].append((s, nxt))
    out: dict = {"by_batch": {}}
    tokens, excess = [], []
    for b, sides in sorted(pairs.items()):
        if len(sides["steady"]) < 10 or not sides["before_arrival"]:
            continue
        k = statistics.median(s["span"] / model(s) for s, _ in sides["steady"])
        ex = [s["span"] - k * model(s) for s, _ in sides["before_arrival"]]
        tokens += [sum(n + pre for n, pre in nxt["pre"]) for _, nxt in sides["before_arrival"]]
        excess += ex
        out["by_batch"][b] = {
            "steady": len(sides["steady"]), "before_arrival": len(ex),
            "steady_span_ms": 1e3 * statistics.median(s["span"] for s, _ in sides["steady"]),
            "excess_ms_median": 1e3 * statistics.median(ex), "excess_ms_mean": 1e3 * statistics.fmean(ex)}
    if len(excess) >= 10:
        x = np.asarray(tokens, dtype=float)
        a, slope = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, np.asarray(excess), rcond=None)[0]
        out["fit"] = {"n": len(excess), "excess_s": float(a), "excess_per_token_s": float(slope),
                      "prompt_tokens_median": float(np.median(x)),
                      "excess_ms_median": 1e3 * statistics.median(excess)}
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_snapshot(procs: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per process (name -> pid), CPU seconds by thread name; `client` is this process."""
    snap = {name: thread_cpu(pid) for name, pid in procs.items()}
    snap["client"] = thread_cpu(os.getpid())
    return snap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    add_workload_args(ap)
    ap.add_argument("--port", type=int, default=18_520)
    ap.add_argument("--cpu-profile", default=str(CPU_PROFILE_DEFAULT))
    ap.add_argument("--out", default="bench-out/sim_step_audit.json")
    ap.add_argument("--engine-args", default="",
                    help="more `agentserve serve` flags for both engines (\"--device cuda\" on a "
                         "lent GPU; pass that device's profile as --cpu-profile, or read only the "
                         "arrival split, which needs none)")
    a = ap.parse_args()
    if not Path(a.cpu_profile).is_file():
        ap.error(f"no calibrated profile at {a.cpu_profile}: run benchmarks/sim_vs_bench.py "
                 "or agentserve sim calibrate first")
    os.environ["AGENTSERVE_SIM_CPU_PROFILE"] = str(Path(a.cpu_profile).resolve())

    from agentserve.kv.decode_groups import padded_keys
    from agentserve.sim.memory import Topology
    from agentserve.sim.perf import PerfModel
    from agentserve.sim.run import Simulation
    from agentserve.sim.specs import cpu_local, model_spec
    from agentserve.workload.replay import BenchConfig, run_bench

    work = Path(tempfile.mkdtemp(prefix="sim_step_audit_"))
    trace, sessions = corpus(a, work)

    # the bench, engines tracing their steps
    os.environ["AGENTSERVE_STEP_TRACE"] = str(work / "steps")
    cluster = start_cluster(a, work / "run")
    procs = {s.name: p.pid for s, p in cluster.engines}
    assert cluster.router is not None
    procs["router"] = cluster.router.pid
    try:
        cpu0, t0 = cpu_snapshot(procs), time.monotonic()
        real = run_bench(BenchConfig(url=f"http://127.0.0.1:{a.port}", trace_sessions=sessions,
                                     mode="concurrency", concurrency=[a.concurrency],
                                     stage_duration=a.stage, token_scale=a.token_scale,
                                     max_output=a.max_output, out=str(work / "bench"),
                                     progress=False, plots=False, seed=a.seed))[0]
        cpu1, wall = cpu_snapshot(procs), time.monotonic() - t0
        engine_block = _engine_block(cluster.engines[0][0].url)
    finally:
        cluster.stop()
        os.environ.pop("AGENTSERVE_STEP_TRACE", None)
    bench_steps, loop_gaps = read_steps(work)
    if not bench_steps:
        raise SystemExit(f"no step trace under {work}: did the engines start with it?")

    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))

    def model(s: dict) -> float:  # the trace has no block tables: no shared prefixes priced
        return perf.measured_step([tuple(p) for p in s["pre"]], float(padded_keys(s["dec"])),
                                  len(s["dec"]))

    # the simulator, same corpus and knobs, its aggregated engines' steps recorded
    sim = Simulation(sim_config(a, a.concurrency, trace, engine_block), itertools.chain.from_iterable(itertools.repeat(sessions, 50)))
    for agg in sim.aggs:
        agg.trace = []
    summary = sim.run()
    sim_steps = [s for agg in sim.aggs for s in agg.trace]

    # where the box's cores went during the bench: CPU seconds per second of wall, by process
    # and thread (the engines' core threads are the steps; everything else competes with them)
    cpu_share = {proc: {th: (cpu1[proc].get(th, 0.0) - v) / wall for th, v in cpu0[proc].items()
                        if cpu1[proc].get(th, 0.0) - v > 0.005 * wall}
                 for proc in cpu0}
    res = {"args": vars(a), "profile": a.cpu_profile, "cpu_share": cpu_share,
           "bench": {"output_tok_s": real["output_tok_s"], "ttft_p50_s": real["ttft_s"]["p50"],
                     "itl_p50_ms": real["itl_ms"]["p50"], "steps": len(bench_steps),
                     "by_kind": summarize(bench_steps, model),
                     "arrival_split": arrival_split(bench_steps, model),
                     "loop_gap_ms_mean": 1e3 * statistics.fmean(loop_gaps) if loop_gaps else None},
           "sim": {"output_tok_s": summary["output_tok_s"], "ttft_p50_s": summary["ttft_s"]["p50"],
                   "itl_p50_ms": summary["itl_ms"]["p50"], "steps": len(sim_steps),
                   "by_kind": summarize(sim_steps, None)}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))

    t = Table(title=f"c{a.concurrency}: bench output {real['output_tok_s']:.0f} tok/s, sim "
                    f"{summary['output_tok_s']:.0f}; bench steps measured vs modelled")
    for c in ("kind", "bench n", "sim n", "bench ms", "model ms (same batches)", "model/bench",
              "sim ms", "dec batch bench / sim", "dec ctx bench / sim"):
        t.add_column(c, justify="right")
    for k in KINDS:
        b, s = res["bench"]["by_kind"].get(k), res["sim"]["by_kind"].get(k)
        if b is None and s is None:
            continue
        t.add_row(k, str(b["n"]) if b else "-", str(s["n"]) if s else "-",
                  f"{b['step_ms']:.2f}" if b else "-", f"{b['model_ms']:.2f}" if b else "-",
                  f"{b['model_ms'] / b['step_ms']:.2f}" if b else "-",
                  f"{s['step_ms']:.2f}" if s else "-",
                  f"{b['dec_mean'] if b else 0:.1f} / {s['dec_mean'] if s else 0:.1f}",
                  f"{b['dec_ctx_mean'] if b else 0:.0f} / {s['dec_ctx_mean'] if s else 0:.0f}")
    Console(width=160).print(t)
    for proc, threads in cpu_share.items():
        print(f"{proc}: " + ", ".join(f"{th} {v:.2f}" for th, v in sorted(threads.items(),
                                                                           key=lambda x: -x[1])))
    split = res["bench"]["arrival_split"]
    for b, row in split["by_batch"].items():
        print(f"decode batch {b}: {row['before_arrival']} steps before an arrival run "
              f"{row['excess_ms_median']:.2f} ms (median; mean {row['excess_ms_mean']:.2f}) past "
              f"the model scaled to its {row['steady']} steady steps ({row['steady_span_ms']:.2f} ms)")
    if "fit" in split:
        f = split["fit"]
        print(f"an arrival stretches the step it lands in by {1e3 * f['excess_s']:.2f} ms + "
              f"{1e6 * f['excess_per_token_s']:.2f} us a prompt token ({f['n']} arrivals, prompts "
              f"{f['prompt_tokens_median']:.0f} tokens median)")
    gap = res["bench"]["loop_gap_ms_mean"]
    print(f"between back-to-back steps the core loop took {gap:.2f} ms on average" if gap else "")


if __name__ == "__main__":
    main()
