"""Bench prompts of the asked size, served by the real engine on the tiny model: the server's
`usage.prompt_tokens` equals the requested length for completions (token ids) and chat (words
fitted to the served tokenizer, by its /tokenize or a local --tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentserve.engine.model.tiny import default_model_dir
from agentserve.workload.replay import BenchConfig, BenchRun
from agentserve.workload.schema import Session, TraceRequest

from tests.conftest import API_KEY, ServerThread


def trace(turns: tuple[list[int], ...] = ([40, 200, 333], [512, 600]),
          block: int = 16) -> list[Session]:
    """A session per list of turn lengths; a session's turns share their prefix (hash ids
    grow by turn)."""
    out = []
    for s, lens in enumerate(turns):
        items = [TraceRequest(t=0.0, input_tokens=n, output_tokens=2,
                              hash_ids=list(range(-(-n // block)))) for n in lens]
        out.append(Session(f"s{s}", block, items))
    return out


async def bench(served: ServerThread, tmp_path: Path, **kw) -> BenchRun:
    c = BenchConfig(url=served.url, api_key=API_KEY, trace_sessions=trace(), mode="sessions",
                    sessions=2, gap_scale=0.0, out=str(tmp_path / "out"), progress=False,
                    plots=False, **kw)
    r = BenchRun(c)
    await r.run()
    return r


@pytest.mark.parametrize("api,tokenizer", [("completions", None), ("chat", None),
                                           ("chat", "local")])
async def test_served_equals_requested(served: ServerThread, tmp_path: Path, api: str,
                                       tokenizer: str | None) -> None:
    tok = str(default_model_dir()) if tokenizer else None
    r = await bench(served, tmp_path, api=api, tokenizer=tok)
    assert len(r.records) == 5 and all(x.ok for x in r.records), [x.error for x in r.records]
    for x in r.records:  # input_tokens is the server's usage.prompt_tokens
        assert abs(x.input_tokens - x.requested_input_tokens) <= 0.01 * x.requested_input_tokens
    st = r.stages[0]
    assert st["requested_input_tokens"] == 40 + 200 + 333 + 512 + 600
    assert st["served_input_ratio"] == pytest.approx(1.0, abs=0.01)
    if api == "chat":  # the turns of a session share their prefix, so the cache serves it
        assert st["cached_tokens"] > 0

