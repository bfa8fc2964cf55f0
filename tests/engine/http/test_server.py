"""The real server with the real engine on the tiny model, driven by the official client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import API_KEY, MAX_MODEL_LEN, ServerThread, post, wait_idle


@pytest.fixture(scope="module")
def client(served: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


# ---- completions ------------------------------------------------------------------------

def test_completion_text(client: openai.OpenAI, served: ServerThread) -> None:
    r = client.completions.create(model=served.engine.model_name, prompt="hello world",
                                  max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].logprobs is None
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_token_ids_and_batch(client: openai.OpenAI, served: ServerThread) -> None:
    tok = served.engine.tokenizer
    ids = tok.encode("the quick brown fox")
    r = client.completions.create(model=served.engine.model_name, prompt=ids, max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4
    assert r.choices[0].finish_reason == "length"
    r2 = client.completions.create(model=served.engine.model_name, prompt=["a b", "c d e"],
                                   max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r2.choices) == [0, 1]
    assert r2.usage.completion_tokens == 6


def test_greedy_is_deterministic_and_stream_matches(client: openai.OpenAI,
                                                    served: ServerThread) -> None:
    kw = dict(model=served.engine.model_name, prompt="once upon a time", max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == full
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_in_every_chunk(client: openai.OpenAI, served: ServerThread,
                                               chat: bool) -> None:
    kw = dict(model=served.engine.model_name, max_tokens=6, temperature=0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True},
              extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], **kw))
    else:
        chunks = list(client.completions.create(prompt="hello", **kw))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6


def test_x_request_id_names_the_request(client: openai.OpenAI, served: ServerThread) -> None:
    """As in vLLM: the response id is {prefix}-{X-Request-Id} and the header comes back;
    two requests sent with the same header both run; without one the id is echoed."""
    import concurrent.futures

    def complete(rid: str | None, **kw):
        headers = {"X-Request-Id": rid} if rid else {}
        return client.completions.with_raw_response.create(
            model=served.engine.model_name, prompt="hello", max_tokens=3, extra_headers=headers, **kw)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        raws = list(pool.map(lambda _: complete("trace-42"), range(2)))
    for raw in raws:
        assert raw.headers["X-Request-Id"] == "trace-42"
        assert raw.parse().id == "cmpl-trace-42" and raw.parse().usage.completion_tokens == 3
    stream = complete("trace-43", stream=True)
    assert stream.headers["X-Request-Id"] == "trace-43"
    assert [c.id for c in stream.parse()][0] == "cmpl-trace-43"
    chat = client.chat.completions.with_raw_response.create(
        model=served.engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "trace-44"})
    assert chat.parse().id == "chatcmpl-trace-44" and chat.headers["X-Request-Id"] == "trace-44"
    plain = complete(None)
    assert plain.headers["X-Request-Id"] == plain.parse().id
    with pytest.raises(openai.BadRequestError, match="X-Request-Id"):
        complete("x" * 300)
    wait_idle(served)


def test_n_samples_are_the_seeded_single_requests(client: openai.OpenAI,
                                                 served: ServerThread) -> None:
    """Parallel sampling: with a seed, choice j is what one request with seed + j gives
    (vLLM's rule), streamed or not; the prompt counts once in usage; n prompts x n samples
    are ordered prompt-major, as OpenAI orders them."""
    prompt = " ".join(f"tok{i}" for i in range(80))
    kw = dict(model=served.engine.model_name, prompt=prompt, max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})
    wait_idle(served)
    hits = served.engine.stats().prefix_hits_tokens
    r = client.completions.create(n=3, seed=7, **kw)  # the first to send this prompt
    ids = served.engine.tokenizer.encode(prompt)
    full = (len(ids) - 1) // served.engine.block_size * served.engine.block_size
    # computed once: the two other samples hit it (they waited for the first, or came after)
    assert served.engine.stats().prefix_hits_tokens - hits >= 2 * full > 0
    single = [client.completions.create(seed=7 + j, **kw).choices[0].text for j in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == single and len(set(single)) > 1
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # as the sample that computed it
    texts = ["", "", ""]
    finished = set()
    for c in client.completions.create(n=3, seed=7, stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert texts == single and finished == {0, 1, 2}
    two = client.completions.create(model=served.engine.model_name, prompt=["a b", "c d e"], n=2,
                                    max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy: the samples agree
    assert two.usage.completion_tokens == 12
    assert two.usage.prompt_tokens == sum(len(served.engine.tokenizer.encode(p))
                                          for p in ("a b", "c d e"))
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0


def test_chat_n_samples_stream_each_choice_whole(client: openai.OpenAI,
                                                  served: ServerThread) -> None:
    """Chat with n: each choice starts with its role, ends with its finish reason, and
    matches the single seeded request; with tool_choice required every choice is a call."""
    msgs = [{"role": "user", "content": "tell me something"}]
    kw = dict(model=served.engine.model_name, messages=msgs, max_tokens=5, temperature=1.0,
              extra_body={"ignore_eos": True})
    single = [client.chat.completions.create(seed=11 + j, **kw).choices[0].message.content
              for j in range(2)]
    r = client.chat.completions.create(n=2, seed=11, **kw)
    assert [c.message.content for c in r.choices] == single
    one = client.chat.completions.create(seed=11, **kw).usage
    assert r.usage.prompt_tokens == one.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == 10
    roles, texts, finish = {}, ["", ""], {}
    for c in client.chat.completions.create(n=2, seed=11, stream=True, **kw):
        for ch in c.choices:
            if ch.index not in roles:
                roles[ch.index] = ch.delta.role
            assert ch.index not in finish, "a chunk after its choice finished"
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and texts == single
    assert set(finish) == {0, 1}
    r = client.chat.completions.create(model=served.engine.model_name, messages=MSGS, n=2,
                                       tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, seed=0)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        [call] = c.message.tool_calls
        check_weather_call(call)
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0


def test_completion_logprobs(client: openai.OpenAI, served: ServerThread) -> None:
    """logprobs=k: one entry per token, the tokens spell the text, the top-k dict holds the
    k best and the sampled token (k + 1 when it is not among them), text_offset counts the
    tokens' characters; streamed chunks carry the same entries in order."""
    kw = dict(model=served.engine.model_name, prompt="the cat sat on", max_tokens=8,
              temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(logprobs=3, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3 and top[tok] == v == max(top.values())  # greedy
    assert client.completions.create(**kw).choices[0].logprobs is None
    chunks = [c for c in client.completions.create(logprobs=3, stream=True, **kw) if c.choices]
    got = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    vals = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offs = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert got == lp.tokens and vals == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert offs == lp.text_offset
    zero = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    assert all(len(top) == 1 for top in zero.top_logprobs)  # just the sampled token


def test_completion_echo_and_prompt_logprobs(client: openai.OpenAI, served: ServerThread) -> None:
    """echo=true: the text starts with the prompt, and with logprobs so do the entries (the
    first token's null); prompt_logprobs=k: one entry per prompt token holding its own
    logprob and rank and the k most likely, the same values the echo shows, computed afresh
    (nothing read from the cache, which holds this prompt). max_tokens=0 with echo: the
    prompt alone. Streamed: the same text and entries."""
    prompt = "the cat sat on the mat"
    ids = served.engine.tokenizer.encode(prompt)
    kw = dict(model=served.engine.model_name, prompt=prompt, max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)  # (caches the prompt)
    r = client.completions.create(echo=True, logprobs=2, **{**kw, "extra_body": {
        "ignore_eos": True, "prompt_logprobs": 2}})
    c = r.choices[0]
    assert c.text == prompt + plain.choices[0].text
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 4 and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-6) and entry["rank"] >= 1
        assert entry["decoded_token"] == lp.tokens[i]
        assert [e["rank"] for k, e in plp[i].items() if k != str(ids[i])] == \
            [e for e in (1, 2) if e != entry["rank"]]
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(entry["logprob"], abs=1e-6)

    only = client.completions.create(echo=True, logprobs=0, **{**kw, "max_tokens": 0})
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(ids)])
    # (as vLLM, an echo with logprobs k reports prompt_logprobs k as well: here the tokens')
    assert [list(e) for e in only.choices[0].model_extra["prompt_logprobs"][1:]] == \
        [[str(t)] for t in ids[1:]]

    for case, want in ((dict(kw, logprobs=2), c), (dict(kw, max_tokens=0), only.choices[0])):
        chunks = [ch for ch in client.completions.create(echo=True, stream=True, **case)
                  if ch.choices]
        assert "".join(ch.choices[0].text for ch in chunks) == want.text
        if case.get("logprobs"):
            got = [t for ch in chunks if ch.choices[0].logprobs
                   for t in ch.choices[0].logprobs.token_logprobs]
            assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    wait_idle(served)
    assert served.engine.core.kv.pool.num_used_blocks == 0


