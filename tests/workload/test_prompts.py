"""Deterministic prompts, token scaling, reuse ceiling, request bodies."""

from __future__ import annotations

import numpy as np
import pytest

from agentserve.workload.chatfit import MIN_WORDS, ChatFit, fit_chat
from agentserve.workload.prompts import PromptBuilder, ReuseTracker, scaled_length
from agentserve.workload.replay_plan import Job, RequestFactory
from agentserve.workload.schema import TraceRequest


def test_equal_ids_equal_tokens_and_prefix_survives() -> None:
    pb = PromptBuilder(vocab_size=4000, seed=1)
    a = pb.tokens("s1", [1, 2, 3], 12, 4)
    b = pb.tokens("s1", [1, 2, 9], 12, 4)
    assert a == PromptBuilder(vocab_size=4000, seed=1).tokens("s1", [1, 2, 3], 12, 4)  # no hidden state
    assert a[:8] == b[:8] and a[8:] != b[8:]
    assert len(a) == 12


def test_scope_and_seed_change_tokens() -> None:
    pb = PromptBuilder(seed=0)
    assert pb.tokens("s1", [1, 2], 8, 4) != pb.tokens("s2", [1, 2], 8, 4)
    assert pb.tokens("s1", [1, 2], 8, 4) != PromptBuilder(seed=5).tokens("s1", [1, 2], 8, 4)


def test_safe_range_exact_length_and_padding() -> None:
    pb = PromptBuilder(vocab_size=100)
    toks = np.array(pb.tokens("s", list(range(50)), 190, 4))
    assert toks.size == 190 and toks.min() >= 16 and toks.max() < 100 - 16
    # Cut inside the last block: the prefix equals the full prompt's prefix.
    assert pb.tokens("s", [7, 8], 6, 4) == pb.tokens("s", [7, 8], 8, 4)[:6]
    # More tokens than blocks: padded, and the padding differs per uid (never shared).
    p1, p2 = pb.tokens("s", [7], 10, 4, uid="r1"), pb.tokens("s", [7], 10, 4, uid="r2")
    assert len(p1) == 10 and p1[:4] == p2[:4] and p1[4:] != p2[4:]
    with pytest.raises(ValueError):
        PromptBuilder(vocab_size=20)


def test_token_scale_math() -> None:
    assert scaled_length(71175, 64, 64) == 71175  # no scaling is exact
    assert scaled_length(71175, 64, 4) == 4448  # 71175 * 4 / 64 = 4448.4
    assert scaled_length(10, 64, 4) == 1  # never zero
    assert scaled_length(6758, 512, 16) == 211


def test_text_prompts_deterministic() -> None:
    pb = PromptBuilder()
    fit = ChatFit(np.array([f" w{i}" for i in range(100)], dtype=object), overhead=2)
    t1 = pb.text(fit, "s", [1, 2, 3], 14, 4)  # 12 words + the template's 2 tokens
    assert t1 == pb.text(fit, "s", [1, 2, 3], 14, 4) and len(t1.split()) == 12
    assert t1.split()[:8] == pb.text(fit, "s", [1, 2, 5], 14, 4).split()[:8]
    assert t1.split()[8:] != pb.text(fit, "s", [1, 2, 5], 14, 4).split()[8:]


def test_reuse_tracker_longest_shared_prefix() -> None:
    rt = ReuseTracker()
    assert rt.observe("s", [1, 2, 3], 12, 4) == 0
    assert rt.observe("s", [1, 2, 3, 4], 16, 4) == 12  # whole earlier prompt
    assert rt.observe("s", [1, 2, 5], 12, 4) == 8  # diverges at block 3
    assert rt.observe("t", [1, 2, 3], 12, 4) == 0  # other scope
    assert rt.observe("s", [9, 1, 2], 12, 4) == 0  # not a prefix
    # An earlier prompt cut inside its last block shares only what it sent.
    rt2 = ReuseTracker()
    rt2.observe("s", [1, 2], 6, 4)
    assert rt2.observe("s", [1, 2, 3], 12, 4) == 6
    assert rt2.observe("s", [1, 2], 5, 4) == 5  # capped by this request's own length


def _job(n_in: int, out: int = 100, hids: list[int] | None = None) -> Job:
    req = TraceRequest(t=0, input_tokens=n_in, output_tokens=out, hash_ids=hids or list(range(-(-n_in // 64))))
    return Job("sess", "sess", 64, req, turn=0)


def test_factory_admission_caps_and_body() -> None:
    f = RequestFactory("m", token_scale=4, max_input=100, max_output=50, output_scale=0.5)
    assert not f.admit(_job(64 * 30)) and f.skipped == 1  # 120 scaled tokens > 100
    job = _job(64 * 10 + 5, out=300)
    assert f.admit(job)
    rec, body = f.build(job)
    assert rec.input_tokens == 40 and len(body["prompt"]) == 40  # round(645 * 4 / 64)
    assert body["max_tokens"] == 50 and rec.max_tokens == 50  # 300 * 0.5 capped at 50
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and rec.session_id == "sess" and rec.agent == "main"
    rec2, body2 = f.build(job)
    assert body2["prompt"] == body["prompt"] and rec2.reusable_tokens == 40
    fit = ChatFit(np.array([" ab", " cd", " ef"], dtype=object), overhead=7)
    chat = RequestFactory("m", api="chat", token_scale=4, chat_fit=fit)
    crec, cb = chat.build(job)
    # 40 served tokens: 33 words of content plus the template's 7
    assert len(cb["messages"][0]["content"].split()) == 33 and "prompt" not in cb
    assert crec.requested_input_tokens == 40
    with pytest.raises(ValueError, match="tokenizer"):
        RequestFactory("m", api="chat")


class _SpaceTokens:
    """A tokenizer stand-in: a word is one token if it has an 'a' in it, else one per letter;
    the chat template adds 5 tokens."""

    async def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for w in text.split(" ")[1:]:
            out += [" " + w] if "a" in w else [" " + w[0], *w[1:]]
        return out

    async def chat_count(self, messages: list[dict]) -> int:
        return 5 + len(await self.pieces(messages[0]["content"]))


async def test_fit_keeps_one_token_words_and_measures_overhead() -> None:
    fit = await fit_chat(_SpaceTokens())
    assert fit.overhead == 5 and len(fit.words) > MIN_WORDS
    assert all("a" in w and w.startswith(" ") for w in fit.words)
    text = fit.text(np.arange(50))
    assert await _SpaceTokens().chat_count([{"role": "user", "content": text}]) == 55


async def test_fit_refuses_a_tokenizer_that_merges_words() -> None:
    class Merging(_SpaceTokens):
        async def chat_count(self, messages: list[dict]) -> int:
            return 5 + len(messages[0]["content"]) // 9  # not one token per word

    with pytest.raises(RuntimeError, match="merges"):
        await fit_chat(Merging())
