"""Statistics over repeated runs (`agentserve.runstats`): the mean of records, AIPerf's block."""

from __future__ import annotations

import math

import pytest

from agentserve.runstats import describe, interval_text, mean_records, spread, t_critical, value_at


@pytest.mark.parametrize("confidence, df, expected", [
    (0.95, 1, 12.7062), (0.95, 4, 2.7764), (0.95, 9, 2.2622), (0.99, 4, 4.6041),
    (0.90, 2, 2.9200), (0.95, 1000, 1.9623), (0.999, 1, 636.619)])
def test_t_critical_matches_the_t_table(confidence: float, df: int, expected: float) -> None:
    assert t_critical(confidence, df) == pytest.approx(expected, rel=1e-4)


def test_t_critical_refuses_levels_outside_0_1_and_no_freedom() -> None:
    for bad in (0.0, 1.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="between 0 and 1"):
            t_critical(bad, 3)
    with pytest.raises(ValueError, match="degree of freedom"):
        t_critical(0.95, 0)


def test_describe_is_aiperfs_block() -> None:
    """AIPerf's worked example: TTFT p99 of 150, 152, 148, 155, 151 ms."""
    d = describe([150, 152, 148, 155, 151])
    assert d["mean"] == pytest.approx(151.2) and d["std"] == pytest.approx(2.588, abs=1e-3)
    assert d["se"] == pytest.approx(2.588 / math.sqrt(5), abs=1e-3)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((148.0, 154.4), abs=0.05)
    assert d["min"] == 148 and d["max"] == 155 and d["cv"] == pytest.approx(0.0171, abs=1e-4)
    one = describe([3.0])
    assert one["mean"] == 3.0 and "ci_low" not in one  # no interval from one value
    assert describe([])["n"] == 0
    zero = describe([0.0, 0.0, 0.0])  # a figure no run moved (e.g. no restores): strict JSON
    assert zero["mean"] == 0 and zero["std"] == 0 and zero["cv"] is None


def test_mean_records_averages_numbers_and_recurses() -> None:
    """Numbers averaged over every record, nested dicts recursed, anything else (or a field
    one of them lacks) taken from the first; booleans are not numbers."""
    a = {"tok_s": 1.0, "decode_step_s": {"1": 0.01, "8": 0.02}, "source": "server", "n": 2,
         "only_a": 5.0, "flag": True}
    b = {"tok_s": 2.0, "decode_step_s": {"1": 0.02, "8": 0.04}, "source": "core", "n": 4,
         "flag": False}
    c = {"tok_s": 6.0, "decode_step_s": {"1": 0.03, "8": 0.06}, "source": "x", "n": 6,
         "only_a": 1.0, "flag": False}
    got = mean_records([a, b, c])
    assert got["tok_s"] == pytest.approx(3.0) and got["n"] == pytest.approx(4.0)
    assert got["decode_step_s"] == {"1": pytest.approx(0.02), "8": pytest.approx(0.04)}
    assert got["source"] == "server" and got["only_a"] == 5.0 and got["flag"] is True
    assert mean_records([a]) == a


def test_spread_reads_each_figure_by_its_path_and_skips_records_without_it() -> None:
    records = [{"out": 10.0, "ttft": {"p50": 1.0}}, {"out": 14.0, "ttft": {"p50": None}},
               {"out": float("nan"), "ttft": {"p50": 3.0}, "flag": True}]
    assert value_at(records[0], ("ttft", "p50")) == 1.0 and value_at(records[1], ("ttft", "p50")) is None
    assert value_at(records[2], ("flag",)) is None and value_at(records[0], ("ttft", "p50", "x")) is None
    got = spread(records, {"out": ("out",), "ttft_p50": ("ttft", "p50"), "none": ("missing",)})
    assert got["out"]["values"] == [10.0, 14.0] and got["ttft_p50"]["values"] == [1.0, 3.0]
    assert got["none"]["n"] == 0


def test_interval_text_prints_a_block_as_mean_interval_cv() -> None:
    assert interval_text(describe([])) == "-" and interval_text(describe([2.5])) == "2.5"
    b = describe([10.0, 12.0, 14.0])
    assert interval_text(b) == f"12 [{b['ci_low']:.3g}, {b['ci_high']:.3g}] 16.7%"
    assert interval_text(b, 4).startswith("12 [7.032, 16.97]")
    assert interval_text(describe([-1.0, 1.0])).endswith("]")  # zero mean: no cv