def test_chat_prompt_logprobs(client: openai.OpenAI, served: ServerThread) -> None:
    """Chat: prompt_logprobs beside the choices (as vLLM), one per templated prompt token."""
    r = client.chat.completions.create(
        model=served.engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 1})
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 for v in e.values()) for e in plp[1:])


def test_chat_logprobs(client: openai.OpenAI, served: ServerThread) -> None:
    """logprobs=true, top_logprobs=k: a content entry per token with its bytes (which
    join to the answer's UTF-8) and the k most likely; streamed: the same entries, and with
    tools each chunk's logprobs still reach the client."""
    kw = dict(model=served.engine.model_name, messages=[{"role": "user", "content": "hi"}],
              max_tokens=10, temperature=0.8, seed=4, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    joined = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    only = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in only.choices[0].logprobs.content)
    calls = list(client.chat.completions.create(
        model=served.engine.model_name, messages=MSGS, tools=[WEATHER, CLOCK],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=0,
        logprobs=True, stream=True, stream_options={"include_usage": True}))
    n = sum(len(c.choices[0].logprobs.content) for c in calls if c.choices and c.choices[0].logprobs)
    assert n == calls[-1].usage.completion_tokens > 0
    wait_idle(served)


def test_cached_tokens_on_repeated_prompt(client: openai.OpenAI, served: ServerThread) -> None:
    prompt = " ".join(f"word{i}" for i in range(120))
    kw = dict(model=served.engine.model_name, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(**kw)
    r = client.completions.create(**kw)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_raw_sse_framing(served: ServerThread) -> None:
    import urllib.request

    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(served.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {API_KEY}",
                                  "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = resp.read().decode()
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert json.loads(events[-3][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


# ---- chat -------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]},
                                  "days": {"type": "integer", "minimum": 0, "maximum": 30}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"],
    "additionalProperties": False}}}
MSGS = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]}]


