"""Loaders and writers: Weka and mooncake, gzip/plain, folders, bad lines, round trips."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentserve.workload.cli_trace import trace_app
from agentserve.workload.schema import Subagent
from agentserve.workload.traces import (
    TraceFormatError, load_any, load_mooncake, load_sessions, mooncake_to_sessions, reblock,
    sessions_to_mooncake, write_mooncake, write_sessions,
)

MINI = Path(str(resources.files("agentserve") / "data/traces/weka-cc-mini.jsonl"))


def _session(sid="s1", extra_field=True):
    reqs = [{"t": 0.0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2, 3], "api_time": 1.0,
             "input_types": ["text"]},
            {"t": 3.0, "type": "s", "in": 200, "out": 7, "hash_ids": [1, 2, 4, 5], "ttft": 0.2},
            {"t": 9.0, "type": "subagent", "agent_id": "a1", "duration_ms": 1500, "tool_use_count": 2,
             "requests": [{"t": 0.0, "type": "n", "in": 64, "out": 3, "hash_ids": [9]},
                          {"t": 1.0, "type": "n", "in": 100, "out": 3, "hash_ids": [9, 10]}]},
            {"t": 12.0, "type": "n", "in": 256, "out": 1, "hash_ids": [1, 2, 4, 6]}]
    d = {"id": sid, "block_size": 64, "hash_id_scope": "local", "requests": reqs}
    if extra_field:
        d["tool_tokens"] = 11
    return d


def _write(path: Path, objs: list, gz: bool = False) -> Path:
    data = "".join(json.dumps(o) + "\n" for o in objs).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_weka_fields_subagents_and_extra(tmp_path):
    s = load_sessions(_write(tmp_path / "a.jsonl", [_session()])).sessions[0]
    assert (s.id, s.block_size, s.extra) == ("s1", 64, {"tool_tokens": 11})
    main = s.main_requests
    assert [r.input_tokens for r in main] == [130, 200, 256]
    assert main[1].hash_ids == [1, 2, 4, 5] and main[1].kind == "s" and main[1].ttft == 0.2
    assert main[0].extra == {"input_types": ["text"]} and main[0].api_time == 1.0
    sub = s.items[2]
    assert isinstance(sub, Subagent) and sub.t == 9.0 and sub.extra == {"tool_use_count": 2}
    assert [r.t for r in sub.requests] == [0.0, 1.0] and sub.requests[1].hash_ids == [9, 10]


def test_gzip_folder_and_json_files(tmp_path):
    _write(tmp_path / "x.jsonl.gz", [_session("g1"), _session("g2")], gz=True)
    (tmp_path / "y.json").write_text(json.dumps(_session("j1"), indent=2))
    (tmp_path / "notes.txt").write_text("ignored")
    assert [s.id for s in load_sessions(tmp_path).sessions] == ["g1", "g2", "j1"]


def test_prefix_fast_path_matches_plain_decode(tmp_path):
    d = _session()
    d["requests"][1]["hash_ids"] = [1, 2, 3, 7, 8]  # extends the previous list
    d["requests"][3]["hash_ids"] = [1, 2, 3, 7, 11]  # partial last block rewritten
    s = load_sessions(_write(tmp_path / "a.jsonl", [d])).sessions[0]
    assert [r.hash_ids for r in s.main_requests] == [[1, 2, 3], [1, 2, 3, 7, 8], [1, 2, 3, 7, 11]]


def test_malformed_line_reports_file_line_reason(tmp_path):
    bad = _session("b")
    bad["requests"][1]["in"] = "lots"
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps(_session()) + "\n" + json.dumps(bad) + "\n{not json\n")
    with pytest.raises(TraceFormatError) as e:
        load_sessions(p)
    assert e.value.line == 2 and str(p) in str(e.value) and "requests[1]" in e.value.reason
    res = load_sessions(p, skip_bad=True)
    assert len(res.sessions) == 1 and res.skipped == 2 and ":3:" in res.errors[1]


def test_weka_round_trip(tmp_path):
    src = load_sessions(MINI).sessions
    write_sessions(src, tmp_path / "w.jsonl.gz")
    back = load_sessions(tmp_path / "w.jsonl.gz").sessions
    assert back == src


def test_mooncake_load_group_and_convert(tmp_path):
    recs = [{"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1],
             "session_id": "a"},
            {"timestamp": 1500, "input_length": 10, "output_length": 5, "hash_ids": [7]},
            {"timestamp": 4000, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2],
             "session_id": "a", "delay": 2500}]
    p = _write(tmp_path / "m.jsonl", recs)
    loaded = load_mooncake(p)
    assert len(loaded) == 3 and loaded[2].delay == 2500
    sessions = mooncake_to_sessions(loaded, 512)
    assert [(s.id, len(s.items)) for s in sessions] == [("a", 2), ("mc-000001", 1)]
    assert sessions[0].items[1].t == 3.0 and sessions[0].hash_id_scope == "global"
    write_mooncake(sessions, tmp_path / "out.jsonl", block_size=512)
    again = load_mooncake(tmp_path / "out.jsonl")
    assert [(r.timestamp, r.session_id, r.input_length) for r in again] == \
        [(1000, "a", 1000), (1500, None, 10), (4000, "a", 1500)]
    assert again[2].delay == 3000  # no api_time in mooncake: the whole spacing is idle
    assert again[2].hash_ids[:2] == again[0].hash_ids  # equal source ids stay equal
    assert again[1].hash_ids[0] not in again[2].hash_ids
    assert load_any(p).sessions[0].id == "a"


def test_mooncake_too_many_ids_is_clear(tmp_path):
    p = _write(tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 600, "output_length": 1,
                                       "hash_ids": [1, 2, 3]}])
    with pytest.raises(TraceFormatError, match="wrong --block-size"):
        load_mooncake(p, block_size=512)


def test_reblock_keeps_prefix_structure():
    table: dict = {}
    a = reblock(list(range(16)), 16 * 64, 64, 512, table)
    b = reblock(list(range(12)) + [99, 98, 97, 96], 16 * 64, 64, 512, table)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    fine = reblock([5, 6], 1000, 512, 64, {})
    assert len(fine) == 16 and len(set(fine)) == 16


def test_weka_to_mooncake_to_weka_sample(tmp_path):
    src = load_sessions(MINI).sessions
    recs = sessions_to_mooncake(src, 512)
    n_req = sum(len(s.main_requests) + sum(len(a.requests) for a in s.subagents) for s in src)
    assert len(recs) == n_req
    assert all(len(r.hash_ids) <= -(-r.input_length // 512) for r in recs)
    runner = CliRunner()
    r = runner.invoke(trace_app, ["convert", str(MINI), str(tmp_path / "m.jsonl.gz")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(trace_app, ["convert", str(tmp_path / "m.jsonl.gz"), str(tmp_path / "w.jsonl"),
                                  "--to", "weka"])
    assert r.exit_code == 0, r.output
    back = load_sessions(tmp_path / "w.jsonl").sessions
    mains = {s.id: [(q.input_tokens, q.output_tokens) for q in s.main_requests] for s in back}
    for s in src:
        assert mains[s.id] == [(q.input_tokens, q.output_tokens) for q in s.main_requests]


@pytest.mark.parametrize("args, message", [
    (["synth", "--sessions", "0", "--out", "OUT"], "--sessions must be >= 1"),
    (["synth", "--profile", "sweep", "--sessions", "2", "--max-input", "-5", "--out", "OUT"],
     "--max-input must be >= 1"),
    (["synth", "--sessions", "1", "--out", "/proc/no/such/dir/s.jsonl"], "cannot write"),
    (["stats", "IN", "--block-size", "0"], "--block-size must be >= 1"),
    (["convert", "IN", "/proc/no/such/dir/x.jsonl"], "cannot write"),
])
def test_cli_bad_flags_and_unwritable_outputs_are_one_line_errors(tmp_path, args, message) -> None:
    trace = Path(str(resources.files("agentserve.data") / "traces" / "weka-cc-mini.jsonl"))
    args = [str(trace) if a == "IN" else str(tmp_path / "s.jsonl") if a == "OUT" else a
            for a in args]
    res = CliRunner().invoke(trace_app, args)
    assert res.exit_code == 2 and message in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
