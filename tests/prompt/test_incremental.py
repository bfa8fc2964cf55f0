"""Incremental tokenization equals full tokenization, and tokenizes only the new part."""

import random

import pytest

from agentserve.engine.model.tiny import default_model_dir
from agentserve.prompt.tokenizer import Tokenizer
from agentserve.prompt.incremental import IncrementalTokenizer, common_prefix_len


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(default_model_dir())


def test_common_prefix_len():
    a = "x" * 20000 + "abc"
    assert common_prefix_len(a, a + "d") == len(a)
    assert common_prefix_len(a, "x" * 20000 + "abd") == 20002
    assert common_prefix_len("", "a") == 0
    from agentserve.prompt.segments import Rope
    r = Rope(["x" * 20000, "abc"])
    assert common_prefix_len(r, Rope(["x" * 20000, "abd"]), lo=19990) == 20002
    assert common_prefix_len(r, "x" * 20000 + "abc!", lo=5) == len(r)
    assert common_prefix_len(Rope(["ab"]), "abc", lo=7) == 2  # lo past the end: clamped


def test_self_check_passes_for_byte_level_bpe(tok):
    assert IncrementalTokenizer(tok).incremental


def test_chat_turns_match_full_and_are_incremental(tok):
    it = IncrementalTokenizer(tok)
    rng = random.Random(0)
    words = ["def", "return", "  x", "\n", "é", "😀", "import os", "{", "}", "<|im_end|>", "tool"]
    msgs = [{"role": "system", "content": "You are a coding agent. " * 50}]
    for turn in range(8):
        msgs.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(80))})
        t = it.chat(msgs)
        full = tok.encode(tok.apply_chat_template(msgs))
        assert list(t.ids) == full, turn
        if turn:
            assert t.base is not None and t.shared > len(full) // 2
        msgs.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(30))})
    before = it.tokenized_chars
    msgs.append({"role": "user", "content": "short"})
    it.chat(msgs)
    assert it.tokenized_chars - before < 1000


def test_text_prompt_edits(tok):
    it = IncrementalTokenizer(tok)
    rng = random.Random(1)
    text = "".join(rng.choice("ab cd\nef(){}é😀") for _ in range(3000))
    for _ in range(20):
        i = rng.randrange(len(text))
        text = text[:i] + rng.choice(["x", " ", "\n\n", "é", ""]) + text[i:] + " tail"
        t = it.text(text, add_special_tokens=False, session="s")
        assert list(t.ids) == tok.encode(text)


def _agent_turns(rng, n_turns):
    """Chat turns shaped like an agent's: assistant tool calls, tool results, user text."""
    words = ["def", "return", "  x", "\n", "é", "😀", "import os", "{", "}", "tool", "ok"]
    msgs = [{"role": "system", "content": "You are a coding agent. " * 20}]
    for turn in range(n_turns):
        kind = rng.choice(["user", "tools", "tools", "assistant_user"])
        if kind == "user":
            msgs.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(40))})
        elif kind == "tools":
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "read", "arguments": {"path": f"f{turn}.py"}}}]})
            for _ in range(rng.randrange(1, 4)):
                msgs.append({"role": "tool", "content": " ".join(rng.choice(words)
                                                                 for _ in range(30))})
        else:
            msgs.append({"role": "assistant", "content": "done " * rng.randrange(1, 9)})
            msgs.append({"role": "user", "content": "next " * rng.randrange(1, 9)})
        yield msgs


@pytest.mark.parametrize("agp", [True, False])
def test_incremental_render_equals_full_render(tok, agp):
    it = IncrementalTokenizer(tok)
    tools = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    for turn, msgs in enumerate(_agent_turns(random.Random(2), 40)):
        t = it.chat(msgs, tools=tools if turn % 2 else None, add_generation_prompt=agp)
        t = it.chat(msgs, tools=tools if turn % 2 else None, add_generation_prompt=agp)
        text = tok.apply_chat_template(msgs, tools=tools if turn % 2 else None,
                                       add_generation_prompt=agp)
        assert t.entry.text == text, turn
        assert list(t.ids) == tok.encode(text), turn
    assert it.incremental_render
    assert it.renders["incremental"] > 20