def test_chat_basic_and_stream(client: openai.OpenAI, served: ServerThread) -> None:
    kw = dict(model=served.engine.model_name, messages=MSGS, max_tokens=8, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (r.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def check_weather_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) >= {"city", "unit"} and args["unit"] in ("c", "f")
        assert isinstance(args["city"], str) and len(args["city"]) <= 8
        assert set(args) <= {"city", "unit", "days"} and 0 <= args.get("days", 0) <= 30
    else:
        assert call.function.name == "now" and args["tz"] in ("utc", "local")


@pytest.mark.parametrize("seed", [0, 1])
def test_tool_choice_required(client: openai.OpenAI, served: ServerThread, seed: int) -> None:
    r = client.chat.completions.create(model=served.engine.model_name, messages=MSGS,
                                       tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, seed=seed)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    check_weather_call(calls[0])


def test_tool_choice_named_streaming(client: openai.OpenAI, served: ServerThread) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=served.engine.model_name, messages=MSGS, tools=[WEATHER, CLOCK],
              tool_choice=choice, max_tokens=200, seed=3)
    r = client.chat.completions.create(**kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check_weather_call(call)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_auto_and_none(client: openai.OpenAI, served: ServerThread) -> None:
    for choice in ("auto", "none"):
        kw = dict(model=served.engine.model_name, messages=MSGS, tools=[WEATHER],
                  tool_choice=choice, max_tokens=6, temperature=0)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == (r.choices[0].message.content or "")


def test_tool_history_roundtrip(client: openai.OpenAI, served: ServerThread) -> None:
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    r = client.chat.completions.create(model=served.engine.model_name, messages=msgs,
                                       tools=[WEATHER], max_tokens=4)
    assert r.usage.prompt_tokens > 20


# ---- other routes -----------------------------------------------------------------------

def test_models_health_metrics(client: openai.OpenAI, served: ServerThread) -> None:
    import urllib.request

    [m] = client.models.list().data
    assert m.id == served.engine.model_name and m.owned_by == "agentserve"
    assert m.model_extra["max_model_len"] == MAX_MODEL_LEN
    with urllib.request.urlopen(served.url + "/health", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(served.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
             "vllm:generation_tokens_total", "vllm:spec_decode_num_drafts_total",
             "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total",
             "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
             "vllm:e2e_request_latency_seconds_bucket", "vllm:cache_config_info"]
    for name in names:
        assert f"\n{name}{{" in text, name
    assert f'model_name="{served.engine.model_name}"' in text
    assert 'block_size="16"' in text and "num_gpu_blocks=" in text


def test_draining(served: ServerThread) -> None:
    import urllib.error
    import urllib.request

    served.engine.draining = True
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(served.url + "/health", timeout=10)
        assert exc.value.code == 503
        status, body = post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503 and "shutting down" in body["error"]["message"]
    finally:
        served.engine.draining = False
    assert post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_api_key_required(served: ServerThread) -> None:
    status, body = post(served, "/v1/completions", {"prompt": "hi"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = post(served, "/v1/completions", {"prompt": "hi"}, key="wrong")
    assert status == 401


# ---- disconnect ---------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "tell me a long story " * 20, "max_tokens": 600}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "a long story " * 20}],
                      "max_tokens": 600}),
    ("/v1/responses", {"input": "a long story " * 20, "max_output_tokens": 600}),
])
async def test_disconnect_aborts_and_frees_blocks(served: ServerThread, path: str,
                                                  body: dict[str, Any]) -> None:
    """A client that drops a stream (any of the three APIs) aborts its request."""
    body = {**body, "stream": True, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = served.engine.stats().generation_tokens
    async with aiohttp.ClientSession() as session:
        resp = await session.post(served.url + path, json=body, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=30))
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 2:
                break
        resp.close()  # drop the connection mid-stream
    assert seen >= 2
    await asyncio.to_thread(wait_idle, served)
    stats = served.engine.stats()
    assert stats.num_running == 0 and stats.kv_usage == 0
    assert stats.generation_tokens - before < 600  # aborted, not run to max_tokens
    served.engine.core.kv.pool.check_invariants()


