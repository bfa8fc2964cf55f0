"""`agentserve sim calibrate` (sim/calibrate.py): its fits recover the model they invert, its
decode waves and arrival stretch are read as documented, and the command writes a profile
the simulator then reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentserve.sim import calibrate as cal
from agentserve.sim import cli as sim_cli
from agentserve.sim import sessions as sim_workload
from agentserve.sim import specs
from tests.sim.test_agg import PROFILE
from tests.sim.test_seeds import _sessions

SIM = ["sim", "--model", "tiny", "--gpu", "cpu-local", "--topology", "1", "--concurrency", "2",
       "--no-mtp", "--cpu-offload-gib", "0", "--duration", "60", "--warmup", "0", "--clients",
       "closed", "--workload", "seeded.jsonl", "--json"]


def _app() -> typer.Typer:
    app = typer.Typer()
    sim_cli.register(app)
    return app


def test_prefill_fits_recover_the_model_they_invert() -> None:
    """`fit_cold` and `fit_cached` return the parameters that generated their inputs."""
    tok, attn_c, attn_p, attn_d, fixed = 5e-5, 2.5e-8, 3e-8, 6e-7, 2.4e-3

    def cold(n: int) -> float:
        return tok * n + attn_c * n * n / 2

    got = cal.fit_cold(16, (512, cold(512) - cold(16)), (2048, cold(2048) - cold(16)))
    assert got == pytest.approx((tok, attn_c))
    step = fixed + tok * 2048 + attn_c * 2048 * 2048 / 2 + attn_p * 2048 * 2048 + attn_d * 2048
    assert cal.fit_cached(step, 2048, fixed, tok, attn_c, attn_d) == pytest.approx(attn_p)
    # noise that makes the attention term negative leaves a linear fit, not a negative cost
    assert cal.fit_cold(16, (512, 1.0), (2048, 1.0)) == (pytest.approx(1.0 / 2032), 0.0)


def test_calibration_decode_waves_take_a_near_even_split() -> None:
    """`_itl`: the step at batch b is each engine's mean gap while the whole wave decodes,
    then their mean; a split of b + d : b - d counts when d <= b // 8, one further off or
    onto one engine does not, and gaps after the wave's first stream ends (one engine
    decoding alone, with the cores to itself) are left out."""
    def streams(engine: str, n: int, gap: float, first: float, tokens: int) -> list:
        return [(engine, [first + k * gap for k in range(tokens)]) for _ in range(n)]

    even = streams("a", 8, 0.010, 0.1, 40) + streams("b", 8, 0.012, 0.1, 40)
    step, done = cal._itl(even, 8)
    assert step == pytest.approx(0.011) and 1 < done < 40
    # 17 : 15 at batch 16: the mean of the two engines' steps, not weighted by their streams
    step, _ = cal._itl(streams("a", 17, 0.017, 0.1, 60) + streams("b", 15, 0.015, 0.1, 60), 16)
    assert step == pytest.approx(0.016)
    assert cal._itl(streams("a", 9, 0.01, 0.1, 40) + streams("b", 7, 0.01, 0.1, 40), 8) is not None
    assert cal._itl(streams("a", 10, 0.01, 0.1, 40) + streams("b", 6, 0.01, 0.1, 40), 8) is None
    assert cal._itl(streams("a", 5, 0.01, 0.1, 40) + streams("b", 3, 0.01, 0.1, 40), 4) is None
    assert cal._itl(streams("a", 8, 0.01, 0.1, 40), 4) is None
    # engine b's streams end at 0.1 + 19 x 0.01 = 0.29 s; engine a's gaps turn to 50 ms after
    # 0.3 s (decoding alone): those are outside the window
    fast_then_alone = [("a", [0.1 + k * 0.01 for k in range(20)] + [0.3 + k * 0.05 for k in range(1, 20)])
                       for _ in range(4)]
    step, _ = cal._itl(fast_then_alone + streams("b", 4, 0.01, 0.1, 20), 4)
    assert step == pytest.approx(0.01)


def test_calibration_reads_the_arrival_stretch_off_the_engines_traces(tmp_path: Path) -> None:
    """Synthetic traces of one engine decoding 4 streams in 5 ms steps; a busy probe's
    handling (16 tokens, or the cached 8,192) stretches the step it overlaps by 2 ms + 0.5 us a
    prompt token. The calibration finds both from the traces, within its busy phases only
    (the probes outside them stretch 10x as much and are not read), and records them; applied
    (the model tried at stop 51), it also takes the stretch out of the busy request path it
    measured through the client."""
    steps, reqs, t = [], [], 100.0
    windows: list[list[float]] = []
    for phase, n in enumerate((16, 16, 8192, 8192, 16)):
        lo = t
        for k in range(6):
            for _ in range(8):  # steady steps
                steps.append({"t": t, "sched_s": 0.0, "exec_s": 0.005, "post_s": 0.0,
                              "dec": [300] * 4, "pre": []})
                t += 0.005
            stretch = (0.002 + 0.5e-6 * n) * (10 if phase == 4 else 1)
            steps.append({"t": t, "sched_s": 0.0, "exec_s": 0.005 + stretch, "post_s": 0.0,
                          "dec": [300] * 4, "pre": []})
            reqs += [{"api": f"p{phase}-{k}", "recv": t + 0.001, "first": t + 0.05},
                     {"core": f"p{phase}-{k}", "n": n, "hit": 0, "sub": t + 0.002,
                      "adm": t + 0.006, "sched": t + 0.006, "tok": t + 0.01}]
            t += 0.005 + stretch
        if phase < 4:
            windows.append([lo, t])
    (tmp_path / "steps.7.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    (tmp_path / "steps-requests.7.jsonl").write_text("".join(json.dumps(x) + "\n" for x in reqs))
    profile = {"chunk": 2048, "busy_probe_windows": windows, "request_overhead_busy_s": 0.003,
               "request_overhead_busy_per_token_s": 1e-6}
    measured = cal.with_arrival_stretch(profile, tmp_path / "steps")
    assert measured["arrival_stretch_measured_s"] == pytest.approx(0.002, abs=1e-6)
    assert measured["arrival_stretch_measured_per_token_s"] == pytest.approx(0.5e-6, rel=1e-3)
    # recorded only: the simulator's keys and the busy path are untouched
    assert "arrival_stretch_s" not in measured and measured["request_overhead_busy_s"] == 0.003
    out = cal.with_arrival_stretch(profile, tmp_path / "steps", apply=True)
    assert out["arrival_stretch_s"] == pytest.approx(0.002, abs=1e-6)
    assert out["arrival_stretch_per_token_s"] == pytest.approx(0.5e-6, rel=1e-3)
    assert out["request_overhead_busy_s"] == pytest.approx(0.003 - 0.002 - 16 * 0.5e-6, abs=1e-6)
    assert out["request_overhead_busy_per_token_s"] == pytest.approx(0.5e-6, rel=1e-3)
    assert out["request_overhead_busy_measured_s"] == 0.003
    # once more on its own output: the same (it starts from what was measured)
    assert cal.with_arrival_stretch(out, tmp_path / "steps", apply=True)["request_overhead_busy_s"] == \
        pytest.approx(out["request_overhead_busy_s"])
    # no traces there: the profile as it was, and why
    bare = cal.with_arrival_stretch(profile, tmp_path / "nothing")
    assert "arrival_stretch_measured_s" not in bare
    assert "too few busy probes" in bare["arrival_stretch_error"]
    # a torn trace line (an engine killed mid-write): the calibration stands, the error says why
    (tmp_path / "torn.9.jsonl").write_text('{"t": 1.0, "sched_s"\n')
    torn = cal.with_arrival_stretch(profile, tmp_path / "torn")
    assert "could not be read" in torn["arrival_stretch_error"] and torn["request_overhead_busy_s"] == 0.003



class _FakeCluster:
    """Stands in for `agentserve up --topology 2`: records what it was asked to start."""
    made: list[_FakeCluster] = []

    def __init__(self, work: Path, port: int, engine_args: list[str], env=None) -> None:
        self.work, self.port, self.engine_args, self.env = work, port, engine_args, env
        self.started = self.stopped = False
        _FakeCluster.made.append(self)

    def start(self, timeout: float = 300.0) -> None:
        self.started = True

    def stop(self, timeout: float = 60.0) -> None:
        self.stopped = True


@pytest.fixture
def fake_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """No processes: `calibrate_server` answers from a known profile whose per-token prefill
    cost scales with the chunk asked for, so which flags reached it shows in what is written."""
    _FakeCluster.made.clear()
    monkeypatch.setattr(cal, "UpCluster", _FakeCluster)
    seen: dict = {}

    def fake_server(url: str, prompt: int, chunk: int) -> dict:
        seen.update(url=url, prompt=prompt, chunk=chunk)
        return {**PROFILE, "prompt": prompt, "chunk": chunk, "busy_probe_windows": [],
                "tok_s": PROFILE["tok_s"] * chunk / 2048}

    monkeypatch.setattr(cal, "calibrate_server", fake_server)
    monkeypatch.setattr(specs, "CPU_PROFILE_DEFAULT", tmp_path / "default" / "cpu_profile.json")
    monkeypatch.setattr(sim_workload, "load_workload", lambda name, n, seed, *a: _sessions(seed))
    monkeypatch.delenv(specs.CPU_PROFILE_ENV, raising=False)
    return seen


def test_calibrate_writes_a_profile_the_simulator_reads(fake_cluster: dict, tmp_path: Path) -> None:
    out = tmp_path / "mine.json"
    res = CliRunner().invoke(_app(), ["sim", "calibrate", "--out", str(out), "--chunk", "512",
                                      "--prompt", "256", "--port", "18999"])
    assert res.exit_code == 0, res.output
    up = _FakeCluster.made[-1]
    assert up.started and up.stopped and up.port == 18999
    assert up.engine_args == ["--kv-cache-tokens", "65536", "--max-num-batched-tokens", "512"]
    assert up.env == {"AGENTSERVE_STEP_TRACE": str(up.work / "steps")}
    assert fake_cluster == {"url": "http://127.0.0.1:18999", "prompt": 256, "chunk": 512}
    written = json.loads(out.read_text())
    assert written["chunk"] == 512 and written["tok_s"] == pytest.approx(PROFILE["tok_s"] / 4)
    # no step traces from a fake cluster: the stretch is not measured, and the profile says why
    assert "arrival_stretch_error" in written
    assert specs.cpu_local(out).measured == written
    # the simulator prices steps with it: a quarter of the per-token cost, a shorter TTFT
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(PROFILE))
    ttft = {}
    for path in (slow, out):
        run = CliRunner().invoke(_app(), [*SIM, "--cpu-profile", str(path)])
        assert run.exit_code == 0, run.output
        rec = json.loads(run.stdout)
        assert rec["config"]["cpu_profile"] == str(path.resolve())
        ttft[path] = rec["ttft_s"]["p50"]
    assert ttft[out] < ttft[slow]


def test_calibrate_defaults_to_the_profile_the_simulator_reads(fake_cluster: dict) -> None:
    """Without --out it replaces the default profile (package data), which `sim` then reads."""
    res = CliRunner().invoke(_app(), ["sim", "calibrate"])
    assert res.exit_code == 0, res.output
    assert fake_cluster["chunk"] == 2048 and fake_cluster["prompt"] == 1024
    assert specs.cpu_profile_path() == specs.CPU_PROFILE_DEFAULT
    assert specs.cpu_local().measured == json.loads(specs.CPU_PROFILE_DEFAULT.read_text())
    run = CliRunner().invoke(_app(), SIM)
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["config"]["cpu_profile"] == str(specs.CPU_PROFILE_DEFAULT.resolve())


def test_calibrate_flags_out_of_range_are_one_line_errors(fake_cluster: dict) -> None:
    res = CliRunner().invoke(_app(), ["sim", "calibrate", "--chunk", "4096", "--kv-tokens", "1000"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "kv" in res.output
    assert not _FakeCluster.made  # refused before anything started


def test_the_default_profile_ships_as_package_data() -> None:
    assert specs.CPU_PROFILE_DEFAULT.parent == Path(cal.__file__).parent / "data"
    assert specs.CPU_PROFILE_DEFAULT.is_file()
    import tomllib

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "sim/data/*.json" in data["agentserve"]