def test_incremental_render_skips_the_whole_conversation(tok):
    it = IncrementalTokenizer(tok)
    msgs = [{"role": "system", "content": "sys"}]
    for i in range(200):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " * 20})
    it.chat(msgs)
    rendered = []
    real = it._render
    it._render = lambda m, tools, agp: rendered.append(len(m)) or real(m, tools, agp)
    for _ in range(6):
        msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        t = it.chat(msgs)
        assert t.entry.text == tok.apply_chat_template(msgs)
    # one full verification per role pattern of the window, else windows of a few messages
    big = [n for n in rendered if n > 6]
    assert len(big) == it.renders["verified"] <= 2
    assert it.renders["incremental"] == 6 and it.renders["fallback"] == 0


def test_non_append_only_template_falls_back(tok):
    import copy

    from agentserve.prompt.tokenizer import compile_chat_template

    bad = copy.copy(tok)
    bad._template = compile_chat_template(
        "{{ messages|length }}:{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    it = IncrementalTokenizer(bad)
    msgs = [{"role": "system", "content": "s"}]
    for i in range(12):
        msgs = msgs + [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": "a"}]
        t = it.chat(msgs)
        assert t.entry.text == bad.apply_chat_template(msgs)
    assert it.renders["fallback"] >= 1


def test_split_tool_group_falls_back(tok):
    """A tool result group split across turns is not append-only (the group closes)."""
    it = IncrementalTokenizer(tok)
    msgs = [{"role": "system", "content": "s"}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": "a"}]
    msgs += [{"role": "tool", "content": "r1"}]
    it.chat(msgs)
    msgs = msgs + [{"role": "tool", "content": "r2"}, {"role": "user", "content": "go"}]
    t = it.chat(msgs)
    assert t.entry.text == tok.apply_chat_template(msgs)
    assert it.renders["fallback"] == 1 and it.incremental_render


def test_seq_shares_segments_and_behaves_like_an_array():
    from array import array
    from bisect import bisect_right

    from agentserve.prompt.segments import Seq

    rng = random.Random(3)
    ref = sorted(rng.randrange(1000) for _ in range(50))
    seq = Seq([array("i", ref)])
    for _ in range(200):  # keep a prefix, append a tail, as turns do
        k = rng.randrange(len(ref) + 1)
        tail = sorted(rng.randrange(ref[k - 1] if k else 0, 5000) for _ in range(rng.randrange(0, 9)))
        ref = ref[:k] + tail
        seq = seq.prefix_plus(k, array("i", tail))
        assert len(seq) == len(ref) and seq.tolist() == ref and list(seq) == ref
        assert len(seq.segs) <= Seq.max_segments
        a, b = sorted(rng.randrange(len(ref) + 1) for _ in range(2))
        assert seq[a:b].tolist() == ref[a:b]
        if ref:
            i = rng.randrange(len(ref))
            assert seq[i] == ref[i] and seq[-1] == ref[-1]
        x = rng.randrange(5001)
        assert seq.bisect_right(x) == bisect_right(ref, x)


def test_rope_slices_and_shares_segments():
    from agentserve.prompt.segments import Rope
    a = Rope(["hello ", "world"])
    assert len(a) == 11 and str(a) == "hello world" and a[3:8] == "lo wo" and a[6:] == "world"
    for suffix, start, end in [("lo wo", 0, 8), ("lo w", 0, 8), ("world", 0, None),
                               ("hello world!", 0, 11), ("hello", 1, 5), ("hello", 0, 5)]:
        assert a.endswith(suffix, start, end) == "hello world".endswith(suffix, start, end)
    b = a.prefix_plus(8, "rd!")
    assert str(b) == "hello word!" and b.segs[0] is a.segs[0]
    assert a == "hello world" and b != a
    with pytest.raises(TypeError):
        a[::2]
    r = Rope(["x"])
    for i in range(200):  # compacted past max_segments: still the same text
        r = r.prefix_plus(len(r), str(i % 10))
    assert len(r.segs) <= Rope.max_segments + 1
    assert str(r) == "x" + "".join(str(i % 10) for i in range(200))


def test_chat_body_is_the_rendering_without_the_generation_prompt(tok):
    """The incremental renderer derives the body from the head's generation prompt; it
    must equal a real render without one, turn after turn."""
    it = IncrementalTokenizer(tok)
    for turn, msgs in enumerate(_agent_turns(random.Random(5), 30)):
        t = it.chat(msgs)
        assert t.entry.body == len(tok.apply_chat_template(msgs, add_generation_prompt=False))
    assert it.renders["incremental"] > 15 and it._derive_body
