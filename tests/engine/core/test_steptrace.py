"""The engine core's opt-in step trace (engine/core/steptrace.py) records what each step ran."""

from __future__ import annotations

import json

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.core.sequence import Sequence
from agentserve.engine.core.steptrace import ENV


def test_steps_are_traced_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert AsyncEngine.from_args(kv_cache_tokens=2048).core.trace is None
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    eng = AsyncEngine.from_args(kv_cache_tokens=2048, max_num_batched_tokens=64,
                                long_prefill_token_threshold=0)  # chunks: the whole budget
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
    from agentserve.engine.core.steptrace import StepTrace

    tr = StepTrace(str(tmp_path / "steps"))
    tr._f.close()  # as if the disk had gone away under it
    tr.record(0.0, 0.0, 0.001, 0.0, [5], [])  # no exception reaches the step
    assert tr._f is None and "step trace" in caplog.text
    tr.record(0.0, 0.0, 0.001, 0.0, [6], [])  # and later steps skip it
    tr.close()


def test_the_request_trace_stamps_each_request_in_order(tmp_path, monkeypatch):
    """With the trace on, a real server writes each request's path to its first token: the
    core's line and the API thread's, joined by id, on one clock, in the order they happen."""
    import time

    import openai

    from tests.conftest import ServerThread

    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    t_before = time.perf_counter()
    server = ServerThread(kv_cache_tokens=4096, block_size=16, max_model_len=1024,
                          max_num_batched_tokens=64).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        prompt = list(range(20, 120))  # 100 tokens: two chunks of the 64-token budget
        for rid in ("one", "two"):  # the second hits the first's cached blocks
            stream = client.completions.create(model=server.engine.model_name, prompt=prompt,
                                               max_tokens=3, stream=True,
                                               extra_headers={"X-Request-Id": rid})
            assert len([c for c in stream]) >= 1
    finally:
        server.close()
    t_after = time.perf_counter()
    (path,) = tmp_path.glob("steps-requests.*.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    core = {r["core"]: r for r in recs if "core" in r}
    api = {r["api"]: r for r in recs if "api" in r}
    assert set(core) == set(api) and len(core) == 2  # engine ids: cmpl-<header>-<suffix>-0
    for rid in core:
        c, a = core[rid], api[rid]
        assert c["n"] == 100
        assert t_before < a["recv"] <= c["sub"] <= c["adm"] <= c["sched"] < c["tok"] <= a["first"] < t_after
    first, second = sorted(core.values(), key=lambda r: r["sub"])
    assert "-one-" in first["core"] and "-two-" in second["core"]
    assert first["hit"] == 0 and second["hit"] == 96  # six whole 16-token blocks
    # the steps' own file is untouched by the request records
    assert all("core" not in line and "api" not in line
               for f in tmp_path.glob("steps.*.jsonl") for line in f.read_text().splitlines())
