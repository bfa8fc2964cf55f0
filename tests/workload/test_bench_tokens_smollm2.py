"""Bench prompts of the asked size on the real SmolLM2-135M (49,152-token English BPE, its
own chat template with a default system prompt): served `usage.prompt_tokens` = requested
for completions and chat, the chat prompts sized by the engine's /tokenize and by the GGUF
as a local --tokenizer. One engine for the module."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentserve.cluster.procs import ManagedProcess
from agentserve.workload.replay import BenchConfig, BenchRun

from tests.smollm2 import MARKS, SMOLLM2  # noqa: E402
from tests.workload.test_bench_tokens import trace

pytestmark = MARKS


@pytest.fixture(scope="module")
def engine(smollm2_engine: ManagedProcess) -> ManagedProcess:
    return smollm2_engine  # one engine for every SmolLM2 HTTP test (tests/conftest.py)


@pytest.mark.parametrize("api,local", [("completions", False), ("chat", False), ("chat", True)])
async def test_served_equals_requested(engine: ManagedProcess, tmp_path: Path, api: str,
                                       local: bool) -> None:
    c = BenchConfig(url=engine.url, trace_sessions=trace(([60, 150], [250])), mode="sessions", sessions=2,
                    gap_scale=0.0, api=api, tokenizer=str(SMOLLM2) if local else None,
                    vocab_size=49152, out=str(tmp_path / "out"), progress=False, plots=False)
    r = BenchRun(c)
    await r.run()
    assert len(r.records) == 3 and all(x.ok for x in r.records), [x.error for x in r.records]
    for x in r.records:
        assert abs(x.input_tokens - x.requested_input_tokens) <= 0.01 * x.requested_input_tokens
    assert r.stages[0]["served_input_ratio"] == pytest.approx(1.0, abs=0.01)
