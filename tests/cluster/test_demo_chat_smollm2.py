"""The demo's coding conversation on the real SmolLM2-135M-Instruct (slow, one engine for the
module): real code in the answers, cached tokens growing turn over turn, the named tool turn
a parsed run_tests call, and the agent APIs' second turns real text read mostly from cache."""

from __future__ import annotations

import json
import re

import pytest

from agentserve.cluster.demo_chat import Chat, agent_apis, coding_chat
from agentserve.cluster.procs import ManagedProcess

from tests.smollm2 import MARKS  # noqa: E402

pytestmark = MARKS


@pytest.fixture(scope="module")
def url(smollm2_engine: ManagedProcess) -> str:
    return smollm2_engine.url  # one engine for every SmolLM2 HTTP test (tests/conftest.py)


@pytest.fixture(scope="module")
def chat(url: str) -> Chat:
    return coding_chat(url, max_tokens=32)


def test_the_answers_are_real_code(chat: Chat) -> None:
    assert not chat.error, chat.error
    first = chat.turns[0].answer
    assert "def " in first and ("[::-1]" in first or "reverse" in first), first
    assert "->" in chat.turns[1].answer or '"""' in chat.turns[1].answer, chat.turns[1].answer


def test_cached_tokens_grow_turn_over_turn(chat: Chat) -> None:
    cached = [t.cached_tokens for t in chat.turns[:3]]
    assert cached[0] < cached[1] < cached[2], cached
    assert all(t.cached_tokens < t.prompt_tokens for t in chat.turns[:3])


def test_the_tool_turn_is_a_parsed_call_and_gets_an_answer(chat: Chat) -> None:
    call, final = chat.turns[3], chat.turns[4]
    m = re.fullmatch(r"run_tests\((.*)\)", call.call, re.DOTALL)
    assert m, call.call
    assert isinstance(json.loads(m[1])["path"], str)
    assert final.answer.strip() and "<tool_call>" not in final.answer
    assert final.cached_tokens > 0  # the tool result's turn resends the call's prompt


def test_agent_apis_show_real_text(url: str) -> None:
    line = agent_apis(url, max_tokens=24)
    assert line.startswith("agent APIs through the router"), line
    reads = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+)(?: prompt tokens)?,? ", line)]
    assert len(reads) == 2 and all(b / 2 < a < b for a, b in reads), line
    said = re.findall(r'said "([^"]*)"', line)
    assert len(said) == 2 and all(re.search(r"[A-Za-z]{3,} [A-Za-z]{2,}", s) for s in said), line
