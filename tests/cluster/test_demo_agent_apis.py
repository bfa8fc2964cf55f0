"""The demo's agent-API check (two turns in Claude Code's and Codex's APIs) against a real
engine: it reports the second turn's cache reads, and says so when the API fails."""

from __future__ import annotations

import re

from agentserve.cluster.demo import _agent_apis
from tests.conftest import TEST_DEVICE, ServerThread


def test_agent_api_check_reports_the_second_turns_cache_reads() -> None:
    server = ServerThread(model=None, kv_cache_tokens=8192, block_size=16, max_model_len=2048,
                          device=TEST_DEVICE).start()
    try:
        line = _agent_apis(server.url)
        assert _agent_apis("http://127.0.0.1:9").startswith("agent APIs failed")  # nobody there
    finally:
        server.close()
    reads = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+)", line)]
    assert line.startswith("agent APIs through the router") and len(reads) == 2, line
    assert all(0 < a < b for a, b in reads), line
