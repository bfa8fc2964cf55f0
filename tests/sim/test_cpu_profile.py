"""cpu-local's calibration profile: package data, never silently replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentserve.sim import cli as sim_cli
from agentserve.sim import specs
from agentserve.sim import sessions as sim_workload
from tests.sim.test_agg import PROFILE
from tests.sim.test_seeds import _sessions

ROOT = Path(__file__).resolve().parents[2]
# one aggregated engine: the profile's linear step model times every step (xPyD pools take
# only its roofline rates, `flops` and `mem_bw`)
ARGS = ["sim", "--model", "tiny", "--gpu", "cpu-local", "--topology", "1", "--concurrency", "2",
        "--no-mtp", "--cpu-offload-gib", "0", "--duration", "60", "--warmup", "0", "--clients",
        "closed", "--workload", "seeded.jsonl", "--json"]


def _app() -> typer.Typer:
    app = typer.Typer()
    sim_cli.register(app)
    return app


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small workload instead of the synthesized sweep, and no profile in the environment."""
    monkeypatch.setattr(sim_workload, "load_workload", lambda name, n, seed, *a: _sessions(seed))
    monkeypatch.delenv(specs.CPU_PROFILE_ENV, raising=False)


def test_the_default_profile_is_the_checkout_s_wherever_the_command_runs(
        quick, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # the committed profile is not under the working directory
    assert specs.cpu_profile_path() == ROOT / "src/agentserve/sim/data/cpu_profile.json"
    assert specs.cpu_local().measured == json.loads(specs.CPU_PROFILE_DEFAULT.read_text())
    assert specs.cpu_local(bare=True).measured is None


def test_a_named_profile_that_is_missing_is_an_error(
        quick, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope.json \(--cpu-profile\) is not a file"):
        specs.cpu_profile_path(tmp_path / "nope.json")
    monkeypatch.setenv(specs.CPU_PROFILE_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(ValueError, match=r"gone.json \(\$AGENTSERVE_SIM_CPU_PROFILE\)"):
        specs.hardware_spec("cpu-local")
    res = CliRunner().invoke(_app(), ARGS)  # the environment's, through the command
    assert res.exit_code == 2 and "gone.json ($AGENTSERVE_SIM_CPU_PROFILE) is not a file" \
        in res.output, res.output


def test_cli_cpu_profile_is_read_and_named_in_the_record(quick, tmp_path: Path) -> None:
    slow, fast = tmp_path / "slow.json", tmp_path / "fast.json"
    slow.write_text(json.dumps(PROFILE))
    fast.write_text(json.dumps({**PROFILE, "tok_s": PROFILE["tok_s"] / 4}))
    out = {}
    for path in (slow, fast):
        res = CliRunner().invoke(_app(), [*ARGS, "--cpu-profile", str(path)])
        assert res.exit_code == 0, res.output
        out[path] = json.loads(res.stdout)
        assert out[path]["config"]["cpu_profile"] == str(path.resolve())
    # the profile is what the steps are timed by: a cheaper token, a shorter TTFT
    assert out[fast]["ttft_s"]["p50"] < out[slow]["ttft_s"]["p50"]


def test_cli_bad_profile_flags_are_one_line_errors(quick, tmp_path: Path) -> None:
    res = CliRunner().invoke(_app(), [*ARGS, "--cpu-profile", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "nope.json (--cpu-profile) is not a file" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(_app(), [*ARGS, "--cpu-profile", str(bad)])
    assert res.exit_code == 2 and res.output.startswith("error: "), res.output
    res = CliRunner().invoke(_app(), ["sim", "--gpu", "h200", "--cpu-profile", str(bad)])
    assert res.exit_code == 2 and "--cpu-profile is cpu-local's calibration" in res.output


def test_no_profile_at_all_runs_on_placeholders_and_says_so(
        quick, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(specs, "CPU_PROFILE_DEFAULT", tmp_path / "absent.json")
    res = CliRunner().invoke(_app(), ARGS)
    assert res.exit_code == 0, res.output
    assert "warning: no cpu-local calibration profile" in res.stderr
    assert json.loads(res.stdout)["config"]["cpu_profile"] is None
