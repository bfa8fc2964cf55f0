"""Tokenizer loading, chat templates and the incremental detokenizer."""

from __future__ import annotations

import pytest

from agentserve.prompt.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["hello world", "héllo naïve café", "日本語のテキスト 🙂🚀", "a🙂b🚀c 日本"]


def stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[str, bool]:
    """Push ids in chunks; return all emitted text and whether a stop fired."""
    out, stopped = "", False
    for i in range(0, len(ids), chunk):
        delta, stopped = det.push(ids[i:i + chunk])
        assert "\ufffd" not in delta
        out += delta
        if stopped:
            return out, True
    return out + det.flush(), False


def test_load_and_roundtrip(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size > 256
    assert tokenizer.token_id("<|im_end|>") in tokenizer.eos_token_ids
    assert 0 in tokenizer.eos_token_ids  # from generation_config.json
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_skipped_but_tool_markers_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>hi<tool_call>x</tool_call><|im_end|>")
    assert tokenizer.token_id("<|im_start|>") in ids  # literal specials are parsed
    assert tokenizer.decode(ids) == "hi<tool_call>x</tool_call>"
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>hi")


def test_chat_template(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(msgs)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert '"name": "f"' in tokenizer.apply_chat_template(msgs, tools=tools)


def test_chat_template_errors_are_values(tokenizer: Tokenizer) -> None:
    bad = Tokenizer(tokenizer.hf, {"chat_template": "{{ raise_exception('no system') }}"})
    with pytest.raises(ValueError, match="no system"):
        bad.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(tokenizer.hf, {}).apply_chat_template([])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_matches_full_decode(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    prompt = tokenizer.encode("the quick brown fox")
    ids = tokenizer.encode(text)
    out, stopped = stream(IncrementalDetokenizer(tokenizer, prompt), ids, chunk)
    assert not stopped and out == text


def test_bytes_split_across_tokens_never_leak(tokenizer: Tokenizer) -> None:
    # Byte-level tokens for one emoji: each alone decodes to U+FFFD.
    ids = [tokenizer.token_id(c) for c in "ðŁĻĤ"]  # GPT-2 byte chars of U+1F642
    assert all(i is not None for i in ids)
    det = IncrementalDetokenizer(tokenizer)
    deltas = [det.push([i])[0] for i in ids]
    assert deltas == ["", "", "", "🙂"]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_chunks(tokenizer: Tokenizer, chunk: int) -> None:
    ids = tokenizer.encode("hello world STOP the lazy dog")
    det = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    out, stopped = stream(det, ids, chunk)
    assert stopped and out == "hello world "


def test_stop_prefix_is_released_when_no_stop(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello ST")
    det = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    emitted = "".join(det.push([i])[0] for i in ids)
    assert emitted == "hello "  # "ST" may still become "STOP"
    assert det.flush() == "ST"
    assert det.text == "hello ST"


def test_earliest_of_several_stops_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the lazy dog end.")
    out, stopped = stream(IncrementalDetokenizer(tokenizer, stop=["end", "lazy"]), ids)
    assert stopped and out == "the "


def test_extra_skip_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello")
    det = IncrementalDetokenizer(tokenizer, skip_ids={ids[-1]})
    out, _ = stream(det, ids)
    assert out == tokenizer.decode(ids[:-1])


def test_tiny_model_tokenizer(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    assert tok.token_id("<|im_end|>") in tok.eos_token_ids
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
        out, _ = stream(IncrementalDetokenizer(tok, tok.encode("hi")), tok.encode(text))
        assert out == text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert prompt.endswith("<|im_start|>assistant\n") and '"name": "f"' in prompt
    ids = tok.encode("<tool_call>{}</tool_call>")
    assert tok.decode(ids) == "<tool_call>{}</tool_call>"  # markers survive skip_special


def test_a_run_of_invalid_bytes_streams_out_and_stays_linear(tiny_tokenizer: Tokenizer) -> None:
    """A weak model can emit hundreds of tokens that are lone UTF-8 continuation bytes. The
    text used to be held back until the run ended (a 400 ms silent gap on the tiny model's
    greedy output) while each step re-decoded the whole growing run."""
    import time

    tok = tiny_tokenizer
    bad = next(i for i in range(tok.vocab_size) if tok.hf.decode([i]) == "\ufffd")
    ids = [bad] * 3000 + tok.encode("😀 ok 👍") + [bad] * 5 + tok.encode("end")
    detok = IncrementalDetokenizer(tok)
    text, silent, longest = "", 0, 0
    t0 = time.perf_counter()
    for i in ids:
        delta, _ = detok.push([i])
        text += delta
        silent = 0 if delta else silent + 1
        longest = max(longest, silent)
    text += detok.flush()
    assert time.perf_counter() - t0 < 2.0  # was quadratic: ~4.5M token decodes for this run
    assert longest <= 9
    assert text == tok.hf.decode(ids)  # the same text, emoji intact
