"""Statistics: hand-computed answers on small sessions, and the real 471-session sample."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentserve.workload.cli_trace import trace_app
from agentserve.workload.schema import Session, Subagent, TraceRequest
from agentserve.workload.stats import common_prefix_len, compute_stats, group_sizes, reuse_fractions

SAMPLE = Path("/work/shared/traces/weka-cc-sample.jsonl.gz")


def R(t, n_in, ids, out=10, api=None):
    return TraceRequest(t=t, input_tokens=n_in, output_tokens=out, hash_ids=ids, api_time=api)


def S(items, sid="s"):
    return Session(id=sid, block_size=10, items=items)


def sub(n):
    return Subagent(t=0.0, requests=[R(0.0, 10, [900 + k]) for k in range(n)])


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 6, 7]) == 4
    assert common_prefix_len([5], [1]) == 0 and common_prefix_len([], [1]) == 0


def test_growth_gap_turns_and_outputs():
    s = S([R(0.0, 100, [1] * 10, out=5, api=2.0), R(10.0, 150, [1] * 15, out=7),
           R(11.0, 120, [1] * 12, out=9, api=1.5)])
    st = compute_stats([s, S([R(0.0, 40, [7] * 4)], "t")])
    assert st["main_requests"] == 4 and st["turns_p50_p90_p99"][0] == 2.0
    # growth only within a session: +50, -30
    assert st["growth_p50_p90_p99"][0] == 10.0
    # gaps: 10 - 0 - 2 = 8; 11 - 10 - 0 (missing api_time) = 1  -> median 4.5
    assert st["gap_s_p50_p90_p99"][0] == 4.5
    assert st["output_p50_p90_p99"][0] == 8.0  # (5, 7, 9, 10) linear median


def test_gap_floored_at_zero():
    s = S([R(0.0, 10, [1], api=5.0), R(2.0, 10, [1])])
    assert compute_stats([s])["gap_s_p50_p90_p99"] == [0.0, 0.0, 0.0]


def test_reuse_window_of_eight_resets_and_cap():
    base = list(range(100))
    items = [R(0.0, 1000, base)]  # block_size 10: 100 blocks = 1000 tokens
    items += [R(float(i), 100, [500 + 10 * i + k for k in range(10)]) for i in range(1, 9)]
    items.append(R(9.0, 1000, base))  # 9 turns back: outside the window -> reuse 0
    items.append(R(10.0, 1000, base))  # previous request identical -> reuse 1
    items.append(R(11.0, 990, base[:99] + [7]))  # LCP 99 blocks = 990 tokens -> capped 1.0
    reuse = reuse_fractions(items, 10)
    assert reuse[:8] == [0.0] * 8 and reuse[8] == 0.0 and reuse[9] == 1.0 and reuse[10] == 1.0
    items2 = [R(0.0, 1000, base), R(1.0, 1000, [1]), R(2.0, 1000, base[:60] + [-1] * 40)]
    assert reuse_fractions(items2, 10) == [0.0, 0.6]  # best of the window, not just previous
    st = compute_stats([S(items2)])
    assert st["prefix_reset_share"] == 0.5 and st["share_turns_reuse_ge_90pct"] == 0.0
    assert st["median_reuse"] == pytest.approx(0.3)


def test_compaction():
    s = S([R(0.0, 600_000, [1]), R(1.0, 20_000, [2]), R(2.0, 25_000, [2]),
           R(3.0, 400_000, [2]), R(4.0, 10_000, [3])])
    assert compute_stats([s])["compaction_share"] == 0.25  # 600K -> 20K only


def test_subagent_groups():
    s = S([sub(2), R(0.0, 10, [1]), sub(3), sub(4), R(5.0, 20, [1, 2]), R(6.0, 20, [1, 2]),
           sub(1), Subagent(t=0.0, requests=[])])
    assert group_sizes(s) == [2, 7, 1]
    st = compute_stats([s])
    assert st["subagent_requests"] == 10 and st["subagent_groups"] == 3
    assert st["subagent_group_size_p50_p90"] == [2.0, 6.0]


def test_empty_corpus_is_json_safe():
    st = compute_stats([])
    assert st["input_p50_p90_p99"] is None and json.dumps(st)


def test_cli_json_one_object():
    mini = str(Path(__file__).parents[2] / "src/agentserve/data/traces/weka-cc-mini.jsonl")
    r = CliRunner().invoke(trace_app, ["stats", mini, "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)
    assert st["traces"] == 5 and st["subagent_groups"] == 2
    r = CliRunner().invoke(trace_app, ["stats", mini])
    assert r.exit_code == 0 and "input tokens per request" in r.stdout


@pytest.mark.skipif(not SAMPLE.exists(), reason="shared sample not present")
def test_real_sample_fast_and_sane():
    from agentserve.workload.traces import load_sessions

    t0 = time.process_time()  # CPU time: the 2 shared cores make wall time noisy
    st = compute_stats(load_sessions(SAMPLE).sessions)
    assert time.process_time() - t0 < 10.0
    assert st["traces"] == 471 and st["main_requests"] == 31_932 and st["subagent_requests"] == 425
    assert 50_000 < st["input_p50_p90_p99"][0] < 200_000
    assert 0.9 < st["share_turns_reuse_ge_90pct"] < 1.0 and st["median_reuse"] > 0.98
    assert 0.0 < st["prefix_reset_share"] < 0.05
