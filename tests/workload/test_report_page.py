"""The report's tables and page, on a hand-checkable synthetic sessions run (report_runs.py),
and `agentserve report`'s command line: one run, a comparison, bad folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentserve.workload.report_data import delta_rows, error_rows, load_run, run_names, stage_label, turn_rows

from .report_runs import MODEL, TRACE, URL, records, report_app, write_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("runs")
    return write_run(base / "cached"), write_run(base / "uncached", slow=2.0, cache=False)


def test_turn_rows_sum_each_turn_main_and_sub_agents() -> None:
    rows = {r["turn"]: r for r in turn_rows(records())}
    assert list(rows) == ["0", "1", "2"]
    t1 = rows["1"]  # two sub-agent requests, the main turn, and session b's failed turn
    assert (t1["requests"], t1["sub_requests"], t1["failed"]) == (4, 2, 1)
    assert (t1["input_tokens"], t1["cached_tokens"], t1["computed_tokens"]) == (1900, 1200, 700)
    assert t1["ttft_p50_s"] == pytest.approx(0.2)  # of 0.2, 0.3, 0.1; the failure has none
    assert rows["0"]["computed_tokens"] == 3000 and rows["2"]["cached_tokens"] == 1200


def test_error_rows_group_by_message() -> None:
    rows = error_rows(records())
    assert rows == [{"error": "HTTP 500: engine fell over", "count": 1, "status": "500", "first_at_s": 2.0,
                     "example": "b1"}]


def test_delta_rows_against_the_first_run(runs) -> None:
    a, b = (load_run(d) for d in runs)
    rows = {r["metric"]: r for r in delta_rows([a.stages[0], b.stages[0]])}
    ttft = rows["TTFT p50"]
    d, pct, verdict = ttft["deltas"][0]
    assert d == pytest.approx(ttft["values"][1] - ttft["values"][0]) and pct == pytest.approx(100.0)
    assert verdict == "worse"  # twice as slow
    assert rows["cached / input"]["values"][1] == 0.0 and rows["cached / input"]["deltas"][0][2] == "worse"


def test_stage_labels_say_what_a_stage_is() -> None:
    assert stage_label({"concurrency": 16, "stage": 2}) == "concurrency 16"
    assert stage_label({"sessions": 4}) == "4 sessions at once"
    assert stage_label({"sessions": None, "session_rate": 0.5}) == "0.5 sessions/s"
    assert stage_label({"mode": "schedule", "stage": 0}) == "schedule"


def test_run_page_says_what_ran_and_shows_every_view(runs) -> None:
    page = (runs[0] / "report.html").read_text()
    for text in (URL, MODEL, TRACE, "sessions", "UTC", "agentserve bench --url", "python", "CPUs",
                 "2 sessions at once", "token-weighted", "Cached vs computed tokens per turn", "Sessions over time",
                 "TTFT against prompt length", "HTTP 500: engine fell over", "of them sub-agent"):
        assert text in page, text
    assert "sekret" not in page  # the API key is masked in the command line
    assert "ttft_cdf</figcaption>" not in page  # captions are sentences, not file names
    assert "User speed against GPU throughput" not in page and not (runs[0] / "frontier.png").exists()
    assert page.count("<figcaption>") == page.count("data:image/png;base64,") == 6


def test_cli_compare_writes_under_the_first_folder(runs) -> None:
    res = CliRunner().invoke(report_app(), ["report", str(runs[0]), str(runs[1])])
    assert res.exit_code == 0, res.output
    page = (runs[0] / "compare.html").read_text()
    assert "cached vs uncached" in page and "Differences" in page and "uncached - cached" in page
    assert "(+100%)" in page  # TTFT p50 doubled
    res = CliRunner().invoke(report_app(), ["report", str(runs[1]), "--out", str(runs[1] / "again.html")])
    assert res.exit_code == 0 and "TTFT against prompt length" in (runs[1] / "again.html").read_text()


def test_cli_refuses_what_is_not_a_run(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("{not json")
    (tmp_path / "multi" / "profile_runs").mkdir(parents=True)
    for folder, message in (("missing", "no such folder"), ("empty", "no summary.json"),
                            ("bad", "not JSON"), ("multi", "pass profile_runs/run_NNNN")):
        res = CliRunner().invoke(report_app(), ["report", str(tmp_path / folder)])
        assert res.exit_code == 2 and message in res.output, (folder, res.output)


def test_run_names_tell_same_named_folders_apart(tmp_path) -> None:
    assert run_names([tmp_path / "x" / "out", tmp_path / "y" / "out", tmp_path / "z"]) == ["x/out", "y/out", "z"]


def test_summary_json_keeps_the_run_block(runs) -> None:
    info = json.loads((runs[0] / "summary.json").read_text())[0]["run"]
    assert info["url"] == URL and info["versions"]["python"] and info["machine"]["cpus"] >= 1


def test_throughput_bins_count_each_chunk_at_its_arrival() -> None:
    from agentserve.workload.plots import _bins
    from agentserve.workload.record import RequestRecord

    a = RequestRecord("a", "s", 0, start=1.0, chunk_times=[0.5, 1.5, 2.5], chunk_tokens=[1, 2])  # 3rd: 1 token
    b = RequestRecord("b", "s", 0, start=0.0, chunk_times=[0.2], chunk_tokens=[3])
    x, y = _bins([a, b], 1.0)
    assert x.tolist() == [0.5, 1.5, 2.5, 3.5] and y.tolist() == [3.0, 1.0, 2.0, 1.0]
    assert _bins([a], 0.5)[1].sum() * 0.5 == 4  # every token counted once
