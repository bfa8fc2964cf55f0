"""What does a burst of requests cost on our engines, and what does the simulator charge for it?

The open loop's low end is short in every small-scale check (TTFT p10 -26% to -46%: a burst's
short prompts reach their first token in ~15 ms in the model against ~26 ms on the engines),
and the model terms tried for it (the engine's API thread as a resource of its own, stop 52;
the arrival stretch, stop 51) could only be chosen by the checks they were to be judged on.
This probe measures the mechanism on its own, with a designed schedule instead of a trace:

- trials 4 s apart; in each, `k` cold prompts sent at the same instant (the burst), with or
  without `b` background streams sent 0.6 s before it (decoding when the burst arrives);
- every (b, k) cell `--repeats` times, the cells in a seeded random order (the box's speed
  drifts; a cell must not sit in one stretch of it);
- all prompts distinct (no prefix hit), `--prompt` tokens before `--token-scale`.

It runs `sim_request_path.py`'s machinery on that schedule (a fresh traced two-engine
cluster behind the router, the profile calibrated on it first with `--calibrate`, the
simulator on the same file) and reports per cell the TTFT of the burst's 1st, 2nd, ... first
token on either side (mean over the trials), and where a burst request's time went on the
engines (`handler`, `inbox`, `queue`, `prefill`, `to loop`) against the simulator's pieces,
and what each process's threads spent (client, router, each engine: its event loop apart from
its other threads, read from `/proc/PID/task/TID/schedstat`), fitted over the trials to idle
seconds, requests and streamed tokens. What it decides: whether the engines answer a burst's
requests one handler after another (TTFT growing by a fixed step per position) and how large
that step is, measured apart from the checks. Nothing in the simulator is set from it.

    .venv/bin/python benchmarks/sim_burst_probe.py --calibrate \
        --out benchmarks/results/sim_burst_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from cpu_watch import CpuWatch, cpu_at
from sim_request_path import check_args, measure, parser

TRIAL_S = 4.0  # between bursts: every stream of a trial has ended before the next one
LEAD_S = 0.6  # background streams are sent this long before their burst (decoding by then)
MATCH_S = 0.3  # a request belongs to the scheduled send time within this (sends are >= 0.6 s apart)
MOONCAKE_BLOCK = 512  # a mooncake trace's hash ids cover 512 tokens (AIPerf's default)


def burst_schedule(cells: list[tuple[int, int]], repeats: int, prompt: int, output: int,
                   seed: int, bg_output: int | None = None) -> tuple[list[dict], list[dict]]:
    """Mooncake records (timestamps in ms) for every cell `repeats` times, shuffled, and the
    trials: each with its cell, its burst's send time (s) and its background's (or None)."""
    order = [c for c in cells for _ in range(repeats)]
    random.Random(seed).shuffle(order)
    blocks = -(-prompt // MOONCAKE_BLOCK)
    next_id = 0
    records, trials = [], []

    def add(t: float, n_out: int) -> None:
        nonlocal next_id
        records.append({"timestamp": round(1e3 * t, 3), "input_length": prompt,
                        "output_length": n_out, "hash_ids": list(range(next_id, next_id + blocks))})
        next_id += blocks
    # both sides time a schedule from its first send: make that 0 (the first trial's
    # background, or its burst when it has none)
    lead0 = LEAD_S if order[0][0] else 0.0
    for i, (b, k) in enumerate(order):
        at = lead0 + i * TRIAL_S
        for _ in range(b):
            add(at - LEAD_S, bg_output or output)
        for _ in range(k):
            add(at, output)
        trials.append({"b": b, "k": k, "at": at, "bg_at": at - LEAD_S if b else None})
    records.sort(key=lambda r: r["timestamp"])
    return records, trials


def sends(trials: list[dict]) -> list[float]:
    """Every scheduled send time (s), bursts and backgrounds."""
    return sorted({t["at"] for t in trials} | {t["bg_at"] for t in trials if t["bg_at"] is not None})


def clock_offset(rows: list[dict], times: list[float]) -> float:
    """What to subtract from a side's request `start` to put it on the schedule's clock: the
    bench stamps starts from its run's start, a while before the schedule's first send."""
    if not rows:
        return 0.0
    coarse = min(r["start"] for r in rows)
    return coarse + statistics.median(
        min((r["start"] - coarse - t for t in times), key=abs) for r in rows)


def by_trial(rows: list[dict], trials: list[dict]) -> dict[int, list[dict]]:
    """The burst requests of each trial (index), matched by send time; background streams and
    requests farther than `MATCH_S` from every burst are left out."""
    ats = [t["at"] for t in trials]
    off = clock_offset(rows, sends(trials))
    out: dict[int, list[dict]] = {}
    for r in rows:
        at = r["start"] - off
        i = min(range(len(ats)), key=lambda j: abs(ats[j] - at))
        if abs(ats[i] - at) <= MATCH_S:
            out.setdefault(i, []).append(r)
    return out


def cell_table(rows: list[dict], trials: list[dict], pieces: tuple[str, ...],
               flag: str | None = None) -> dict:
    """Per cell "b,k": the mean TTFT of the burst's j-th first token (j = 1..k, over the
    trials whose burst was answered whole), all burst TTFTs' median, each piece's mean, how
    many trials were whole and (with `flag`, the rows' key for it) the share of the burst's
    requests whose engine was stepping when they reached it."""
    got = by_trial(rows, trials)
    out: dict[str, dict] = {}
    for key in sorted({(t["b"], t["k"]) for t in trials}):
        b, k = key
        whole = [sorted(x["ttft"] for x in got[i]) for i, t in enumerate(trials)
                 if (t["b"], t["k"]) == key and len(got.get(i, [])) == k]
        reqs = [x for i, t in enumerate(trials) if (t["b"], t["k"]) == key for x in got.get(i, [])]
        out[f"{b},{k}"] = {
            "trials": len(whole),
            "ttft_by_position": [statistics.fmean(w[j] for w in whole) for j in range(k)] if whole else [],
            "ttft_p50": statistics.median(x["ttft"] for x in reqs) if reqs else None,
            "pieces": {p: statistics.fmean(x[p] for x in reqs) for p in pieces} if reqs else {}}
        if flag is not None:
            out[f"{b},{k}"]["engine_stepping"] = (sum(x[flag] for x in reqs) / len(reqs)
                                                  if reqs else None)
    return out


def step_per_position(cell: dict) -> float | None:
    """Least-squares slope of a burst's j-th first token over j (s per position)."""
    ys = cell["ttft_by_position"]
    if len(ys) < 2:
        return None
    xs = range(1, len(ys) + 1)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def watch_cluster(cluster) -> Callable[[], list]:
    """`measure`'s hook: watch the router, each engine and this process (the bench client)."""
    pids = {"client": os.getpid(), "router": cluster.router.pid,
            **{f"engine {i}": p.pid for i, (_, p) in enumerate(cluster.engines)}}
    return CpuWatch(pids).start()


def cpu_costs(samples: list, trials: list[dict], zero: float, output: int, bg_output: int) -> dict:
    """Per process and part (main thread "loop", other threads "rest"): the CPU it spent in
    each trial's 4 s slot (from 0.3 s before its background's send time, whether it has one
    or not: the slots tile the schedule), fitted by least squares over the trials to idle
    seconds + requests + streamed tokens: ms a request, us a token and ms a second idle (the
    load varies by cell, so the three come apart). Empty when too few slots were sampled."""
    rows, ys = [], {}
    # the bursts alone (no background): every request streams `output` tokens, so its tokens
    # are in proportion to the requests and only requests are fitted
    alone = all(t["b"] == 0 for t in trials)
    for t in trials:
        lo = zero + t["at"] - LEAD_S - 0.3
        hi = lo + TRIAL_S
        if hi > samples[-1][0] or lo < samples[0][0]:
            continue
        rows.append([TRIAL_S, t["b"] + t["k"]] if alone else
                    [TRIAL_S, t["b"] + t["k"], t["b"] * bg_output + t["k"] * output])
        for label in samples[0][1]:
            a, b = cpu_at(samples, lo, label), cpu_at(samples, hi, label)
            for part, j in (("loop", 0), ("rest", 1)):
                ys.setdefault(f"{label} {part}", []).append(b[j] - a[j])
    if not rows or len(rows) <= len(rows[0]):  # as many unknowns as slots: no fit
        return {}
    x = np.array(rows, dtype=float)
    out = {}
    for key, y in ys.items():
        coef, *_ = np.linalg.lstsq(x, np.array(y), rcond=None)
        out[key] = {"idle_ms_per_s": 1e3 * coef[0], "ms_per_request": 1e3 * coef[1],
                    "us_per_token": None if alone else 1e6 * coef[2],
                    "mean_ms_per_trial": 1e3 * float(np.mean(y))}
    return out


def _ms(xs: list[float]) -> str:
    return " / ".join(f"{1e3 * x:.0f}" for x in xs) or "-"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _one(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def print_result(res: dict) -> None:
    con = Console(width=160)
    t = Table(title="burst probe: TTFT of the burst's 1st / 2nd / ... first token, ms "
                    "(mean over whole trials); slope = ms per position")
    for c in ("b streams", "k at once", "trials b/s", "bench by position", "sim by position",
              "slope b/s", "p50 b/s", "stepping b/s"):
        t.add_column(c, justify="right")
    for key, bc in res["bench"].items():
        sc = res["sim"][key]
        b, k = key.split(",")
        t.add_row(b, k, f"{bc['trials']}/{sc['trials']}", _ms(bc["ttft_by_position"]),
                  _ms(sc["ttft_by_position"]), f"{_one(bc['slope'])} / {_one(sc['slope'])}",
                  f"{_one(bc['ttft_p50'])} / {_one(sc['ttft_p50'])}",
                  f"{_share(bc['engine_stepping'])} / {_share(sc['engine_stepping'])}")
    con.print(t)
    p = Table(title="where a burst request's time went, ms (mean; bench | simulator)")
    p.add_column("b,k")
    bench_p = list(next(iter(res["bench"].values()))["pieces"])
    sim_p = list(next(iter(res["sim"].values()))["pieces"])
    for c in (*bench_p, "|", *sim_p):
        p.add_column(c, justify="right")
    for key, bc in res["bench"].items():
        sc = res["sim"][key]
        p.add_row(key, *(f"{1e3 * bc['pieces'].get(x, float('nan')):.1f}" for x in bench_p), "|",
                  *(f"{1e3 * sc['pieces'].get(x, float('nan')):.1f}" for x in sim_p))
    con.print(p)
    for name, what in (("cpu", "all trials: idle + requests + streamed tokens"),
                       ("cpu_burst_only", "the bursts alone (b = 0): idle + requests, their "
                                          "few tokens in")):
        if not res.get(name):
            continue
        c = Table(title=f"CPU each process spent, fitted over {what} (loop = its main thread, "
                        "the event loop; rest = its other threads)")
        for col in ("process, part", "ms a request", "us a streamed token", "idle ms a second",
                    "mean ms a trial"):
            c.add_column(col, justify="right")
        for key, v in res[name].items():
            tok = "-" if v["us_per_token"] is None else f"{v['us_per_token']:.0f}"
            c.add_row(key, f"{v['ms_per_request']:.2f}", tok, f"{v['idle_ms_per_s']:.1f}",
                      f"{v['mean_ms_per_trial']:.0f}")
        con.print(c)


PIECES = {"bench": ("to engine", "handler", "inbox", "queue", "prefill", "to loop", "to client"),
          "sim": ("path", "busy", "queue", "prefill")}


def write_schedule(a: argparse.Namespace, work: Path) -> list[dict]:
    """The probe's schedule for `a`'s cells, written to `work` as `a.trace`, with the stage
    spanning it (`a.stage`); its trials (`burst_schedule`)."""
    cells = [(int(b), int(k)) for b in a.background.split(",") for k in a.bursts.split(",")]
    records, trials = burst_schedule(cells, a.repeats, a.prompt, a.output, a.seed,
                                     a.background_output)
    a.trace = work / "bursts.jsonl"
    a.trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    a.stage = trials[-1]["at"] + TRIAL_S  # the whole schedule is sent in the window
    a.time_scale = 1.0
    return trials


def side_cells(rows: list[dict], trials: list[dict], side: str) -> dict:
    """`cell_table` for one side ("bench" or "sim"), with each cell's slope per position."""
    cells = cell_table(rows, trials, PIECES[side], "busy" if side == "bench" else "busy_flag")
    for c in cells.values():
        c["slope"] = step_per_position(c)
    return cells


def resimulate(path: Path) -> dict:
    """A recorded probe priced again by this checkout's simulator, from its JSON alone: the
    schedule rebuilt from its recorded flags and seed, its recorded profile and the engines'
    block size (16, our engine's default, for results that predate recording it); the bench
    side is the recorded one. Seconds, to try a model against every recorded probe."""
    import shutil

    from sim_request_path import simulate

    old = json.loads(path.read_text())
    a = argparse.Namespace(**old["args"])
    work = Path(tempfile.mkdtemp(prefix="sim_burst_probe_resim_"))
    try:
        trials = write_schedule(a, work)
        if len(trials) != len(old["trials"]) or any(
                (t["b"], t["k"]) != (o["b"], o["k"]) or abs(t["at"] - o["at"]) > 1e-6
                for t, o in zip(trials, old["trials"])):
            raise SystemExit(f"{path}: its recorded flags no longer rebuild its schedule")
        profile = work / "profile.json"
        profile.write_text(json.dumps(old["profile"]))
        _, sim_rows = simulate(a, a.trace, [], profile, old.get("engine_block", 16))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**old, "sim": side_cells(sim_rows, trials, "sim"), "sim_before": old["sim"],
            "requests": {**old["requests"], "sim": sim_rows}, "resimulated_from": str(path)}


def main() -> None:
    ap = parser()
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--bursts", default="1,2,4,8", help="requests sent at once, a cell each")
    ap.add_argument("--background", default="0,4", help="streams decoding when a burst arrives")
    ap.add_argument("--repeats", type=int, default=5, help="trials per cell")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens a prompt, before --token-scale")
    ap.add_argument("--output", type=int, default=16, help="tokens a burst request asks for")
    ap.add_argument("--background-output", type=int, default=256,
                    help="tokens a background stream asks for (it must still decode when its "
                         "burst comes, 0.6 s after it was sent)")
    ap.add_argument("--resimulate", type=Path, metavar="RESULT.json",
                    help="price a recorded probe again with this checkout's simulator (no "
                         "cluster; seconds) and write it to --out")
    ap.set_defaults(mode="schedule", token_scale=8, max_output=256,
                    out="bench-out/sim_burst_probe.json")
    a = ap.parse_args()
    if a.resimulate is not None:
        if not a.resimulate.is_file():
            ap.error(f"--resimulate {a.resimulate}: no such file")
        out = resimulate(a.resimulate)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2))
        print_result(out)
        print(f"re-priced {a.resimulate}; wrote {a.out}")
        return
    try:
        ks = [int(x) for x in a.bursts.split(",")]
        bs = [int(x) for x in a.background.split(",")]
    except ValueError:
        ap.error(f"--bursts / --background take comma-separated integers, got {a.bursts!r} / "
                 f"{a.background!r}")
    if (min(ks) < 1 or min(bs) < 0 or a.repeats < 1 or a.prompt < 1 or a.output < 1
            or a.background_output < 1):
        ap.error("--bursts >= 1, --background >= 0, --repeats, --prompt, --output and "
                 "--background-output >= 1")
    if a.mode != "schedule":
        ap.error("the probe is a schedule: leave --mode out")
    trials = write_schedule(a, Path(tempfile.mkdtemp(prefix="sim_burst_probe_")))
    check_args(ap, a)
    res = measure(a, watch_cluster)
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "trials": trials, "profile": res["profile"], "joined": res["joined"],
           "answered": res["answered"], "engine_block": res["engine_block"],
           "requests": res["requests"],
           **{side: side_cells(res["requests"][side], trials, side) for side in ("bench", "sim")}}
    samples = res.get("watch") or []
    if len(samples) > 2:
        zero = res["bench_t0"] + clock_offset(res["requests"]["bench"], sends(trials))
        out["cpu"] = cpu_costs(samples, trials, zero, a.output, a.background_output)
        idle = [t for t in trials if t["b"] == 0]
        if len({t["k"] for t in idle}) > 1:  # bursts alone: what a request costs, its tokens in
            out["cpu_burst_only"] = cpu_costs(samples, idle, zero, a.output, a.background_output)
        if not out["cpu"]:
            print("too few trials were sampled to fit what each process spends", file=sys.stderr)
        out["cpu_samples"] = samples
    if not any(c["trials"] for c in out["bench"].values()):
        sys.exit(f"no burst was answered whole ({res['joined']} requests joined their stamps)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print_result(out)
    print(f"{res['joined']} of {res['answered']} answered requests joined their engine stamps; "
          f"wrote {a.out}")


if __name__ == "__main__":
    main()
