"""`agentserve sim --clients schedule`: a trace's requests at their recorded times, open loop, as
`agentserve bench --mode schedule` sends them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agentserve.sim import sessions as wl
from agentserve.sim.run import SimConfig, Simulation, simulate
from agentserve.sim.schedule import scheduled
from agentserve.workload.replay_load import mooncake_jobs
from agentserve.workload.replay_plan import schedule_jobs
from agentserve.workload.schema import Session, TraceRequest
from agentserve.workload.traces import load_mooncake

# r1 arrives 0.5 s after r0 and extends its prefix; r2 at 2 s; r3 at 50 s (ms timestamps);
# r0 writes 400 tokens, so that it is still in flight at 0.5 s on any calibrated profile (at
# 40 it had ended by 0.40 s on the profile of a faster box)
MOONCAKE = [
    {"timestamp": 1000, "input_length": 1024, "output_length": 400, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 300, "output_length": 40, "hash_ids": [7]},
    {"timestamp": 51000, "input_length": 600, "output_length": 40, "hash_ids": [8, 9]},
]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _cfg(path: str, **kw) -> SimConfig:
    base = dict(model="tiny", gpu="cpu-local", prefill=1, decode=1, prefill_width=1,
                decode_width=1, duration=600.0, mtp=False, cpu_offload_gib=0.0,
                clients="schedule", workload=path)
    return SimConfig(**{**base, **kw})


def test_requests_leave_at_their_recorded_times_whatever_is_in_flight(tmp_path) -> None:
    path = _write(tmp_path / "mc.jsonl", MOONCAKE)
    sim = Simulation(_cfg(path), wl.session_stream(path, 1, 0))
    s = sim.run()
    recs = sorted(sim.records, key=lambda r: r.start)
    assert [r.start for r in recs] == pytest.approx([0.0, 0.5, 2.0, 50.0])
    assert recs[1].start < recs[0].end  # open loop: r1 does not wait for r0's answer
    assert s["requests_ok"] == 4
    # the trace ends long before the 600 s window: throughput is over the stage as it ran
    # (its start to the last answer, as the bench's wall time), not over 600 s
    assert s["duration_s"] == pytest.approx(max(r.end for r in recs))
    assert s["duration_s"] < 60
    # global ids: r1 finds r0's 16 blocks on the prefill rank
    assert s["prefill_gpu_hit_rate"] == pytest.approx(16 * 64 / (1024 + 1500 + 300 + 600))


def test_the_window_closes_the_schedule_and_a_warmup_opens_it_later(tmp_path) -> None:
    path = _write(tmp_path / "mc.jsonl", MOONCAKE)
    s = simulate(_cfg(path, duration=10.0))  # r3 (50 s) is due after the window: never sent
    assert s["requests_ok"] == 3 and s["duration_s"] >= 10.0
    s = simulate(_cfg(path, warmup=1.0, duration=100.0))  # r0, r1 in the warm-up: not counted
    assert s["requests_ok"] == 2


def test_session_rate_spaces_sessions_and_keeps_their_own_offsets(tmp_path) -> None:
    def sess(i: int) -> Session:
        return Session(id=f"s{i}", block_size=64, items=[
            TraceRequest(t=0.0, input_tokens=128, output_tokens=8, hash_ids=[1, 2]),
            TraceRequest(t=3.0, input_tokens=256, output_tokens=8, hash_ids=[1, 2, 3, 4])])
    times = [t for t, _, _ in scheduled([sess(0), sess(1), sess(2)], spacing=0.5)]
    assert times == pytest.approx([0.0, 0.5, 1.0, 3.0, 3.5, 4.0])
    # local ids: each session its own namespace, so s1 does not hit s0's blocks
    assert len({ns for _, ns, _ in scheduled([sess(0), sess(1)])}) == 2
    sim = Simulation(_cfg("x", session_rate=2.0), [sess(0), sess(1), sess(2)])
    sim.run()
    assert sorted(r.start for r in sim.records) == pytest.approx([0.0, 0.5, 1.0, 3.0, 3.5, 4.0])


def test_the_schedule_is_the_bench_schedule(tmp_path) -> None:
    """The simulator's send times are `agentserve bench --mode schedule`'s for the same file:
    mooncake records by timestamp, and the same trace as Weka sessions (`start_ms` kept)."""
    path = _write(tmp_path / "mc.jsonl", MOONCAKE)
    bench = [j.at for j in mooncake_jobs(load_mooncake(path, block_size=512))]
    sim = [t for t, _, _ in scheduled(wl.load_workload(path, 1, 0))]
    assert sim == pytest.approx(bench) == [0.0, 0.5, 2.0, 50.0]
    from agentserve.workload.traces import mooncake_to_sessions
    weka = mooncake_to_sessions(load_mooncake(path, block_size=512))
    assert [j.at for j in schedule_jobs(weka)] == pytest.approx(bench)


def test_a_schedule_needs_a_trace_and_its_flags_refuse_nonsense(tmp_path) -> None:
    with pytest.raises(ValueError, match="recorded times"):
        simulate(SimConfig(clients="schedule", duration=10.0))
    with pytest.raises(ValueError, match="--session-rate"):
        simulate(SimConfig(session_rate=1.0, duration=10.0))
    from agentserve.cli import app

    path = _write(tmp_path / "mc.jsonl", MOONCAKE)
    run = CliRunner().invoke
    r = run(app, ["sim", "--workload", path, "--clients", "schedule", "--session-rate", "0"])
    assert r.exit_code != 0 and "--session-rate" in r.output
    r = run(app, ["plan", "--workload", path, "--clients", "schedule", "--out", str(tmp_path / "p")])
    assert r.exit_code != 0 and "schedule" in r.output and "Traceback" not in r.output
    r = run(app, ["sim", "--model", "tiny", "--gpu", "cpu-local", "--topology", "1P1D",
                  "--prefill-width", "1", "--decode-width", "1", "--no-mtp",
                  "--cpu-offload-gib", "0", "--workload", path, "--clients", "schedule", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("{"):])["requests_ok"] == 4
