"""Repeated profile runs and their aggregate (`agentserve bench --num-profile-runs`)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stub_server import StubServer  # noqa: E402

from agentserve.workload.cli_bench import register_bench  # noqa: E402
from agentserve.workload.multirun import aggregate, run_profile_runs  # noqa: E402
from agentserve.workload.replay import BenchConfig  # noqa: E402


def _stage(out: float, ttft: float | None, conc: int = 4) -> dict:
    return {"concurrency": conc, "output_tok_s": out, "input_tok_s": 10 * out,
            "ttft_s": {"p50": ttft, "p90": None}, "itl_ms": {"p50": 5.0}, "requests_ok": 7}


def test_aggregate_matches_stages_by_position_and_skips_unmeasured() -> None:
    runs = [[_stage(100, 0.5), _stage(50, 1.0, 8)], [_stage(110, None), _stage(70, 2.0, 8)],
            [_stage(120, 0.7)]]  # the third run stopped after one stage
    rec = aggregate(runs)
    assert [s["stage"] for s in rec["stages"]] == ["concurrency 4"]
    m = rec["stages"][0]["metrics"]
    assert m["output_tok_s"]["mean"] == pytest.approx(110) and m["output_tok_s"]["values"] == [100, 110, 120]
    assert m["ttft_p50_s"]["n"] == 2 and m["ttft_p50_s"]["mean"] == pytest.approx(0.6)
    assert m["ttft_p90_s"]["n"] == 0 and m["e2e_p50_s"]["n"] == 0
    assert rec["metadata"]["num_successful_runs"] == 3


def test_a_failed_run_is_recorded_and_the_others_aggregated(tmp_path: Path) -> None:
    calls = []

    def bench(cfg: BenchConfig) -> list[dict]:
        calls.append(cfg.out)
        if len(calls) == 2:
            raise RuntimeError("connection refused")
        return [_stage(100.0 * len(calls), 0.5)]
    rec = run_profile_runs(BenchConfig(url="http://x", trace="t", out=str(tmp_path)), 3, bench=bench)
    assert [Path(c).name for c in calls] == ["run_0001", "run_0002", "run_0003"]
    assert rec["metadata"]["failed_runs"] == [{"label": "run_0002", "error": "RuntimeError: connection refused"}]
    assert rec["metadata"]["num_profile_runs"] == 3 and rec["metadata"]["run_labels"] == ["run_0001", "run_0003"]
    assert rec["stages"][0]["metrics"]["output_tok_s"]["values"] == [100.0, 300.0]
    assert json.loads((tmp_path / "aggregate" / "aggregate.json").read_text()) == rec

    def broken(cfg: BenchConfig) -> list[dict]:
        raise ValueError("bad trace")
    with pytest.raises(ValueError, match="bad trace"):
        run_profile_runs(BenchConfig(url="http://x", trace="t", out=str(tmp_path / "b")), 2, bench=broken)


def _app() -> typer.Typer:
    app = typer.Typer()
    register_bench(app)
    app.command("other")(lambda: None)  # keeps `bench` a sub-command, as in agentserve
    return app


def test_cli_runs_the_bench_n_times_and_aggregates_what_the_runs_wrote(stub_thread: StubServer,
                                                                       tmp_path: Path) -> None:
    mc = [{"timestamp": ms, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]} for ms in (0, 20, 40)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    out = tmp_path / "o"
    res = CliRunner().invoke(
        _app(), ["bench", "--url", stub_thread.url, "--trace", str(tmp_path / "m.jsonl"), "--mode",
                 "schedule", "--token-scale", "4", "--num-profile-runs", "3", "--out", str(out)],
        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "aggregate" / "aggregate.json").read_text())
    runs = [json.loads((out / "profile_runs" / f"run_000{i}" / "summary.json").read_text()) for i in (1, 2, 3)]
    assert rec["metadata"]["num_successful_runs"] == 3 and rec["metadata"]["failed_runs"] == []
    m = rec["stages"][0]["metrics"]
    assert m["requests_ok"]["values"] == [3, 3, 3]
    tput = [r[0]["output_tok_s"] for r in runs]
    assert m["output_tok_s"]["mean"] == pytest.approx(statistics.mean(tput))
    assert m["output_tok_s"]["std"] == pytest.approx(statistics.stdev(tput))
    assert "3 runs" in res.output and "95% CI" in res.output


@pytest.mark.parametrize("flags, message", [
    (["--num-profile-runs", "0"], "--num-profile-runs must be >= 1"),
    (["--confidence-level", "1.2"], "--confidence-level must be between 0 and 1"),
    (["--profile-run-cooldown-seconds", "-1"], "--profile-run-cooldown-seconds must be >= 0"),
])
def test_cli_refuses_bad_multirun_flags(tmp_path: Path, flags: list[str], message: str) -> None:
    (tmp_path / "w.jsonl").write_text('{"id": "s", "requests": []}\n')
    res = CliRunner().invoke(_app(), ["bench", "--url", "http://127.0.0.1:9", "--trace", str(tmp_path / "w.jsonl"),
                                      "--out", str(tmp_path / "o"), *flags], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and message in res.output, res.output
