"""Synthesizer: determinism, the claude-code acceptance check against SPEC, sweep shape."""

from __future__ import annotations

import hashlib
import math
from functools import cache

import numpy as np
import pytest
from typer.testing import CliRunner

from agentserve.workload.cli_trace import trace_app
from agentserve.workload.stats import compute_stats
from agentserve.workload.synth import SPEC, SWEEP_TURNS, synthesize
from agentserve.workload.synth_dist import Spliced
from agentserve.workload.synth_session import pick_growth


def test_spliced_matches_quantiles():
    d = Spliced.fit([(0.5, 317), (0.9, 1705), (0.99, 7551)])
    assert np.allclose(d.ppf(np.array([0.5, 0.9, 0.99])), [317, 1705, 7551])


def _digest(tmp_path, seed, name):
    out = tmp_path / name
    r = CliRunner().invoke(trace_app, ["synth", "--profile", "claude-code", "--sessions", "3",
                                       "--seed", str(seed), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return hashlib.sha256(out.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b = _digest(tmp_path, 5, "a.jsonl"), _digest(tmp_path, 5, "b.jsonl")
    assert a == b and _digest(tmp_path, 6, "c.jsonl") != a


def _within(x, target, rel):
    return abs(x - target) <= rel * target


@cache
def _cc_stats(seed: int) -> dict:
    """Stats of a 219-session corpus (the study's size), synthesized in memory."""
    return compute_stats(synthesize("claude-code", 219, seed=seed))


@pytest.fixture(scope="module")
def cc_stats():
    return _cc_stats(1)


def _misses(st: dict) -> list[str]:
    m = []
    for key, spec in (("input_p50_p90_p99", "input"), ("output_p50_p90_p99", "output"),
                      ("growth_p50_p90_p99", "growth"), ("gap_s_p50_p90_p99", "gap"),
                      ("turns_p50_p90_p99", "turns")):
        for k in (0, 1):
            if not _within(st[key][k], SPEC[spec][k], 0.10):
                m.append(f"{key}[{k}]={st[key][k]:.0f} vs {SPEC[spec][k]}")
    if abs(st["share_turns_reuse_ge_90pct"] - 0.96) > 0.015:
        m.append(f"reuse>=90% {st['share_turns_reuse_ge_90pct']:.3f}")
    if abs(st["prefix_reset_share"] - 0.028) > 0.01:
        m.append(f"resets {st['prefix_reset_share']:.3f}")
    sub = st["subagent_requests"] / (st["subagent_requests"] + st["main_requests"])
    if abs(sub - 0.52) > 0.03:
        m.append(f"sub-agent share {sub:.3f}")
    for k, target in enumerate(SPEC["group"]):
        if not _within(st["subagent_group_size_p50_p90"][k], target, 0.15):
            m.append(f"group size[{k}] {st['subagent_group_size_p50_p90'][k]}")
    return m


def test_claude_code_shape_holds(cc_stats):
    """The parts of the acceptance check that the model meets today."""
    st = cc_stats
    assert st["traces"] == 219
    for key, spec in (("input_p50_p90_p99", "input"), ("output_p50_p90_p99", "output"),
                      ("growth_p50_p90_p99", "growth"), ("gap_s_p50_p90_p99", "gap"),
                      ("turns_p50_p90_p99", "turns")):
        assert _within(st[key][0], SPEC[spec][0], 0.10) and _within(st[key][1], SPEC[spec][1], 0.10)
    assert abs(st["prefix_reset_share"] - 0.028) <= 0.01
    assert st["compaction_share"] < 0.001
    assert st["input_p50_p90_p99"][2] < 1_000_000


@pytest.mark.parametrize("seed", [1, 2])
def test_claude_code_meets_spec_tolerances(seed):
    """WORKLOAD-1 acceptance: every tolerance of the SPEC table, for two seeds."""
    assert _misses(_cc_stats(seed)) == []


def test_pick_growth_bounds_growth_to_context():
    assert pick_growth([500, 10], 1000.0, big=False) == 500
    assert pick_growth([5000, 3000, 800], 1000.0, big=False) == 800  # first draw that fits
    assert pick_growth([5000, 3000], 1000.0, big=False) == 1000  # none fits: the bound
    assert pick_growth([5000, 800], 1000.0, big=True) == 5000  # a big turn is not bounded


def test_sweep_shape_and_max_input():
    sweep = synthesize("sweep", 120, seed=2)
    st = compute_stats(sweep)
    # turns per session as SWEEP_TURNS sets them; SPEC's "median input 47K-57K, p99 above
    # 347K" is over the stage AIPerf's replay sends from these sessions (tests/sim/test_lanes.py)
    turns = [len(s.main_requests) for s in sweep]
    assert _within(float(np.median(turns)), math.exp(SWEEP_TURNS[0]), 0.15)
    assert _within(st["output_p50_p90_p99"][0], 317, 0.10)
    lim = synthesize("sweep", 60, seed=2, max_input=142_000)
    ins = [r.input_tokens for s in lim for r in s.main_requests]
    ins += [r.input_tokens for s in lim for a in s.subagents for r in a.requests]
    assert max(ins) <= 142_000 and len(ins) > 1000
