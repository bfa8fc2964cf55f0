"""SIM-1 small-scale check: does the simulator (cpu-local) predict `agentserve bench` on our stack?

1. start `agentserve up --topology 2` (tiny model, `--kv-cache-tokens`);
2. calibrate the `cpu-local` profile on it right before each bench run and once more after
   the last (on a fresh cluster), so that every run lies between two calibrations and is
   priced with their mean (`sim_calibrate_cpu.calibrate_server`: synthetic fixed-shape
   requests through the router, client timings, so the steps carry the serving cost of these
   shared cores; `--calibration core` fits the engine core in-process instead and probes the
   per-request overhead). Until stop 40 the profile was one calibration before all the runs
   and one after (~8-10 min apart), and a run that fell in a spell neither caught was priced
   with the wrong box (stop 39: the batch-8 step 11.6 ms before and 22.1 ms after);
3. the real thing: `--repeats` N (default 3) runs of `run_bench` in concurrency mode, each on
   a fresh cluster (the first on the calibrated one), on a synthesized `sweep` corpus written
   to a file, `--token-scale` K so prompts are a few hundred to a few thousand tokens: one
   45 s stage samples one spell of this box, whose speed moves 20-25% between minutes
   (`docs/studies/box_speed/`), so the bench figure is the runs' mean, as AIPerf's
   `--num-profile-runs` aggregates, with each run's value, error and their spread kept;
4. the simulator: 2 aggregated engines (`SimConfig.aggregated`), the same file, concurrency,
   token scale, output cap, KV size, chunk budget, and the engines' KV block size (they reuse
   whole 16-token blocks; a token-scaled trace block is 2 tokens), once per run with that
   run's profile;
5. compare the simulated runs' mean output tok/s and TTFT p50 with the bench runs' mean
   (target +-20%), each run's own pair kept beside it; JSON + a rich table; load average
   recorded; the committed profile is the mean of all the calibrations;
6. a drift gauge, not used by the prediction: the engines trace their steps during the bench,
   and the calibrated model prices each run's own decode steps (`step_drift`): this box's
   speed moves by up to a third between minutes (stop 37: the same bench 34% apart in two
   runs), and a run in a faster or slower spell than its calibrations shows here;
   with it, the hypervisor's steal during the calibrations and each run (`cpu_steal`), which
   tracks much of that speed (stop 38: step time against steal correlates 0.55-0.9 over 10 s
   windows, but the slope moves 3x between runs, so it is recorded, not used to correct).
   Since stop 41 it gates: a bench run that lost more than `--max-steal` (10%) of the CPU to
   the hypervisor is set aside and another made (up to `--repeats` more; kept in the JSON as
   `set_aside_runs`), and a calibration that did does not price a run: every check since
   stop 38 with a phase above 10% missed, none with every phase at or under 8.7% did.


`--mode schedule` (stop 46) checks the open loop instead: `agentserve bench --mode schedule` of
a mooncake trace (default SPEC's shared `mooncake-conversation`, its timestamps multiplied by
`--time-scale`, written to the work dir), each request at its recorded time for one `--stage`,
against `agentserve sim --clients schedule` on the same file (`--token-scale` tokens per
512-token trace block); the rows are labelled "schedule".

`--resimulate RESULT.json` (stop 49) runs no benches: it prices a finished check's recorded
bench runs again with this checkout's simulator (the corpus rebuilt from the recorded knobs,
each run's profile from the recorded calibrations), so a model change is compared on the
same benches in seconds; `--engine-args="--device cuda"` runs both engines on a lent GPU.

    .venv/bin/python benchmarks/sim_vs_bench.py --out benchmarks/results/sim_vs_bench.json
    .venv/bin/python benchmarks/sim_vs_bench.py --mode schedule --stage 90 --token-scale 8 \
        --max-output 64 --out benchmarks/results/sim_vs_bench_schedule.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from agentserve.runstats import mean_records
from agentserve.sim.specs import CPU_PROFILE_DEFAULT

HERE = Path(__file__).resolve().parent
PROFILE = CPU_PROFILE_DEFAULT  # the profile the simulator reads (package data)


@functools.cache
def _calibrator():
    """benchmarks/sim_calibrate_cpu.py as a module (loaded once: benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("sim_calibrate_cpu", HERE / "sim_calibrate_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _complete(url: str, body: dict, timeout: float) -> None:
    """POST one `/v1/completions` request and read the whole response."""
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def probe_overhead(url: str, profile: dict, n: int = 8, prompt: int = 16) -> float:
    """Median wall time of 1-token requests through the router minus the step `profile` models."""
    from agentserve.sim.memory import Topology
    from agentserve.sim.perf import PerfModel
    from agentserve.sim.specs import cpu_local, model_spec

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(profile))
        perf = PerfModel(model_spec("tiny"), cpu_local(path), Topology("dep", 1, "decode"))
    step = perf.measured_step([(prompt, 0)], 0.0, 0)
    model = _calibrator().model_id(url)
    times = []
    for i in range(n):
        body = {"prompt": [17 + (i * 7 + j) % 3000 for j in range(prompt)], "max_tokens": 1,
                "model": model, "stream": True, "ignore_eos": True}
        t0 = time.perf_counter()
        _complete(url, body, timeout=60)
        times.append(time.perf_counter() - t0)
    times.sort()
    return max(times[len(times) // 2] - step, 0.0)


def start_calibrated(args: argparse.Namespace, start: Callable[[int], Any]
                     ) -> tuple[Any, dict, float | None, list[str]]:
    """(cluster, profile, steal, errors): a cluster from `start(attempt)` and a profile fitted
    on it. A calibration that fails is tried once more on a fresh cluster, its error kept:
    the calibrator draws decode waves again until the router splits them about evenly
    between the engines, and at batch 16 (32 streams sent at once) it once split 16:16 in 2
    waves of 12 (stop 40, a slow spell of this box; 17:15 is now taken as well), which lost a
    whole check after its three benches."""
    errors: list[str] = []
    for attempt in (0, 1):
        cluster = start(attempt)
        try:
            profile, steal = calibrate_on(args, f"http://127.0.0.1:{args.port}")
            return cluster, profile, steal, errors
        except RuntimeError as e:
            cluster.stop()
            if attempt:
                raise RuntimeError(f"twice: {errors[0]}; then {e}") from e
            errors.append(str(e))
            print(f"calibration failed ({e}); once more on a fresh cluster", file=sys.stderr)
        except BaseException:
            cluster.stop()
            raise
    raise AssertionError("unreachable")


def calibrate_on(args: argparse.Namespace, url: str) -> tuple[dict, float | None]:
    """A `cpu-local` profile fitted on the cluster behind `url` as `--calibration` says, and
    the share of CPU time the hypervisor stole while it ran."""
    st0 = cpu_steal()
    if args.calibration == "server":
        profile = _calibrator().calibrate_server(url, chunk=args.chunk)
    else:
        profile = _calibrator().calibrate("tiny", chunk=args.chunk)
        try:
            profile["request_overhead_s"] = probe_overhead(url, profile)
        except Exception as e:  # noqa: BLE001 - recorded, the comparison still runs
            profile["request_overhead_s"], profile["request_overhead_error"] = 0.0, repr(e)
    return profile, steal_frac(st0, cpu_steal())


def _engine_block(url: str) -> int:
    """The engine's KV block size in tokens, from its `vllm:cache_config_info` metric."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', text)
    if m is None:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info block_size")
    return int(m.group(1))


def _attn_reads(urls: list[str]) -> dict[str, float]:
    """The engines' `agentserve:attn_read_*_tokens` counters, summed: context tokens their
    attention read in place, gathered, or did not read again (a prefix decodes share)."""
    out: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            for m in re.finditer(r"^agentserve:attn_read_(\w+)_tokens_total\{[^}]*\} (\S+)$",
                                 r.read().decode(), re.M):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def price_runs(cals: list[dict | None]) -> tuple[list[dict], dict]:
    """(a profile for each bench run, the mean of all) from the calibrations around the runs,
    `None` where one failed twice: run i lies between calibrations i and i + 1 and is priced
    with their mean, with the one that succeeded, or with all that did if neither did."""
    good = [c for c in cals if c is not None]
    if not good:
        raise ValueError("no calibration succeeded")
    by_run = [mean_records([c for c in cals[i:i + 2] if c is not None] or good)
              for i in range(len(cals) - 1)]
    return by_run, mean_records(good)


def cpu_steal() -> tuple[int, int] | None:
    """(steal, total) jiffies over all CPUs from `/proc/stat` (the time a virtual CPU wanted to
    run while the hypervisor ran something else); None where there is no `/proc/stat`."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def steady(steal: float | None, max_steal: float) -> bool:
    """Did a phase keep its CPU? Its stolen share at most `max_steal` (unknown counts as kept:
    no `/proc/stat`). Every check since stop 38 with a phase above 10% missed (stop 39 runs
    3-4: 10.8-16%; stop 41 run 2: 17.5-20.9%), none with every phase at or under 8.7% did
    (eleven runs)."""
    return steal is None or steal <= max_steal


def steady_runs(run_one: Callable[[int], dict], repeats: int, max_steal: float
                ) -> tuple[list[dict], list[int]]:
    """(every bench run made, the indexes of those kept): `run_one(i)` until `repeats` of them
    kept their CPU (`steady`, by their "steal") or `2 x repeats` were made."""
    attempts: list[dict] = []
    kept: list[int] = []
    while len(kept) < repeats and len(attempts) < 2 * repeats:
        attempts.append(run_one(len(attempts)))
        if steady(attempts[-1]["steal"], max_steal):
            kept.append(len(attempts) - 1)
        else:
            print(f"bench run {len(attempts) - 1} set aside: the hypervisor stole "
                  f"{attempts[-1]['steal']:.1%} of the CPU during it", file=sys.stderr)
    return attempts, kept


def steal_frac(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float | None:
    """The share of all CPU time that was stolen between two `cpu_steal` readings."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def read_steps(work: Path, since: float = float("-inf"), until: float = float("inf")
               ) -> tuple[list[dict], list[float]]:
    """The engines' step traces under `work` (`AGENTSERVE_STEP_TRACE=work/steps`), the steps
    begun in [since, until) (`time.perf_counter`: CLOCK_MONOTONIC, which the engines and this
    process share): each with `dt` (scheduling + forward + the rest) and `span` (to the next
    step's start when back to back, else `dt`); and the core loop's gaps after those of them
    that ran back to back."""
    steps, gaps = [], []
    for f in sorted(work.glob("steps.*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for r, nxt in zip(recs, recs[1:] + [None]):
            r["dt"] = r["span"] = r["sched_s"] + r["exec_s"] + r["post_s"]
            r["engine"] = f.name  # one file an engine process
            if not since <= r["t"] < until:
                continue
            if nxt is not None and (gap := nxt["t"] - r["t"] - r["dt"]) < 0.005:
                gaps.append(gap)  # back to back (a longer gap is the engine idle)
                r["span"] = nxt["t"] - r["t"]
            steps.append(r)
    return steps, gaps


def step_drift(steps: list[dict], profile: Path) -> dict | None:
    """How the calibrated step model prices the bench's own decode-only steps: the median of
    modelled / measured (step and the loop gap after it) over those steps, all and by batch.
    It is not used by the prediction; it says how the box ran during the bench against the
    calibrations around it (a bench that ran 20% faster than both shows a ratio ~20% higher
    than a run where they agree), which is how a miss that is the box's drift shows."""
    import statistics

    from agentserve.kv.decode_groups import padded_keys
    from agentserve.sim.memory import Topology
    from agentserve.sim.perf import PerfModel
    from agentserve.sim.specs import cpu_local, model_spec

    perf = PerfModel(model_spec("tiny"), cpu_local(profile), Topology("dep", 1, "decode"))
    by: dict[int, list[float]] = {}
    for s in steps:
        if s["dec"] and not s["pre"] and s["span"] > 0:
            model = perf.measured_step([], float(padded_keys(s["dec"])), len(s["dec"]))
            by.setdefault(len(s["dec"]), []).append(model / s["span"])
    if not by:
        return None
    every = [x for v in by.values() for x in v]
    return {"steps": len(every), "model_over_bench": statistics.median(every),
            "by_batch": {b: {"steps": len(v), "model_over_bench": statistics.median(v)}
                         for b, v in sorted(by.items()) if len(v) >= 20}}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The corpus, bench and engine knobs this check and `sim_step_audit.py` share."""
    ap.add_argument("--stage", type=float, default=45.0)
    ap.add_argument("--sessions", type=int, default=96)
    ap.add_argument("--profile", default="sweep")
    ap.add_argument("--token-scale", type=int, default=2)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=65_536)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)


MOONCAKE = HERE.parent.parent / "shared" / "traces" / "mooncake-conversation.jsonl.gz"


def corpus(args: argparse.Namespace, work: Path) -> tuple[Path, list]:
    """The workload, written to a file in `work` (both sides replay that file): the
    synthesized corpus, or (`--mode schedule`) the mooncake trace with its timestamps
    multiplied by `--time-scale` (its sessions then come from the simulator's loader)."""
    from agentserve.workload.synth import synthesize
    from agentserve.workload.traces import load_sessions, write_sessions

    if getattr(args, "mode", "concurrency") == "schedule":
        import gzip

        trace = work / "schedule.jsonl"
        with gzip.open(args.trace, "rt") if str(args.trace).endswith(".gz") else open(args.trace) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        with trace.open("w") as f:
            for r in recs:
                if r.get("timestamp") is not None:
                    r["timestamp"] = r["timestamp"] * args.time_scale
                f.write(json.dumps(r) + "\n")
        return trace, []
    trace = work / f"{args.profile}.jsonl"
    write_sessions(synthesize(args.profile, args.sessions, args.seed), trace)
    return trace, load_sessions(trace).sessions


def start_cluster(args: argparse.Namespace, run_dir: Path):
    """`agentserve up --topology 2` with this check's KV size and chunk budget."""
    from agentserve.cluster.launch import Cluster, parse_topology

    run_dir.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(getattr(args, "engine_args", "") or "")
    c = Cluster(run_dir, port=args.port, engine_args=["--kv-cache-tokens", str(args.kv_tokens),
                                                      "--max-num-batched-tokens", str(args.chunk),
                                                      *extra])
    c.start(parse_topology("2"))
    return c


def sim_config(args: argparse.Namespace, concurrency: int, trace: Path, engine_block: int):
    """The simulator's side: 2 aggregated engines, the same corpus file, knobs and block size."""
    from agentserve.sim.run import SimConfig

    schedule = getattr(args, "mode", "concurrency") == "schedule"
    return SimConfig(model="tiny", gpu="cpu-local", aggregated=2,
                     concurrency=1 if schedule else concurrency,
                     clients="schedule" if schedule else None,
                     duration=args.stage, mtp=False, cpu_offload_gib=0, chunk=args.chunk,
                     max_seqs=128, block_size=args.token_scale, token_scale=args.token_scale,
                     engine_block_tokens=engine_block, kv_tokens=args.kv_tokens,
                     max_output=args.max_output, seed=args.seed, join_midway=False,
                     workload=str(trace))


# (key, how to read it from a bench or simulator summary) for each metric compared
METRICS = (("output_tok_s", lambda s: s["output_tok_s"]),
           ("ttft_p50_s", lambda s: s["ttft_s"]["p50"]),
           # recorded, not banded (checks before stop 50 have none: None when re-simulated)
           ("ttft_p10_s", lambda s: s["ttft_s"].get("p10")),
           ("ttft_p25_s", lambda s: s["ttft_s"].get("p25")),
           ("ttft_p90_s", lambda s: s["ttft_s"].get("p90")),
           ("itl_p50_ms", lambda s: s["itl_ms"]["p50"]),
           ("input_tok_s", lambda s: s["input_tok_s"]),
           ("requests_ok", lambda s: s["requests_ok"]))


def compare(conc: list[int], sim_runs: list[list[dict]], bench_runs: list[list[dict]]) -> list[dict]:
    """Row per concurrency: each metric's simulated value (the mean over `sim_runs`: one
    simulation a bench run, priced with that run's profile, or a single one for all) against
    the mean of the bench runs (AIPerf's multi-run aggregate, `--num-profile-runs`), with every
    run's values, the bench runs' coefficient of variation and each run's own error (its
    simulation against its bench) kept beside it."""
    import statistics

    def err(p: float | None, m: float | None) -> float | None:
        return (p - m) / m if (p is not None and m) else None

    def mean(xs: list) -> float | None:
        vals = [v for v in xs if v is not None]
        return statistics.fmean(vals) if vals else None

    if len(sim_runs) not in (1, len(bench_runs)):
        raise ValueError(f"{len(sim_runs)} simulations for {len(bench_runs)} bench runs")
    paired = sim_runs * len(bench_runs) if len(sim_runs) == 1 else sim_runs
    rows = []
    for j, c in enumerate(conc):
        row: dict = {"concurrency": c}
        for key, get in METRICS:
            sims = [get(run[j]) for run in sim_runs]
            runs = [get(run[j]) for run in bench_runs]
            vals = [v for v in runs if v is not None]
            p, m = mean(sims), mean(runs)
            row[key] = {"sim": p, "bench": m, "err": err(p, m), "sim_runs": sims,
                        "bench_runs": runs,
                        "err_runs": [err(get(sim[j]), v) for sim, v in zip(paired, runs)],
                        "bench_cv": (statistics.stdev(vals) / m if len(vals) > 1 and m else None)}
        row["sim_extra"] = [{k: run[j].get(k) for k in ("prefill_gpu_hit_rate", "busy_frac",
                                                        "preemptions", "queue")}
                            for run in sim_runs]
        cached = [run[j].get("cached_tokens", 0) / run[j]["input_tokens"]
                  for run in bench_runs if run[j].get("input_tokens")]
        row["bench_cached_frac"] = statistics.fmean(cached) if cached else None
        rows.append(row)
    return rows


def simulate_runs(args: argparse.Namespace, conc: list[int], trace: Path, sessions: list,
                  engine_block: int, profiles: list[Path]) -> tuple[list[list[dict]], list[float]]:
    """The simulator's side: for each profile (one a bench run, or one for all) a summary per
    concurrency, on the same corpus file and knobs; and each concurrency's mean wall seconds."""
    from agentserve.sim.run import simulate
    from agentserve.sim.specs import CPU_PROFILE_ENV

    sim_runs, sim_wall = [], [0.0] * len(conc)
    try:
        for path in profiles:
            os.environ[CPU_PROFILE_ENV] = str(path)
            sims = []
            for j, c in enumerate(conc):
                cfg = sim_config(args, c, trace, engine_block)
                t = time.time()
                sims.append(simulate(cfg) if args.mode == "schedule" else  # the file, as loaded
                            simulate(cfg, itertools.chain.from_iterable(itertools.repeat(sessions, 50))))
                sim_wall[j] += time.time() - t
            sim_runs.append(sims)
    finally:
        os.environ.pop(CPU_PROFILE_ENV, None)
    return sim_runs, [w / len(profiles) for w in sim_wall]


def resimulate(path: Path, out: Path) -> dict:
    """Price a finished check's bench runs again with this checkout's simulator, from its JSON
    alone: the corpus is rebuilt from the recorded knobs (synthesized from the seed, or the
    schedule trace), each run's profile from the recorded calibrations as the check priced it
    (`price_runs` over those that kept their CPU), and the bench figures are the recorded
    ones. Minutes of model iteration instead of a 15-30 minute rerun of the benches; the drift
    gauge needs the step traces and is not recomputed (None)."""
    import shutil

    old = json.loads(path.read_text())
    args = argparse.Namespace(**{"mode": "concurrency", "time_scale": 1.0, "trace": MOONCAKE,
                                 **old["args"]})  # checks before stop 46 had no open loop
    args.trace = Path(args.trace)
    conc = [r["concurrency"] for r in old["rows"]]
    runs = old["bench_runs"]
    cals = old["profile"].get("calibrations")
    if cals:  # each run between its two calibrations, as the check priced it
        steal = old.get("cpu_steal_frac", {}).get("calibration") or [None] * len(cals)
        usable = [c if steady(x, old.get("max_steal", 1.0)) else None for c, x in zip(cals, steal)]
        by_run, _ = price_runs(usable)
        priced = [by_run[run.get("attempt", k)] for k, run in enumerate(runs)]
    else:  # --reuse-profile: one profile priced every run
        priced = [old["profile"]]
    work = Path(tempfile.mkdtemp(prefix="sim_vs_bench_resim_"))
    try:
        trace, sessions = corpus(args, work)
        profiles = []
        for k, prof in enumerate(priced):
            profiles.append(work / f"profile{k}.json")
            profiles[-1].write_text(json.dumps(prof))
        sim_runs, sim_wall = simulate_runs(args, conc, trace, sessions,
                                           old["engine_block_tokens"], profiles)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # the recorded bench figures, as the summaries `compare` reads them
    bench = [[{"output_tok_s": r["output_tok_s"]["bench_runs"][k],
               "ttft_s": {p: r[f"ttft_{p}_s"]["bench_runs"][k] if f"ttft_{p}_s" in r else None
                          for p in ("p10", "p25", "p50", "p90")},
               "itl_ms": {"p50": r["itl_p50_ms"]["bench_runs"][k]},
               "input_tok_s": r["input_tok_s"]["bench_runs"][k],
               "requests_ok": r["requests_ok"]["bench_runs"][k]} for r in old["rows"]]
             for k in range(len(runs))]
    rows = compare(conc, sim_runs, bench)
    for row, was, w in zip(rows, old["rows"], sim_wall):
        row["sim_wall_s"], row["bench_cached_frac"] = w, was.get("bench_cached_frac")
        row["sim_before"] = {k: was[k]["sim"] if k in was else None for k, _ in METRICS}
    result = {**old, "rows": rows, "resimulated_from": str(path),
              "bench_runs": [{**run, "step_drift": None} for run in runs]}
    out.write_text(json.dumps(result, indent=2, default=float))
    return result


def warm_up(url: str, n: int = 4) -> None:
    """A few short requests through the router, so that a fresh cluster's first bench
    requests do not carry the engines' first-forward costs (the calibration does this for the
    cluster it runs on)."""
    model = _calibrator().model_id(url)
    for i in range(n):
        _complete(url, {"prompt": [20 + (i * 13 + j) % 3000 for j in range(256)], "max_tokens": 4,
                        "model": model, "ignore_eos": True}, timeout=120)


def bench_run(args: argparse.Namespace, sessions: list, conc: list[int], run_dir: Path,
              calibrate: bool) -> dict:
    """One bench of all the stages on a fresh cluster, which traces its steps into `run_dir`;
    with `calibrate`, a `cpu-local` profile is fitted on the same processes right before (as
    `--calibration` says) and returned under "profile", else four short requests warm it."""
    from agentserve.workload.replay import BenchConfig, run_bench

    def start(attempt: int):
        return start_traced(args, run_dir, "cluster" if not attempt else f"cluster{attempt}")

    url = f"http://127.0.0.1:{args.port}"
    out: dict = {}
    cluster = None
    if calibrate:
        try:
            cluster, out["profile"], out["steal_calibration"], out["calibration_errors"] = \
                start_calibrated(args, start)
        except RuntimeError as e:  # twice: the run goes on, priced with the calibration after it
            print(f"the calibration before {run_dir.name} failed {e}: it is priced with the "
                  "calibration after it alone", file=sys.stderr)
            out["profile"], out["steal_calibration"], out["calibration_errors"] = None, None, [str(e)]
    if cluster is None:
        cluster = start(2 if calibrate else 0)
    try:
        if out.get("profile") is None:
            warm_up(url)
        engine_urls = [e[0].url for e in cluster.engines]
        reads_before = _attn_reads(engine_urls)
        t0, m0, st0 = time.time(), time.perf_counter(), cpu_steal()  # the step trace's clock
        if args.mode == "schedule":  # the bench reads the mooncake file itself
            load = dict(trace=str(args.workload_file), mode="schedule", duration=args.stage)
        else:
            load = dict(trace_sessions=sessions, mode="concurrency", concurrency=conc,
                        stage_duration=args.stage)
        out["stages"] = run_bench(BenchConfig(
            url=url, token_scale=args.token_scale, max_output=args.max_output,
            out=str(run_dir / "bench"), progress=False, plots=False, seed=args.seed, **load))
        out["wall_s"], out["window"] = time.time() - t0, (m0, time.perf_counter())
        out["steal"] = steal_frac(st0, cpu_steal())
        reads = _attn_reads(engine_urls)
        out["attn_read_tokens"] = {k: v - reads_before.get(k, 0.0) for k, v in reads.items()}
        out["engine_block"] = _engine_block(cluster.engines[0][0].url)
    finally:
        cluster.stop()
    if out.get("profile") is not None:  # the engines have stopped: their traces are whole
        out["profile"] = _calibrator().with_arrival_stretch(out["profile"], run_dir / "steps")
    return out


def start_traced(args: argparse.Namespace, run_dir: Path, name: str):
    """`start_cluster` in `run_dir / name` with the engines tracing their steps and requests
    under the prefix `run_dir / "steps"` (engine/core/steptrace.py: a JSON line a step, ~15 us
    against steps of 5-50 ms), for `step_drift` and the calibration's arrival stretch."""
    os.environ["AGENTSERVE_STEP_TRACE"] = str(run_dir / "steps")
    try:
        return start_cluster(args, run_dir / name)
    finally:
        os.environ.pop("AGENTSERVE_STEP_TRACE", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="4,8")
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=3,
                    help="bench runs, each on a fresh cluster and between two calibrations; "
                         "the simulations' mean is compared with the runs' mean (AIPerf's "
                         "--num-profile-runs)")
    ap.add_argument("--max-steal", type=float, default=0.10,
                    help="a bench run during which the hypervisor stole more than this share "
                         "of the CPU is set aside and run again (up to --repeats more), and a "
                         "calibration that lost as much does not price a run (0-1)")
    ap.add_argument("--port", type=int, default=18_480)
    ap.add_argument("--reuse-profile", action="store_true",
                    help="skip calibration if a profile exists and price every run with it")
    ap.add_argument("--calibration", choices=["server", "core"], default="server",
                    help="fit the cpu-local profile from client timings through the running "
                         "cluster (server) or from the engine core in-process (core)")
    ap.add_argument("--mode", choices=["concurrency", "schedule"], default="concurrency",
                    help="closed loop at each --concurrency, or the --trace's requests at their "
                         "recorded times (open loop) for one --stage")
    ap.add_argument("--trace", type=Path, default=MOONCAKE,
                    help="--mode schedule: a mooncake trace (default SPEC's shared conversation trace)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="--mode schedule: multiply the trace's timestamps (0.5: twice the rate)")
    ap.add_argument("--engine-args", default="",
                    help="more `agentserve serve` flags for both engines, e.g. \"--device cuda\" "
                         "on a lent GPU (the profile then measures that device: same code; it "
                         "is written beside --out, not over the committed cpu-local one)")
    ap.add_argument("--resimulate", type=Path, default=None, metavar="RESULT.json",
                    help="run no benches: price a finished check's recorded bench runs again "
                         "with this checkout's simulator (same corpus, profiles, figures)")
    ap.add_argument("--out", default="benchmarks/results/sim_vs_bench.json")
    args = ap.parse_args()
    if args.resimulate:
        if not args.resimulate.is_file():
            ap.error(f"--resimulate {args.resimulate}: no such file")
        if Path(args.out).resolve() == args.resimulate.resolve():
            ap.error("--resimulate writes a new result: give --out another file")
        try:
            result = resimulate(args.resimulate, Path(args.out))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError) as e:
            ap.error(f"--resimulate {args.resimulate}: not a sim_vs_bench result this version "
                     f"can re-price ({type(e).__name__}: {e})")
        print_table(result)
        for r in result["rows"]:
            print(f"c{r['concurrency']}: simulated before " + ", ".join(
                f"{k} {v:.3g} -> {r[k]['sim']:.3g}" for k, v in r["sim_before"].items()
                if v is not None))
        print(f"wrote {args.out}", file=sys.stderr)
        return
    if args.mode == "schedule":
        if not args.trace.is_file():
            ap.error(f"--trace {args.trace}: no such file")
        if not 0 < args.time_scale <= 1e3:
            ap.error(f"--time-scale must be > 0, got {args.time_scale}")
        conc = ["schedule"]  # one stage; the rows' label
    else:
        try:
            conc = [int(x) for x in args.concurrency.split(",")]
        except ValueError:
            ap.error(f"--concurrency takes whole numbers separated by commas, got {args.concurrency!r}")
        if not conc or min(conc) < 1:
            ap.error(f"--concurrency values must be >= 1, got {args.concurrency!r}")
    if not 1 <= args.repeats <= 20:
        ap.error(f"--repeats must be between 1 and 20, got {args.repeats}")
    if not 0.0 < args.max_steal <= 1.0:
        ap.error(f"--max-steal is a share of the CPU, above 0 and at most 1, got {args.max_steal}")
    # `timeout` or a CI runner stops this with SIGTERM: exit through the `finally` blocks, so
    # that the cluster running then is stopped, not left serving on its ports
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(tempfile.mkdtemp(prefix="sim_vs_bench_"))
    trace, sessions = corpus(args, work)
    args.workload_file = trace
    # the committed cpu-local profile is this box's; engines on another device (--engine-args)
    # write theirs beside --out instead, so a GPU run cannot replace it
    profile_file = (Path(args.out).with_name(Path(args.out).stem + "_profile.json")
                    if args.engine_args.strip() else PROFILE)
    profile_file.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    steal: dict = {}  # phase -> stolen shares, one a calibration / a bench run

    # 1-3. every bench run on a fresh cluster (cold caches, as the simulator starts), each
    # calibrated right before on the same processes, and one calibration after the last run
    # on a fresh cluster (a run's router state, recent requests per engine, would split the
    # calibration's waves unevenly between the engines). A run during which the hypervisor
    # stole more than `--max-steal` of the CPU is set aside and another one run, up to
    # `--repeats` more; a calibration that did is not used to price a run.
    calibrate = not (args.reuse_profile and profile_file.is_file())
    attempts, kept = steady_runs(
        lambda i: bench_run(args, sessions, conc, work / f"run{i}", calibrate),
        args.repeats, args.max_steal)
    if not kept:
        sys.exit(f"every bench run lost more than {args.max_steal:.1%} of the CPU to the "
                 "hypervisor: this box is too noisy for the check now (run it later, or raise "
                 "--max-steal)")
    if calibrate:
        cals = [a.pop("profile") for a in attempts]  # None: failed twice
        steal["calibration"] = [a.pop("steal_calibration") for a in attempts]
        try:
            cluster, after, st, errors = start_calibrated(
                args, lambda k: start_traced(args, work / "calibrate_after", f"cluster{k or ''}"))
            cluster.stop()
            after = _calibrator().with_arrival_stretch(after, work / "calibrate_after" / "steps")
        except RuntimeError as e:  # twice: the last run is priced with its calibration before
            after, st, errors = None, None, [str(e)]
            print(f"the calibration after the runs failed {e}: the last run is priced "
                  "with the calibration before it alone", file=sys.stderr)
        cals.append(after)
        steal["calibration"].append(st)
        calibration_errors = [a.pop("calibration_errors") for a in attempts] + [errors]
        usable = [c if steady(x, args.max_steal) else None for c, x in zip(cals, steal["calibration"])]
        try:
            by_run, profile = price_runs(usable)
        except ValueError:
            sys.exit(f"no calibration both succeeded and lost at most {args.max_steal:.1%} of "
                     f"the CPU to the hypervisor (steal {steal['calibration']}; errors "
                     f"{calibration_errors})")
        run_profiles = []
        for i in kept:
            run_profiles.append(work / f"run{i}" / "profile.json")
            run_profiles[-1].write_text(json.dumps(by_run[i], indent=2))
        profile["calibrations"], profile["calibration_errors"] = cals, calibration_errors
        profile_file.write_text(json.dumps(profile, indent=2))
    else:
        profile, run_profiles = json.loads(profile_file.read_text()), [profile_file] * len(kept)
    load_after = os.getloadavg()
    runs = [attempts[i] for i in kept]
    for i, run, path in zip(kept, runs, run_profiles):  # the run's profile prices its own steps
        run["attempt"] = i
        run["step_drift"] = step_drift(read_steps(work / f"run{i}", *run.pop("window"))[0], path)
        run["profile"] = str(path)
    set_aside = [{"attempt": i, "steal": a["steal"],
                  "stages": [{k: f(st) for k, f in METRICS} for st in a["stages"]]}
                 for i, a in enumerate(attempts) if i not in kept]

    # 4. the simulator, same workload and knobs, once per run with that run's profile
    sim_runs, sim_wall = simulate_runs(args, conc, trace, sessions, runs[0]["engine_block"],
                                       run_profiles if calibrate else [profile_file])
    rows = compare(conc, sim_runs, [run.pop("stages") for run in runs])
    for row, w in zip(rows, sim_wall):
        row["sim_wall_s"] = w
    steal["bench"] = [a["steal"] for a in attempts]

    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "profile": profile, "engine_block_tokens": runs[0]["engine_block"],
              "loadavg_before": load_before, "loadavg_after": load_after, "rows": rows,
              "bench_runs": runs, "set_aside_runs": set_aside, "max_steal": args.max_steal,
              "cpu_steal_frac": steal,
              "target": "output tok/s and TTFT p50 within +-20% (simulated vs the mean of the "
                        "bench runs)"}
    Path(args.out).write_text(json.dumps(result, indent=2, default=float))
    print_table(result)
    print(f"wrote {args.out}; work dir {work}", file=sys.stderr)


def print_table(result: dict) -> None:
    """The comparison as a rich table, then the drift gauge and the steal of each run."""
    from rich.console import Console
    from rich.table import Table

    def g(v: float | None) -> str:
        return "-" if v is None else f"{v:.3g}"

    def pct(v: float | None, colour: bool = True) -> str:
        if v is None:
            return "-"
        return f"[{'green' if abs(v) <= 0.2 else 'red'}]{v:+.0%}[/]" if colour else f"{v:+.0%}"

    tab = Table(title=f"sim vs bench (mean of {len(result['bench_runs'])} runs), 2 aggregated "
                      f"tiny engines, load {result['loadavg_before'][0]:.1f}->"
                      f"{result['loadavg_after'][0]:.1f}")
    for col in ("C", "metric", "sim", "bench", "err", "sim runs", "bench runs", "err by run", "cv"):
        tab.add_column(col, justify="right")
    for r in result["rows"]:
        for k, _ in METRICS:
            if (v := r.get(k)) is None:
                continue  # a metric a saved result from before it does not carry
            tab.add_row(str(r["concurrency"]), k, g(v["sim"]), g(v["bench"]), pct(v["err"]),
                        " / ".join(g(x) for x in v.get("sim_runs", [v["sim"]])),
                        " / ".join(g(x) for x in v["bench_runs"]),
                        " / ".join(pct(x, False) for x in v["err_runs"]),
                        "-" if v["bench_cv"] is None else f"{v['bench_cv']:.0%}")
    Console(width=150).print(tab)  # wide enough for every column when piped
    for k, run in enumerate(result["bench_runs"]):
        d, i = run["step_drift"], run.get("attempt", k)  # its attempt: some may be set aside
        if d is not None:
            print(f"run {i}: the step model over the bench's own decode steps (a drift gauge, "
                  f"not fitted): median {d['model_over_bench']:.2f} over {d['steps']} steps; by "
                  "batch " + ", ".join(f"{b}: {v['model_over_bench']:.2f}"
                                       for b, v in d["by_batch"].items()))
    for i, errs in enumerate(result["profile"].get("calibration_errors") or []):
        for e in errs:  # a failed calibration is tried once more on a fresh cluster
            print(f"calibration {i} failed: {e}")
    for a in result.get("set_aside_runs", []):
        print(f"run {a['attempt']} set aside: the hypervisor stole {a['steal']:.1%} of the CPU "
              f"during it (more than {result['max_steal']:.1%}); output tok/s "
              + " / ".join(g(st["output_tok_s"]) for st in a["stages"]))
    steal, cap = result["cpu_steal_frac"], result.get("max_steal", 1.0)  # no gate until stop 41
    parts = []
    for k, v in steal.items():  # a phase's share, or one a calibration / run (since stop 40)
        one = {"bench": "bench run", "calibration": "calibration"}.get(k)
        if isinstance(v, list):
            parts += [f"{one or k} {i} {x:.1%}" + (" (set aside)" if x > cap else "")
                      for i, x in enumerate(v) if x is not None]
        elif v is not None:
            parts.append(f"{k.replace('_', ' ')} {v:.1%}")
    if parts:
        print("CPU time stolen by the hypervisor: " + ", ".join(parts))


if __name__ == "__main__":
    main()