def test_tokenize_and_detokenize(client: openai.OpenAI, served: ServerThread) -> None:
    """/tokenize (vLLM's): a text prompt's ids are those /v1/completions counts, a chat's
    those /v1/chat/completions counts; /detokenize turns ids back into the text; bad
    input is a 400 naming the field."""
    model = served.engine.model_name

    def ok(path: str, body: dict) -> dict:
        status, answer = post(served, path, body)
        assert status == 200, answer
        return answer

    msgs = [{"role": "user", "content": "hello there"}]
    t = ok("/tokenize", {"model": model, "prompt": "the cat sat", "return_token_strs": True})
    r = client.completions.create(model=model, prompt="the cat sat", max_tokens=1)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens
    assert t["max_model_len"] == MAX_MODEL_LEN and "".join(t["token_strs"]) == "the cat sat"
    c = ok("/tokenize", {"messages": msgs})
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    assert c["count"] == chat.usage.prompt_tokens and c["token_strs"] is None
    bare = ok("/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert bare["tokens"] == c["tokens"][:bare["count"]] and bare["count"] < c["count"]
    assert ok("/detokenize", {"tokens": t["tokens"]}) == {"prompt": "the cat sat"}
    for path, body, param in (("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        status, err = post(served, path, body)
        assert status == 400 and err["error"]["param"] == param, (path, body, err)
    assert post(served, "/tokenize", {"model": "gpt-9", "prompt": "a"})[0] == 404


def test_return_token_ids(client: openai.OpenAI, served: ServerThread) -> None:
    """return_token_ids (vLLM's): the prompt's ids and the output's beside the text; the
    output ids decode to the text and are as many as usage counts; streamed, each chunk
    has its own ids, the first the prompt's (completions: per choice; chat: beside the
    choices), and they join to the same list."""
    model = served.engine.model_name
    tok = served.engine.tokenizer
    prompt = "the cat sat on the mat"
    ids = tok.encode(prompt)
    kw = dict(model=model, prompt=prompt, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    c = client.completions.create(**kw).choices[0]
    assert c.model_extra["prompt_token_ids"] == ids and len(c.model_extra["token_ids"]) == 6
    assert tok.decode(c.model_extra["token_ids"]) == c.text
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in ch.model_extra for ch in chunks[1:])
    assert [t for ch in chunks for t in ch.model_extra["token_ids"]] == c.model_extra["token_ids"]
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=2).choices[0]
    assert "token_ids" not in (plain.model_extra or {})

    msgs = [{"role": "user", "content": "hi"}]
    ckw = dict(model=model, messages=msgs, max_tokens=5, temperature=0,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**ckw)
    assert r.model_extra["prompt_token_ids"] == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    out = r.choices[0].model_extra["token_ids"]
    assert len(out) == r.usage.completion_tokens == 5 and tok.decode(out) == r.choices[0].message.content
    stream = list(client.chat.completions.create(stream=True, **ckw))
    assert stream[0].model_extra["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch.model_extra for ch in stream[1:])
    assert [t for ch in stream if ch.choices for t in ch.choices[0].model_extra["token_ids"]] == out


def test_continue_final_message(client: openai.OpenAI, served: ServerThread) -> None:
    """continue_final_message (vLLM's): the prompt ends with the final message's text (no
    end of turn, no new generation prompt), so the answer continues it: the same prompt
    ids /tokenize gives, the same greedy answer as a completion of those ids. Both flags
    at once, or an empty final message, are 400s."""
    model = served.engine.model_name
    msgs = [{"role": "user", "content": "name a colour"},
            {"role": "assistant", "content": "The colour is"}]
    status, t = post(served, "/tokenize", {"messages": msgs, "continue_final_message": True})
    assert status == 200
    assert served.engine.tokenizer.decode(t["tokens"]).endswith("The colour is")
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True,
                                                   "add_generation_prompt": False})
    assert r.usage.prompt_tokens == t["count"]
    ref = client.completions.create(model=model, prompt=t["tokens"], max_tokens=5, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].text
    for extra, needle in (({"continue_final_message": True}, "cannot both be true"),
                          ({"continue_final_message": True, "add_generation_prompt": False,
                            "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": ""}]}, "empty")):
        status, err = post(served, "/v1/chat/completions",
                           {"messages": msgs, "max_tokens": 2, **extra})
        assert status == 400 and needle in err["error"]["message"], err
