"""The benchmark scripts that drive engine internals in-process still run.

They are not timed tests: each runs at a toy size and is checked for a well-formed JSON
result. Two of them had called `EngineCore.step()` without its `failed` argument since
that argument was added, and nothing noticed until a benchmark was rerun by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentserve.sim.config import ROUTE_MISS
from agentserve.sim.specs import CPU_PROFILE_DEFAULT

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(script: str, *args: str, out: Path) -> dict:
    """`script` under benchmarks/, or a concluded study's by its path (docs/studies/NAME/NAME.py)."""
    path = ROOT / script if "/" in script else ROOT / "benchmarks" / script
    cmd = [sys.executable, str(path), *args, "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sched_overhead_runs(tmp_path: Path) -> None:
    res = _run("sched_overhead.py", "--batch", "2", "--prompt", "64", "--steps", "3",
               out=tmp_path / "sched.json")
    assert res["steps"] == 3 and res["median_ms"]["step"] > 0


@pytest.mark.slow
def test_sim_calibrate_in_process_runs(tmp_path: Path) -> None:
    res = _run("sim_calibrate_cpu.py", "--prompt", "64", "--chunk", "128", "--steps", "3",
               "--threads", "1", out=tmp_path / "profile.json")
    assert res["prefill_tok_s"] > 0 and set(res["decode_step_s"]) == {"1", "8", "32"}


def test_sim_calibration_gives_the_reference_tables_measures(tmp_path: Path) -> None:
    """Each row carries the requests answered and the output per answered request as the
    reference's table gives it (output tok/s x the stage / requests), beside SPEC's figures."""
    res = _run("sim_calibration.py", "--duration", "30", "--seeds", "1", out=tmp_path / "cal.json")
    assert [r["concurrency"] for r in res["rows"]] == [16, 64, 128]
    for r in res["rows"]:
        assert r["requests"] > 0
        assert r["out_per_request"] == pytest.approx(r["output_tok_s"] * 30 / r["requests"])
    assert res["reference"]["128"]["out_per_request"] == 906


@pytest.mark.slow
def test_engine_speed_runs(tmp_path: Path) -> None:
    res = _run("engine_speed.py", "--prompt", "256", "--batches", "1,2", "--ctx", "64",
               "--steps", "3", "--temperature", "1.0", "--shared-prefix", "32", "--repeats", "3",
               out=tmp_path / "speed.json")
    assert res["prefill_tok_s"] > 0 and set(res["decode_tok_s"]) == {"1", "2"}
    for b, runs in res["decode_tok_s_runs"].items():  # the median of the recorded windows
        assert len(runs) == 3 and res["decode_tok_s"][b] == sorted(runs)[1]


@pytest.mark.slow
def test_serve_overhead_runs(tmp_path: Path) -> None:
    """In-process, through a real server, and beside a competing load: three tok/s figures."""
    res = _run("serve_overhead.py", "--batches", "2", "--ctx", "64", "--reps", "1",
               out=tmp_path / "overhead.json")
    for key in ("in_process_tok_s", "served_tok_s"):
        assert res[key]["2"] > 0
    assert res["competing_tok_s"]["thread"]["2"] > 0 and res["competing_tok_s"]["process"]["2"] > 0
    assert res["served_cpu"]["2"]["server_threads_cores"]


@pytest.mark.slow
def test_subagent_burst_runs_and_reads_the_shared_prompt_once(tmp_path: Path) -> None:
    """Through a real server: 3 streams after one 1,100-token head (68 whole blocks, over
    MIN_SHARED_TOKENS) decode together, and the engine counts the head's tokens it did not
    read again."""
    res = _run("subagent_burst.py", "--head", "1100", "--own", "40", "--streams", "3",
               "--max-tokens", "24", out=tmp_path / "burst.json")
    assert res["gap_ms_p50"] > 0 and res["together_tok_s"] > 0
    assert res["attn_read_shared_tokens"] > 0 and res["attn_read_shared_tokens"] % 1088 == 0


def test_sim_vs_bench_reads_the_bench_window_and_gauges_drift(tmp_path: Path) -> None:
    """`read_steps` keeps the steps begun inside the bench's window and spans back-to-back
    steps to the next start; `step_drift` prices them with the calibrated profile, so the
    same batches run twice as fast read twice as high."""
    import sim_vs_bench as svb

    profile = CPU_PROFILE_DEFAULT

    def trace(folder: Path, step_s: float) -> None:
        folder.mkdir()
        lines = []
        for i in range(40):  # back to back (0.2 ms loop gaps); 30 begin in [10, 10 + 30 spans)
            lines.append(json.dumps({"t": 10.0 + (i - 5) * (step_s + 2e-4), "sched_s": 0.0,
                                     "exec_s": step_s, "post_s": 0.0,
                                     "dec": [1000, 1100], "pre": []}))
        lines.append(json.dumps({"t": 10.0 + 40 * step_s, "sched_s": 0.0, "exec_s": 0.05,
                                 "post_s": 0.0, "dec": [], "pre": [[512, 0]]}))
        (folder / "steps.1.jsonl").write_text("\n".join(lines) + "\n")

    trace(tmp_path / "slow", 0.010)
    trace(tmp_path / "fast", 0.005)
    until = 10.0 + 30 * (0.010 + 2e-4) - 1e-6
    steps, gaps = svb.read_steps(tmp_path / "slow", 10.0, until)
    assert len(steps) == 30 and len(gaps) == 30  # gaps after the window's steps only
    assert all(s["span"] == pytest.approx(0.0102) for s in steps)
    slow = svb.step_drift(steps, profile)
    fast = svb.step_drift(svb.read_steps(tmp_path / "fast", 10.0, until)[0], profile)
    assert slow is not None and fast is not None and slow["steps"] == 30
    assert slow["by_batch"][2]["model_over_bench"] == slow["model_over_bench"]
    assert fast["model_over_bench"] == pytest.approx(slow["model_over_bench"] * 0.0102 / 0.0052)
    assert svb.step_drift([s for s in steps if not s["dec"]], profile) is None


def test_sim_vs_bench_reads_the_hypervisors_steal() -> None:
    """`cpu_steal` reads this machine's `/proc/stat` (steal never above the total, both growing);
    `steal_frac` is the stolen share between two readings, None without a span."""
    import sim_vs_bench as svb

    a = svb.cpu_steal()
    if a is None:
        pytest.skip("no /proc/stat here")
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:  # let the tick counters move
        pass
    b = svb.cpu_steal()
    assert b is not None and 0 <= a[0] <= a[1] and b[0] >= a[0] and b[1] > a[1]
    assert 0.0 <= svb.steal_frac(a, b) <= 1.0
    assert svb.steal_frac((10, 1000), (15, 1100)) == pytest.approx(0.05)
    assert svb.steal_frac(a, a) is None and svb.steal_frac(None, b) is None


def test_sim_vs_bench_compares_with_the_mean_of_the_runs() -> None:
    """`compare` puts each simulated metric against the mean of the bench runs and keeps every
    run's value, its own error and the runs' spread; a run without a value is left out of the
    mean, not read as zero."""
    import sim_vs_bench as svb

    def summary(out: float, ttft: float | None) -> dict:
        return {"output_tok_s": out, "ttft_s": {"p50": ttft}, "itl_ms": {"p50": 10.0},
                "input_tok_s": 50 * out, "requests_ok": 40, "input_tokens": 1000,
                "cached_tokens": 900}

    sims = [summary(121.0, 0.05), summary(200.0, 0.08)]
    runs = [[summary(100.0, 0.04), summary(190.0, 0.08)],
            [summary(120.0, None), summary(210.0, 0.10)]]
    rows = svb.compare([4, 8], [sims], runs)
    out = rows[0]["output_tok_s"]
    assert out["bench"] == pytest.approx(110.0) and out["err"] == pytest.approx(0.1)
    assert out["bench_runs"] == [100.0, 120.0]
    assert out["err_runs"] == [pytest.approx(0.21), pytest.approx(1 / 120)]
    assert out["bench_cv"] == pytest.approx(200 ** 0.5 / 110)  # sample stdev over the mean
    ttft = rows[0]["ttft_p50_s"]
    assert ttft["bench"] == pytest.approx(0.04) and ttft["err_runs"][1] is None
    assert ttft["bench_cv"] is None and ttft["err"] == pytest.approx(0.25)
    assert rows[1]["ttft_p50_s"]["err"] == pytest.approx(-1 / 9)
    assert rows[1]["concurrency"] == 8 and rows[1]["bench_cached_frac"] == pytest.approx(0.9)
    # one simulation a run (each priced with its own calibrations): the simulations' mean
    # against the runs' mean, and each run's error against its own simulation
    paired = svb.compare([4, 8], [sims, [summary(99.0, 0.03), summary(200.0, 0.08)]], runs)
    out = paired[0]["output_tok_s"]
    assert out["sim"] == pytest.approx(110.0) and out["err"] == pytest.approx(0.0)
    assert out["sim_runs"] == [121.0, 99.0]
    assert out["err_runs"] == [pytest.approx(0.21), pytest.approx(99 / 120 - 1)]
    assert len(paired[0]["sim_extra"]) == 2
    with pytest.raises(ValueError, match="2 simulations for 3 bench runs"):
        svb.compare([4, 8], [sims, sims], [*runs, runs[0]])


def test_sim_vs_bench_tries_a_failed_calibration_once_more(monkeypatch) -> None:
    """`start_calibrated`: a calibration that raises is tried once more on a fresh cluster
    (its error kept, the failed cluster stopped); a second failure raises with both errors;
    every cluster it started and does not return is stopped."""
    import argparse

    import sim_vs_bench as svb

    class Cluster:
        def __init__(self, k: int) -> None:
            self.k, self.stopped = k, False

        def stop(self) -> None:
            self.stopped = True

    started: list[Cluster] = []

    def start(k: int) -> Cluster:
        started.append(Cluster(k))
        return started[-1]

    outcomes = iter([RuntimeError("uneven waves"), ({"tok_s": 1.0}, 0.01)])

    def calibrate_on(args, url):
        got = next(outcomes)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(svb, "calibrate_on", calibrate_on)
    args = argparse.Namespace(port=1)
    cluster, profile, steal, errors = svb.start_calibrated(args, start)
    assert cluster is started[1] and started[0].stopped and not started[1].stopped
    assert profile == {"tok_s": 1.0} and steal == 0.01 and errors == ["uneven waves"]

    started.clear()
    outcomes = iter([RuntimeError("first"), RuntimeError("second")])
    with pytest.raises(RuntimeError, match="twice: first; then second"):
        svb.start_calibrated(args, start)
    assert len(started) == 2 and all(c.stopped for c in started)


def test_sim_vs_bench_prices_a_run_whose_calibration_failed_with_its_neighbour() -> None:
    """`price_runs`: run i is priced with calibrations i and i + 1, with the one of them
    that succeeded when the other failed twice, with all that succeeded when neither did;
    none at all is an error, not a check priced with nothing."""
    import sim_vs_bench as svb

    a, c, d = {"tok_s": 1.0}, {"tok_s": 3.0}, {"tok_s": 5.0}
    by_run, overall = svb.price_runs([a, None, c, d])
    assert [p["tok_s"] for p in by_run] == [1.0, 3.0, 4.0]
    assert overall["tok_s"] == 3.0
    by_run, _ = svb.price_runs([None, None, c])
    assert [p["tok_s"] for p in by_run] == [3.0, 3.0]
    by_run, _ = svb.price_runs([a, None, None])
    assert [p["tok_s"] for p in by_run] == [1.0, 1.0]
    with pytest.raises(ValueError):
        svb.price_runs([None, None])


def test_sim_vs_bench_sets_aside_runs_that_lost_their_cpu() -> None:
    """`steady_runs`: a bench run during which the hypervisor stole more than `max_steal` is
    set aside and another made, at most twice as many runs as asked for; an unknown steal (no
    /proc/stat) keeps the run."""
    import sim_vs_bench as svb

    steals = iter([0.01, 0.21, None, 0.15, 0.02])
    made = []

    def run_one(i: int) -> dict:
        made.append(i)
        return {"steal": next(steals)}

    attempts, kept = svb.steady_runs(run_one, 3, 0.10)
    assert made == [0, 1, 2, 3, 4] and kept == [0, 2, 4] and len(attempts) == 5
    made.clear()
    steals = iter([0.3, 0.3, 0.01, 0.3])
    attempts, kept = svb.steady_runs(run_one, 2, 0.10)
    assert made == [0, 1, 2, 3] and kept == [2]
    assert svb.steady(0.10, 0.10) and not svb.steady(0.1001, 0.10) and svb.steady(None, 0.10)


def test_sim_vs_bench_prints_a_saved_result(capsys) -> None:
    """`print_table` renders a committed result: each run's value and error and the drift gauge."""
    import sim_vs_bench as svb

    svb.print_table(json.loads((ROOT / "benchmarks/results/sim_vs_bench_checks/sim_vs_bench_stop39.json").read_text()))
    out = capsys.readouterr().out
    assert "mean of 3 runs" in out and "301 / 330 / 315" in out and "run 2: the step model" in out


def test_box_speed_summary_tracks_steal() -> None:
    """`box_speed.summarize`: the spread of the windows' steps, and a step time that grows with
    steal reads as a positive correlation and its fit (windows without a reading left out)."""
    sys.path.insert(0, str(ROOT / "docs/studies/box_speed"))
    import box_speed

    windows = [{"step_ms": 20.0 * (1 + 2.0 * st), "steal": st, "sentinel_ms": 9.0 + st}
               for st in (0.0, 0.01, 0.05, 0.1)]
    windows.append({"step_ms": 30.0, "steal": None, "sentinel_ms": None})
    got = box_speed.summarize(windows)
    assert got["windows"] == 5 and got["step_ms"]["max_over_min"] == pytest.approx(1.5)
    assert got["corr_step_steal"] == pytest.approx(1.0)
    assert got["fit"] == {"base_ms": pytest.approx(20.0), "per_unit_steal": pytest.approx(2.0)}
    assert got["corr_step_sentinel"] == pytest.approx(1.0)
    assert box_speed.summarize([{"step_ms": None, "steal": 0.1}]) == {"windows": 0}
    bad = subprocess.run([sys.executable, str(ROOT / "docs/studies/box_speed/box_speed.py"), "--engines", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "need --engines" in bad.stderr


@pytest.mark.slow
def test_box_speed_runs(tmp_path: Path) -> None:
    """One engine and the sentinel over two 3 s windows: both windows timed, steal read."""
    # 64-token prompts and 3 s windows: a window's batch prefills well inside it even at load 15
    # (256 tokens in 2 s windows timed no steps in one window of a full `make test` at load ~15)
    res = _run("docs/studies/box_speed/box_speed.py", "--engines", "1", "--duration", "6", "--window", "3",
               "--lead", "8", "--prompt", "64", "--sentinel-period", "0.2",
               out=tmp_path / "box.json")
    assert [w["k"] for w in res["windows"]] == [0, 1]
    assert all(w["step_ms"] and w["step_ms"] > 0 for w in res["windows"])
    assert all(w["steal"] is not None and 0 <= w["steal"] <= 1 for w in res["windows"])
    assert res["windows"][1]["sentinel_ms"] > 0
    assert res["summary"]["sentinel_priority"] in ("fifo", "normal")


@pytest.mark.slow
def test_sim_step_audit_runs(tmp_path: Path) -> None:
    """A 6 s stage through `up --topology 2` with the engines' step trace on, then the
    simulator on the same corpus: both sides report steps, and the bench's are priced."""
    res = _run("sim_step_audit.py", "--concurrency", "2", "--stage", "6", "--sessions", "8",
               "--port", "18590", "--cpu-profile", str(CPU_PROFILE_DEFAULT),
               out=tmp_path / "audit.json")
    assert res["bench"]["steps"] > 0 and res["sim"]["steps"] > 0
    assert all("model_ms" in row for row in res["bench"]["by_kind"].values())
    assert "by_batch" in res["bench"]["arrival_split"]


@pytest.mark.slow
def test_sim_request_path_joins_client_and_engine_stamps(tmp_path: Path) -> None:
    """A 6 s closed-loop stage with the engines' request trace on: every answered request
    joins its engine stamps by its X-Request-Id, and on the one clock the client and the
    engines share, every piece of its TTFT is a forward step in time (a clock or join that
    was off would put the engine's stamps before the client sent or after it read)."""
    from sim_request_path import BENCH_PIECES, SIM_PIECES

    res = _run("sim_request_path.py", "--mode", "concurrency", "--concurrency", "2", "--stage", "6",
               "--sessions", "8", "--port", "18594",
               "--cpu-profile", str(CPU_PROFILE_DEFAULT),
               out=tmp_path / "path.json")
    assert res["answered"] > 0 and res["joined"] == res["answered"]
    for r in res["requests"]["bench"]:
        assert all(r[p] >= 0 for p in BENCH_PIECES), r
        assert r["to engine"] > 0 and r["prefill"] > 0
    assert res["requests"]["sim"] and all(r[p] >= 0 for r in res["requests"]["sim"] for p in SIM_PIECES)
    assert res["summary"]["all"]["bench"]["ttft"]["n"] == res["joined"]


def test_request_path_helpers() -> None:
    """Engine ids map back to the client's X-Request-Id (which may hold dashes), and a step
    is in flight over [start, end) only."""
    from sim_request_path import engine_id_to_client, stepping

    assert engine_id_to_client("cmpl-s3-t2-main-0a1b2c3d-0") == "s3-t2-main"
    assert engine_id_to_client("chatcmpl-x-deadbeef-1") == "x"
    spans = [(1.0, 2.0), (2.5, 3.0)]
    assert [stepping(spans, t) for t in (0.5, 1.0, 1.9, 2.0, 2.2, 2.7, 3.0)] == \
        [False, True, True, False, False, True, False]


def test_burst_probe_schedules_each_cell_and_finds_its_bursts_again() -> None:
    """Every cell is scheduled `repeats` times with distinct prompts, times start at the first
    send, and requests stamped on a clock that started earlier are matched back to their
    burst (background streams left out); the slope per position of a line is its step."""
    from sim_burst_probe import LEAD_S, burst_schedule, by_trial, cell_table, step_per_position

    records, trials = burst_schedule([(0, 1), (2, 3)], 3, 1024, 8, seed=1, bg_output=100)
    assert sorted((t["b"], t["k"]) for t in trials) == [(0, 1)] * 3 + [(2, 3)] * 3
    assert len(records) == 3 * 1 + 3 * (2 + 3)
    ids = [h for r in records for h in r["hash_ids"]]
    assert len(ids) == len(set(ids)) and all(len(r["hash_ids"]) == 2 for r in records)
    assert records[0]["timestamp"] == 0 and min(t["bg_at"] if t["bg_at"] is not None else t["at"]
                                                for t in trials) == 0
    assert sorted(r["output_length"] for r in records)[-6:] == [100] * 6
    for t in trials:
        assert t["bg_at"] is None if t["b"] == 0 else t["at"] - t["bg_at"] == pytest.approx(LEAD_S)
    # the bench's clock started 7.3 s before the schedule; each burst's j-th request 2 ms later
    rows, pos = [], {}
    for r in records:
        at = r["timestamp"] / 1e3
        j = pos[at] = pos.get(at, 0) + 1
        rows.append({"start": 7.3 + at + 0.0005 * j, "ttft": 0.010 + 0.002 * j})
    got = by_trial(rows, trials)
    assert sorted(len(v) for v in got.values()) == [1, 1, 1, 3, 3, 3]
    cells = cell_table(rows, trials, ())
    assert cells["2,3"]["trials"] == 3 and cells["0,1"]["trials"] == 3
    assert cells["2,3"]["ttft_by_position"] == pytest.approx([0.012, 0.014, 0.016])
    assert step_per_position(cells["2,3"]) == pytest.approx(0.002)
    assert step_per_position(cells["0,1"]) is None


def test_burst_probe_fits_what_each_process_spends() -> None:
    """CPU samples made from a known cost (2 ms idle a second, 1.5 ms a request, 80 us a
    streamed token; the rest threads a flat 1 ms a second) are fitted back to it over the
    trials' slots, and this process's own threads read as CPU seconds that only grow."""
    from cpu_watch import CpuWatch
    from sim_burst_probe import LEAD_S, TRIAL_S, burst_schedule, cpu_costs

    _, trials = burst_schedule([(0, 1), (0, 4), (3, 2), (3, 8)], 3, 512, 16, seed=2,
                               bg_output=200)
    zero = 100.0
    # each slot's load spent at its middle, 2 s from its edges (where the fit reads)
    spent = [(zero + t["at"] - LEAD_S - 0.3 + TRIAL_S / 2,
              1.5e-3 * (t["b"] + t["k"]) + 80e-6 * (t["b"] * 200 + t["k"] * 16)) for t in trials]
    samples = []
    for i in range(int((len(trials) * TRIAL_S + 2) / 0.25)):
        now = zero - 1.03 + 0.25 * i
        loop = 2e-3 * (now - zero) + sum(c for at, c in spent if at <= now)
        samples.append((now, {"router": (loop, 1e-3 * (now - zero))}))
    fit = cpu_costs(samples, trials, zero, 16, 200)
    assert fit["router loop"]["idle_ms_per_s"] == pytest.approx(2.0, rel=0.02)
    assert fit["router loop"]["ms_per_request"] == pytest.approx(1.5, rel=0.02)
    assert fit["router loop"]["us_per_token"] == pytest.approx(80, rel=0.02)
    assert fit["router rest"]["idle_ms_per_s"] == pytest.approx(1.0, rel=0.02)
    assert abs(fit["router rest"]["ms_per_request"]) < 0.01
    import os
    a = CpuWatch.read(os.getpid())
    sum(i * i for i in range(200_000))
    b = CpuWatch.read(os.getpid())
    assert b[0] > a[0] >= 0 and b[1] >= a[1] >= 0


def test_burst_probe_resimulate_reproduces_a_recorded_probe(tmp_path: Path) -> None:
    """A recorded probe re-priced from its JSON alone (schedule rebuilt from its flags and
    seed, its profile) gives the simulator side it recorded, to the digit: the model has not
    changed since, and a model that does can be tried on every recorded probe this way."""
    res = _run("sim_burst_probe.py", "--resimulate",
               str(ROOT / "benchmarks/results/sim_burst_probe.json"), out=tmp_path / "re.json")
    assert res["sim"].keys() == res["sim_before"].keys() and len(res["sim"]) == 8
    for key, cell in res["sim"].items():
        was = res["sim_before"][key]
        assert cell["ttft_by_position"] == was["ttft_by_position"] and cell["trials"] == was["trials"]
    assert res["bench"]["4,8"]["trials"] == 5


@pytest.mark.slow
def test_burst_probe_runs(tmp_path: Path) -> None:
    """Two cells once each on a fresh cluster: every burst answered whole, on both sides."""
    res = _run("sim_burst_probe.py", "--bursts", "2", "--background", "0,1", "--repeats", "1",
               "--port", "18598", "--cpu-profile",
               str(CPU_PROFILE_DEFAULT), out=tmp_path / "burst.json")
    assert res["joined"] == res["answered"] == 2 + 3
    for side in ("bench", "sim"):
        assert {k: c["trials"] for k, c in res[side].items()} == {"0,2": 1, "1,2": 1}
        assert all(len(c["ttft_by_position"]) == 2 for c in res[side].values())


def test_arrival_split_measures_the_stretch() -> None:
    """Steps before an arrival that run 3 ms + 1 us a prompt token past the steady steps
    (priced 5 ms, measured 10: the box at half the model's speed) are found to, per batch
    and in the fit; steps after which the engine idled and other engines' steps are apart."""
    from sim_step_audit import arrival_split

    def step(t: float, span: float, dec: int, pre: list | None = None, engine: str = "a") -> dict:
        return {"t": t, "dt": span - 1e-4, "span": span, "dec": [100] * dec, "pre": pre or [],
                "engine": engine}

    steps, t = [], 0.0
    for i in range(40):
        prompt = 500 + 100 * i
        if i % 2:  # a steady step, then one before an arrival, then the arrival's prefill
            steps.append(step(t, 0.010, 2))
            t += 0.010
            steps.append(step(t, 0.010 + 0.003 + 1e-6 * prompt, 2))
            t += 0.02
            steps.append(step(t, 0.02, 2, [[16, prompt - 16]]))
            t += 0.02
        else:
            steps.append(step(t, 0.010, 2))
            t += 0.010
    idle = step(t, 0.5, 2)
    idle["span"] = idle["dt"]  # the engine idled after it: not a back-to-back step
    steps += [idle, step(t + 0.6, 0.02, 2, [[16, 100]])]
    steps.append(step(t, 0.5, 2, engine="b"))  # another engine's lone step: no pair
    out = arrival_split(steps, lambda s: 0.005)
    row = out["by_batch"][2]
    assert row["before_arrival"] == 20 and row["steady"] >= 20
    assert row["excess_ms_median"] == pytest.approx(3 + 1e-3 * (500 + 100 * 20), abs=0.2)
    assert out["fit"]["excess_s"] == pytest.approx(0.003, abs=1e-4)
    assert out["fit"]["excess_per_token_s"] == pytest.approx(1e-6, rel=0.02)


def test_pause_signal_orders_bound_each_other() -> None:
    """kvtier_pause_signal.py's offline replay on the bundled Weka mini trace: the oracle
    (Belady) brings back the fewest blocks; a hint with no error is the oracle itself; a
    noisy one lands between the oracle and a hint that knows nothing useful."""
    import kvtier_pause_signal as ps

    sessions, _ = ps.load_turns(str(ps.DEFAULT_TRACE), 8, 0.25, 120.0)
    mean_ctx = sum(sum(len(t.blocks) for t in s) / len(s) for s in sessions) / len(sessions)
    cap = int(4 * mean_ctx / 3)  # 4 sessions at once, live KV 3x the cache
    got = {p: ps.replay(sessions, 4, cap, p, 0.5, 0.0016)["missed_blocks"]
           for p in ("lru", "belady", "hint:0", "hint:0.5", "hint:8")}
    assert got["hint:0"] == got["belady"] < got["lru"]
    assert got["belady"] <= got["hint:0.5"] <= got["hint:8"] and got["belady"] < got["hint:8"]



@pytest.mark.slow
def test_sim_published_runs(tmp_path: Path) -> None:
    """One published configuration, a short stage: the simulated figures sit beside the published."""
    res = _run("sim_published.py", "--only", "lim 1P1D no-MTP c32", "--duration", "20",
               out=tmp_path / "published.json")
    row = res["rows"]["lim 1P1D no-MTP c32"]
    assert row["out"] > 0 and row["itl"] > 0 and row["ttft"] > 0
    assert res["published"]["lim 1P1D no-MTP c32"]["itl"] == 28.6
    assert 0 < row["hit"] <= 1 and res["route_miss"] == ROUTE_MISS
    assert row["pull"] > 0 and row["req_s"] > 0  # what its prefill ranks carried


def test_sim_published_counts_figures_in_their_bands() -> None:
    """The band count reads the published figures a results file carries: a figure at the
    edge of its band counts, one past it is a miss, the calibration run is not held back, and
    unbanded figures (restored GiB) are not counted."""
    from sim_published import band_count

    rows = {"full 3P1D c16": {"out": 110.0, "ttft": 1.3},
            "lim P8/D16 c128": {"out": 200.0, "ttft": 1.0, "restore": 1.0}}
    published = {"full 3P1D c16": {"out": 100.0, "ttft": 1.0},
                 "lim P8/D16 c128": {"out": 100.0, "ttft": 1.0, "restore": 100.0}}
    c = band_count(rows, published)
    assert (c["figures"], c["in_band"], c["held_back"], c["held_back_in_band"]) == (4, 2, 2, 1)
    assert [(n, m) for n, m, _ in c["misses"]] == [("full 3P1D c16", "ttft"), ("lim P8/D16 c128", "out")]


def test_sim_published_reports_a_results_file_without_simulating(tmp_path: Path) -> None:
    doc = {"duration": 900.0, "seeds": 1, "idle_gap_cap_s": 10.0, "route_miss": ROUTE_MISS,
           "rows": {"lim 1P1D no-MTP c32": {"out": 1145.0, "itl": 40.0, "ttft": 1.1, "e2e": 9.0,
                                            "per_user": 28.7, "restore": 0.0, "dlocal": 0.0,
                                            "hit": 0.9, "ttft_p90": 2.0, "prefill_busy": 0.5}},
           "published": {"lim 1P1D no-MTP c32": {"out": 1145, "itl": 28.6, "ttft": 1.1}}}
    f = tmp_path / "published.json"
    f.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_published.py"), "--report", str(f)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "in band: 2 of 3 published figures" in r.stdout
    assert "miss: lim 1P1D no-MTP c32 itl +40%" in r.stdout
    assert "per prefill rank" in r.stdout  # a file without pulls still prints its ranks


def test_sim_published_rates_each_prefill_rank() -> None:
    """The per-rank table divides a stage's restored and pulled GiB by its seconds and its
    prefill ranks (P8/D16: one DEP8 instance; 3P1D: three DEP16 ones)."""
    from sim_published import prefill_ranks, rank_table
    from rich.console import Console

    assert prefill_ranks("lim P8/D16 c128") == 8 and prefill_ranks("full 3P1D c128") == 48
    doc = {"duration": 900.0, "rows": {"lim P8/D16 c128": {
        "prefill_busy": 1.0, "req_s": 4.0, "restore": 900.0 * 8, "pull": 900.0 * 4}}}
    console = Console(width=200, record=True)
    console.print(rank_table(doc))
    line = [x for x in console.export_text().splitlines() if "P8/D16" in x][0]
    per_gib = 2**30 / 1e9
    assert [c.strip() for c in line.split("│")[2:7]] == [
        "8", "1.00", "0.50", f"{per_gib:.2f}", f"{per_gib / 2:.2f}"]


@pytest.mark.slow
def test_sim_clients_compares_the_load_generators(tmp_path: Path) -> None:
    """A short c16 stage under both load generators: the closed loop, with no think time,
    sends more input per second than AIPerf's replay with the recorded think times (no
    idle-gap cap) on the same corpus."""
    res = _run("docs/studies/sim_clients/sim_clients.py", "--concurrency", "16", "--duration", "60",
               "--idle-gap-cap-s", "off", out=tmp_path / "clients.json")
    rows = {r["clients"]: r for r in res["rows"]}
    assert rows["closed"]["input_tok_s"] > rows["agentx"]["input_tok_s"] > 0
    assert res["idle_gap_cap_s"] is None and res["reference"]["16"]["input_tok_s"] == 86_000


@pytest.mark.slow
def test_sim_lane_duty_rises_with_a_tighter_gap_cap(tmp_path: Path) -> None:
    """A short c16 stage with and without AIPerf's 10 s idle-gap cap: capped lanes wait less
    between requests, so more of their time has a request in flight; the Little's-law estimate
    tracks the time-averaged count, and the published rows are carried through."""
    res = _run("sim_lane_duty.py", "--concurrency", "16", "--duration", "120", "--seeds", "1",
               "--caps", "none,10 s", out=tmp_path / "duty.json")
    sim = {r["cap"]: r for r in res["simulated"]}
    assert sim["10 s"]["in_flight_per_lane"] > sim["none"]["in_flight_per_lane"] > 0
    for r in sim.values():
        assert abs(r["lane_duty"] - r["in_flight_per_lane"]) < 0.25 * r["in_flight_per_lane"]
    ref = next(r for r in res["published"] if r["source"].startswith("reference") and r["concurrency"] == 128)
    assert abs(ref["lane_duty"] - (6281 / 128 * 0.0191 + 6242 / 900 / 128 * 2.18)) < 1e-9


@pytest.mark.slow
def test_sim_decode_locality_brackets_placement(tmp_path: Path) -> None:
    """A short stage, both decode placements: ranks drawn at random hold less of the prompt
    than the reference's picker, which sends a client back to its rank."""
    res = _run("sim_decode_locality.py", "--only", "lim 1P1D MTP c64", "--duration", "60",
               out=tmp_path / "locality.json")
    row = res["rows"]["lim 1P1D MTP c64"]
    assert row["random"]["dlocal"] < row["llm-d"]["dlocal"]
    assert res["published"]["lim 1P1D MTP c64"]["dlocal"] == 0.513


@pytest.mark.slow
@pytest.mark.interop
def test_vllm_request_path_runs(tmp_path: Path) -> None:
    """A real vLLM, two prompt sizes of prose: a cached prompt's time to first token grows with
    its length, and the prose has AIPerf's density (~3.3 characters a token)."""
    res = _run("docs/studies/vllm_request_path/vllm_request_path.py", "--sizes", "1500,30000", "--reps", "3", "--repeat", "1",
               out=tmp_path / "path.json")
    small, large = res["rows"]
    assert large["prompt_tokens"] > 5 * small["prompt_tokens"]
    assert 2.5 < res["chars_per_token"] < 4.5
    assert res["chat_per_token_s"] > 0 and large["warm_chat_s"] > small["warm_chat_s"]


def test_sim_gpu_rank_dry_run(tmp_path: Path) -> None:
    """The GPU check of the step model's GEMM term (benchmarks/sim_gpu_rank.py) at toy widths
    on the CPU: one row per load, each with its kernels' bytes, FLOPs and timings."""
    res = _run("sim_gpu_rank.py", "--device", "cpu", "--scale", "32", "--layers", "2",
               "--decode", "16", "--prefill", "64", "--reps", "1", out=tmp_path / "rank.json")
    assert [(r["phase"], r["tokens_rank"]) for r in res["rows"]] == [("decode", 16), ("prefill", 64)]
    for r in res["rows"]:
        assert r["measured_s"] > 0 and r["kernels"] > 0 and r["roofline_s"] > 0
        assert r["weight_gb"] > 0 and r["fp8_tflop"] > 0 and r["bf16_tflop"] > 0
    assert res["rows"][1]["act_gb"] > res["rows"][0]["act_gb"]


def test_sim_gpu_rank_streams_the_weights_the_step_model_prices() -> None:
    """The emulated DEP16 rank (allocated on the meta device: no memory) holds the weight bytes
    that `PerfModel` says a decode step with every local expert touched streams."""
    import torch
    from sim_gpu_rank import Rank

    from agentserve.sim.memory import Topology
    from agentserve.sim.perf import PerfModel
    from agentserve.sim.specs import GLM_5_2_FP8, H200

    rank = Rank(GLM_5_2_FP8, 16, torch.device("meta"), fp8=True, grouped=False)
    pm = PerfModel(model=GLM_5_2_FP8, hw=H200, topo=Topology("dep", 16, "decode"))
    assert rank.local == 16
    assert rank.weight_gib() * 2**30 == pytest.approx(pm.rank_weight_bytes(1.0), rel=0.01)


def test_sim_vs_bench_resimulate_reproduces_the_checks_own_simulations(tmp_path: Path) -> None:
    """`sim_vs_bench.py --resimulate` rebuilds the corpus, each run's profile (from the recorded
    calibrations) and the bench figures from a result file alone: with the simulator that
    priced stop 48's closed-loop check (unchanged since for cpu-local) it gives the same
    simulations, run by run, and keeps the bench figures as recorded."""
    src = ROOT / "benchmarks" / "results" / "sim_vs_bench_checks" / "sim_vs_bench_stop48.json"
    res = _run("sim_vs_bench.py", "--resimulate", str(src), out=tmp_path / "resim.json")
    old = json.loads(src.read_text())
    assert res["resimulated_from"] == str(src)
    for was, now in zip(old["rows"], res["rows"]):
        for key in ("output_tok_s", "ttft_p50_s", "itl_p50_ms", "requests_ok"):
            assert now[key]["sim_runs"] == pytest.approx(was[key]["sim_runs"], rel=1e-9)
            assert now[key]["bench_runs"] == was[key]["bench_runs"]
            assert now[key]["err"] == pytest.approx(was[key]["err"], rel=1e-9)
    assert all(run["step_drift"] is None for run in res["bench_runs"])


def test_sim_vs_bench_history_prices_each_recorded_run_again(tmp_path: Path) -> None:
    """The history of the small-scale check (benchmarks/sim_vs_bench_history.py) over a folder
    holding stop 48's check and one result without per-run records: the check's six (run,
    concurrency) pairs priced now as then (the model has not changed for cpu-local since), the
    other listed as skipped."""
    import shutil

    shutil.copy(ROOT / "benchmarks" / "results" / "sim_vs_bench_checks" / "sim_vs_bench_stop48.json", tmp_path)
    (tmp_path / "sim_vs_bench_old.json").write_text(json.dumps({"rows": [], "args": {}}))
    res = _run("sim_vs_bench_history.py", "--results", str(tmp_path), out=tmp_path / "h.json")
    s = res["summary"]
    assert s["pairs"] == 6 and s["in_band_now"] == s["in_band_then"] == 6
    assert res["skipped"] == ["sim_vs_bench_old.json"]
    [check] = res["checks"]
    for now, then in zip(check["now"], check["then"], strict=True):
        assert now == pytest.approx(then, rel=1e-9)


def test_make_bench_runs_the_suite_and_nothing_else() -> None:
    """benchmarks/ holds the suite (run_all.SUITE) and its helpers only; every script the
    README cites is in it; BENCH picks, BENCH_FULL sizes, and a quick run of a long benchmark
    writes bench-out/, never over the committed full-size result."""
    import re

    import run_all

    names = [b.name for b in run_all.SUITE]
    assert len(names) == len(set(names))
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts == set(names) | set(run_all.HELPERS), scripts ^ (set(names) | set(run_all.HELPERS))
    cited = set(re.findall(r"benchmarks/(\w+)\.py", (ROOT / "README.md").read_text()))
    assert cited <= set(names), cited - set(names)
    assert [b.name for b in run_all.select("sched_overhead, harden_soak")] == ["sched_overhead", "harden_soak"]
    assert "sim_gpu_rank" not in [b.name for b in run_all.select(None)]  # manual: only when named
    with pytest.raises(SystemExit, match="no benchmark nope"):
        run_all.select("nope")
    soak = next(b for b in run_all.SUITE if b.name == "harden_soak")
    cmd, out = run_all.command(soak, full=False)
    assert out == ROOT / "bench-out/harden_soak.json" and cmd[-4:-2] == ["--rss-limit-pct", "100"]
    cmd, out = run_all.command(soak, full=True)
    assert out == ROOT / "benchmarks/results/harden_soak.json" and "--minutes" not in cmd
    sched = next(b for b in run_all.SUITE if b.name == "sched_overhead")
    assert run_all.command(sched, full=False)[1] == ROOT / "benchmarks/results/sched_overhead.json"
