"""The demo's conversations (cluster/demo_chat.py) against a real engine on the tiny model:
the agent-API line reports each second turn's cache reads, the coding chat resends its
history (cached tokens grow) and its named tool turn gives a parsed call; failures are
values that say so."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from agentserve.cluster.demo_chat import QUESTIONS, agent_apis, coding_chat
from tests.conftest import TEST_DEVICE, ServerThread


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ServerThread(model=None, kv_cache_tokens=8192, block_size=16, max_model_len=2048,
                          device=TEST_DEVICE).start()
    try:
        yield server.url
    finally:
        server.close()


def test_agent_api_check_reports_the_second_turns_cache_reads(url: str) -> None:
    line = agent_apis(url, max_tokens=8)
    assert agent_apis("http://127.0.0.1:9").startswith("agent APIs failed")  # nobody there
    reads = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+)(?: prompt tokens)?,? ", line)]
    assert line.startswith("agent APIs through the router") and len(reads) == 2, line
    assert all(0 < a < b for a, b in reads), line
    assert line.count("said ") == 2, line


def test_coding_chat_resends_history_and_parses_the_tool_call(url: str) -> None:
    chat = coding_chat(url, max_tokens=8)
    assert not chat.error, chat.error
    asks = [t.ask for t in chat.turns]
    assert asks[:3] == list(QUESTIONS) and len(chat.turns) == 5
    prompts = [t.prompt_tokens for t in chat.turns]
    assert prompts == sorted(prompts) and len(set(prompts)) == 5  # the history only grows
    cached = [t.cached_tokens for t in chat.turns[:3]]
    assert cached[0] < cached[1] < cached[2], cached  # each turn reads the last one's prefix
    name, _, args = chat.turns[3].call.partition("(")
    assert name == "run_tests" and isinstance(json.loads(args[:-1]), dict), chat.turns[3].call
    assert not coding_chat("http://127.0.0.1:9").turns and coding_chat("http://127.0.0.1:9").error
