"""The engine core's opt-in step trace (engine/steptrace.py) records what each step ran."""

from __future__ import annotations

import json

from agentserve.engine.engine import AsyncEngine
from agentserve.engine.request import SamplingParams
from agentserve.engine.sequence import Sequence
from agentserve.engine.steptrace import ENV


def test_steps_are_traced_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert AsyncEngine.from_args(kv_cache_tokens=2048).core.trace is None
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    eng = AsyncEngine.from_args(kv_cache_tokens=2048, max_num_batched_tokens=64)
    core = eng.core
    seq = Sequence("a", list(range(5, 105)), SamplingParams(max_tokens=3, temperature=0.0,
                                                             ignore_eos=True))
    core.seqs["a"] = seq
    core.scheduler.add(seq)
    for _ in range(20):
        if seq.num_output_tokens >= 3:
            break
        core.step([])
    core.trace.close()
    (path,) = tmp_path.glob("steps.*.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    # a 100-token prompt in chunks of 64 + 36, then two decodes (the first token came with
    # the prompt's last chunk) at contexts 101 and 102
    assert [(r["pre"], r["dec"]) for r in recs] == [([[64, 0]], []), ([[36, 64]], []),
                                                    ([], [101]), ([], [102])]
    assert all(r["exec_s"] > 0 and r["sched_s"] >= 0 and r["post_s"] >= 0 for r in recs)


def test_a_trace_that_cannot_be_written_turns_itself_off(tmp_path, caplog):
    from agentserve.engine.steptrace import StepTrace

    tr = StepTrace(str(tmp_path / "steps"))
    tr._f.close()  # as if the disk had gone away under it
    tr.record(0.0, 0.0, 0.001, 0.0, [5], [])  # no exception reaches the step
    assert tr._f is None and "step trace" in caplog.text
    tr.record(0.0, 0.0, 0.001, 0.0, [6], [])  # and later steps skip it
    tr.close()
