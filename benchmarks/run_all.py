"""`make bench`: the benchmark suite, one script after another (never in parallel: 2 cores).

The suite is the scripts the README's tables cite; each runs with its default flags, writes
benchmarks/results/NAME.json (the one current result of each) and prints its table. The long
ones (marked `short` below: the 30-minute soak, the 10,000-request fuzz, the 10-minute chaos
run, the simulator's 900 s stages, the ~25-minute sim-vs-bench check) run with their short
flags and write bench-out/NAME.json instead, so a quick run never replaces a full-size result;
BENCH_FULL=1 runs them at full size into benchmarks/results/. Concluded one-off studies are in
docs/studies/, not here.

    .venv/bin/python benchmarks/run_all.py                       # all of it, long ones short
    BENCH=sched_overhead,router_index_memory .venv/bin/python benchmarks/run_all.py
    BENCH_FULL=1 BENCH=harden_soak .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --list

A script that fails is reported and the rest still run; the exit code is 1 when any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEKA = ROOT.parent / "shared" / "traces" / "weka-cc-sample.jsonl.gz"  # else the bundled mini


@dataclass(frozen=True)
class Bench:
    name: str  # benchmarks/NAME.py, result NAME.json
    args: tuple[str, ...] = ()  # beyond the defaults, every run
    short: tuple[str, ...] | None = None  # the quick run's flags; None: always full size
    note: str = ""
    manual: bool = False  # only when named in BENCH (needs hardware or tools others lack)


def _weka() -> tuple[str, ...]:
    return ("--trace", str(WEKA)) if WEKA.is_file() else ()


SUITE = (
    # engine
    Bench("engine_vs_vllm", note="needs the vLLM venv (make vllm-venv)"),
    Bench("realmodel_speed", note="needs the vLLM venv; ~10 min (2 dtypes x 3 rounds)"),
    Bench("sched_overhead"),
    Bench("engine_speed"),
    Bench("agent_turn_speed"),
    Bench("long_prompt_stall"),
    Bench("gc_pauses"),
    Bench("admission_cost"),
    Bench("serve_overhead"),
    Bench("burst_shared_prefix"),
    Bench("subagent_burst"),
    # workload
    Bench("replay_client"),
    Bench("aiperf_crosscheck", note="needs AIPerf (its cached venv)"),
    # router
    Bench("router_decision_latency"),
    Bench("router_index_memory"),
    Bench("router_captured_reuse"),
    # KV tiers, P/D
    Bench("kvtier_micro"),
    Bench("kvtier_sessions"),
    Bench("kvtier_pause_signal", args=_weka()),
    Bench("pd_transfer"),
    Bench("pd_itl"),
    Bench("pd_local_restore"),
    # reliability
    Bench("harden_fuzz", short=("--requests", "300"), note="full: 10,000 requests, ~10 min"),
    Bench("harden_soak", short=("--minutes", "0.5", "--rss-limit-pct", "100"),
          note="full: 30 min of mixed load"),
    Bench("harden_chaos", short=("--minutes", "1"), note="full: a kill -9 every 30 s for 10 min"),
    # simulator
    Bench("sim_speed"),
    Bench("sim_calibration", short=("--duration", "120", "--seeds", "1"),
          note="full: 900 s stages, 3 seeds"),
    Bench("sim_published", short=("--duration", "120"), note="full: 900 s stages"),
    Bench("sim_lane_duty", short=("--duration", "120", "--seeds", "1"), note="full: 900 s, 2 seeds"),
    Bench("sim_decode_locality", short=("--duration", "120"), note="full: 900 s stages"),
    Bench("sim_dep8_factors", short=("--duration", "120", "--seeds", "1"),
          note="full: 900 s, 2 seeds"),
    Bench("sim_vs_bench", short=("--repeats", "1"), note="full: 3 bench runs, ~25 min"),
    Bench("sim_vs_bench_history"),
    Bench("sim_request_path"),
    Bench("sim_step_audit"),
    Bench("sim_burst_probe", short=("--repeats", "1"), note="full: 5 trials a cell"),
    Bench("sim_gpu_rank", manual=True, note="a GPU's GEMMs (scripts/gpu_checks.sh runs it)"),
)

# modules the suite imports or starts, not benchmarks of their own
HELPERS = ("_chaos_client", "_cluster", "_fuzzcases", "_load", "_rawhttp", "_seeds", "_soakload",
           "cpu_watch", "stub_server", "sim_calibrate_cpu", "run_all")


def command(b: Bench, full: bool, py: str = sys.executable) -> tuple[list[str], Path]:
    """The command line for `b` and the JSON it writes."""
    quick = b.short is not None and not full
    out = (ROOT / "bench-out" if quick else ROOT / "benchmarks" / "results") / f"{b.name}.json"
    flags = (b.short or ()) if quick else ()
    return [py, str(ROOT / "benchmarks" / f"{b.name}.py"), *b.args, *flags, "--out", str(out)], out


def select(names: str | None) -> list[Bench]:
    """The suite, or the benchmarks named (comma-separated); an unknown name is an error."""
    if not names:
        return [b for b in SUITE if not b.manual]
    by_name = {b.name: b for b in SUITE}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"BENCH: no benchmark {', '.join(unknown)} (see --list)")
    return [by_name[n] for n in wanted]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the suite and exit")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args()
    full = os.environ.get("BENCH_FULL", "") not in ("", "0")
    chosen = select(os.environ.get("BENCH"))
    if args.list:
        for b in SUITE:
            size = "" if b.short is None else f"  short: {' '.join(b.short)}"
            print(f"{b.name + (' (manual)' if b.manual else ''):33}{b.note}{size}".rstrip())
        return 0
    failed = []
    for b in chosen:
        cmd, out = command(b, full)
        shown = " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                         for c in cmd[1:])
        print(f"\n=== {b.name}: {shown}" + (f"  ({b.note})" if b.note else ""), flush=True)
        if args.dry_run:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"=== {b.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in "
              f"{time.monotonic() - t0:.0f} s -> {out.relative_to(ROOT)}", flush=True)
        if rc != 0:
            failed.append(b.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
