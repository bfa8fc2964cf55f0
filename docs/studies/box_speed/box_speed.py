"""How fast is this box, minute by minute? Our engine's decode step against the hypervisor's steal.

Timing checks on this machine (`sim_vs_bench.py`, the engine benchmarks) compare runs minutes
apart, and a 2-vCPU cloud VM does not run at one speed: neighbours on the host take CPU
(steal) and caches. This measures it with our own workload, so a reader can tell the box from
the code:

- `--engines N` processes (default 2, one per core, as `up --topology 2` runs), each an engine
  core in-process (tiny model, one thread) decoding a batch of `--batch` requests over a
  `--prompt`-token prompt; the batch restarts every window so every window sees the same
  contexts; each window records the mean and median step wall time;
- the hypervisor's steal in each window (`/proc/stat`, `sim_vs_bench.cpu_steal`);
- optionally a sentinel (`--sentinel-period S`): a fixed 8x256x1024 matmul-and-dict workload
  (~9 ms) every S seconds at SCHED_FIFO priority where allowed, a candidate speed index that
  needs no engine (stop 38: correlation 0.43-0.71 with the engines' step, steal's 0.55-0.88).

Prints a table a window and the spread, the step-vs-steal correlation and linear fit; writes JSON.

    .venv/bin/python docs/studies/box_speed/box_speed.py --duration 300 --out docs/studies/box_speed/box_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the suite's helpers
from sim_vs_bench import cpu_steal, steal_frac  # noqa: E402


def engine_worker(args: argparse.Namespace) -> None:
    """Decode windows aligned to `args.t0`; one JSON line a window to `args.worker_out`."""
    import torch

    from agentserve.engine.core.engine import AsyncEngine
    from sim_calibrate_cpu import _add

    torch.set_num_threads(1)
    # room for the whole batch to the window's end (< 1,000 steps a second), so nothing preempts
    kv = max(131_072, args.batch * (args.prompt + int(args.window * 1000)))
    eng = AsyncEngine.from_args(kv_cache_tokens=kv, max_num_batched_tokens=2048)
    core, rng = eng.core, random.Random(args.seed)
    if args.prompt >= core.max_model_len:
        raise SystemExit(f"--prompt {args.prompt} does not fit the model ({core.max_model_len} tokens)")
    with open(args.worker_out, "w") as out, torch.inference_mode():
        for k in range(args.windows):
            seqs = [_add(core, f"w{k}_{i}", args.prompt, rng, 1_000_000) for i in range(args.batch)]
            give_up = time.time() + args.window + 60.0
            while any(s.num_output_tokens == 0 for s in seqs):  # prefill: not timed
                if time.time() > give_up:
                    raise SystemExit(f"the batch's prefill took over {args.window + 60:g} s: "
                                     "use a smaller --prompt or --batch")
                core.step([])
            start = max(time.time(), args.t0 + k * args.window)
            while time.time() < start:
                time.sleep(0.001)
            end, steps = args.t0 + (k + 1) * args.window, []
            while time.time() < end:
                t = time.perf_counter()
                core.step([])
                steps.append(time.perf_counter() - t)
            for s in seqs:
                core.abort(s.request_id)
            core._drain_inbox(block=False)  # no core thread here: apply the aborts now
            out.write(json.dumps({"k": k, "steps": len(steps),
                                  "mean_ms": 1e3 * statistics.fmean(steps) if steps else None,
                                  "median_ms": 1e3 * statistics.median(steps) if steps else None})
                      + "\n")
            out.flush()


def sentinel_work(x, w1, w2) -> float:
    """The sentinel's fixed workload: small matmuls and the interpreter's dict work (~9 ms)."""
    import torch

    d: dict = {}
    with torch.inference_mode():
        for i in range(40):
            y = torch.relu(x @ w1) @ w2
            for j in range(200):
                d[(i, j)] = j
    return float(y[0, 0])


def sentinel_worker(args: argparse.Namespace) -> None:
    """`sentinel_work` every `args.sentinel_period` s until the last window ends."""
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(8, 256, generator=g), torch.randn(256, 1024, generator=g), \
        torch.randn(1024, 256, generator=g)
    try:  # run at once when due, so its wall time is the machine's, not the run queue's
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        prio = "fifo"
    except (OSError, AttributeError):
        prio = "normal"
    sentinel_work(x, w1, w2)
    end = args.t0 + args.windows * args.window
    with open(args.worker_out, "w") as out:
        out.write(json.dumps({"priority": prio}) + "\n")
        while time.time() < end:
            t, c = time.time(), time.thread_time()
            w = time.perf_counter()
            sentinel_work(x, w1, w2)
            out.write(json.dumps({"t": t, "wall_ms": 1e3 * (time.perf_counter() - w),
                                  "cpu_ms": 1e3 * (time.thread_time() - c)}) + "\n")
            time.sleep(args.sentinel_period)


def _corr(a: list[float], b: list[float]) -> float | None:
    try:
        return statistics.correlation(a, b)
    except statistics.StatisticsError:  # fewer than two points, or one side constant
        return None


def summarize(windows: list[dict]) -> dict:
    """Spread of the windows' mean step, and how steal (and the sentinel) track it."""
    rows = [w for w in windows if w["step_ms"] is not None]
    step = [w["step_ms"] for w in rows]
    if not step:
        return {"windows": 0}
    out: dict = {"windows": len(step), "step_ms": {
        "min": min(step), "median": statistics.median(step), "max": max(step),
        "max_over_min": max(step) / min(step)}}
    with_steal = [w for w in rows if w["steal"] is not None]
    if len(with_steal) >= 3:
        s, y = [w["steal"] for w in with_steal], [w["step_ms"] for w in with_steal]
        out["corr_step_steal"] = _corr(s, y)
        try:
            slope, base = statistics.linear_regression(s, y)
            out["fit"] = {"base_ms": base, "per_unit_steal": slope / base}
        except statistics.StatisticsError:
            pass
    with_sent = [w for w in rows if w.get("sentinel_ms") is not None]
    if len(with_sent) >= 3:
        out["corr_step_sentinel"] = _corr([w["sentinel_ms"] for w in with_sent],
                                          [w["step_ms"] for w in with_sent])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--sentinel-period", type=float, default=0.25, help="0: no sentinel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lead", type=float, default=20.0, help="s for the workers to build their engines")
    ap.add_argument("--out", default="docs/studies/box_speed/box_speed.json")
    ap.add_argument("--worker", choices=["engine", "sentinel"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--windows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "engine":
        return engine_worker(args)
    if args.worker == "sentinel":
        return sentinel_worker(args)
    if min(args.engines, args.batch, args.prompt) < 1 or args.window <= 0 or args.duration < args.window:
        ap.error("need --engines, --batch, --prompt >= 1 and --duration >= --window > 0")

    import tempfile

    work = Path(tempfile.mkdtemp(prefix="box_speed_"))
    n = int(args.duration // args.window)
    t0 = time.time() + args.lead  # a worker late for the first window times less of it
    common = [sys.executable, __file__, "--t0", str(t0), "--windows", str(n), "--window",
              str(args.window), "--batch", str(args.batch), "--prompt", str(args.prompt),
              "--sentinel-period", str(args.sentinel_period)]
    procs = [subprocess.Popen(common + ["--worker", "engine", "--seed", str(args.seed + i),
                                        "--worker-out", str(work / f"engine{i}.jsonl")])
             for i in range(args.engines)]
    if args.sentinel_period > 0:
        procs.append(subprocess.Popen(common + ["--worker", "sentinel",
                                                "--worker-out", str(work / "sentinel.jsonl")]))
    def stop(why: str) -> NoReturn:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        raise SystemExit(f"{why} (exit codes {[p.returncode for p in procs]}); see above")

    steal = []
    for k in range(n + 1):  # the steal counters at every window boundary
        while (wait := t0 + k * args.window - time.time()) > 0:
            if any(p.poll() not in (None, 0) for p in procs):
                stop("a worker failed")  # now, not at the end of the run
            time.sleep(min(wait, 0.5))
        steal.append(cpu_steal())
    deadline = time.time() + 120.0  # a window's end to its record is one step at most
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.time(), 1.0))
    except subprocess.TimeoutExpired:
        stop("a worker was still running 120 s after the last window")
    if any(p.returncode != 0 for p in procs):
        stop("a worker failed")

    per_engine = [{r["k"]: r for r in map(json.loads, (work / f"engine{i}.jsonl").read_text().splitlines())}
                  for i in range(args.engines)]
    sent = []
    prio = None
    if args.sentinel_period > 0:
        lines = [json.loads(x) for x in (work / "sentinel.jsonl").read_text().splitlines()]
        prio, sent = lines[0]["priority"], lines[1:]
    windows = []
    for k in range(n):
        lo, hi = t0 + k * args.window, t0 + (k + 1) * args.window
        means = [e[k]["mean_ms"] for e in per_engine if k in e and e[k]["mean_ms"] is not None]
        s = [r["wall_ms"] for r in sent if lo <= r["t"] < hi]
        windows.append({"k": k, "engine_step_ms": means,
                        "step_ms": statistics.fmean(means) if means else None,
                        "steal": steal_frac(steal[k], steal[k + 1]),
                        "sentinel_ms": statistics.fmean(s) if s else None})
    summary = summarize(windows)
    summary["sentinel_priority"] = prio
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(),
                                          "windows": windows, "summary": summary}, indent=2))

    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"box speed: {args.engines} tiny engines decoding batch {args.batch}, "
                      f"{args.window:g} s windows")
    for col in ("window", "step ms (mean of engines)", "steal", "sentinel ms"):
        tab.add_column(col, justify="right")
    for w in windows:
        tab.add_row(str(w["k"]), "-" if w["step_ms"] is None else f"{w['step_ms']:.2f}",
                    "-" if w["steal"] is None else f"{w['steal']:.1%}",
                    "-" if w["sentinel_ms"] is None else f"{w['sentinel_ms']:.2f}")
    Console().print(tab)
    print(json.dumps(summary))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
