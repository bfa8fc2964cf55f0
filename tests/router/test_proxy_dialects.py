"""The proxy reads each streaming API's end and cached tokens, and ends a broken stream
with an error event in that API's shape: OpenAI (chat/completions), the Responses API and
Anthropic's Messages, on streams our engine writes (real servers, no fakes)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from agentserve.router.proxy import Dialect, cached_tokens_of, usage_from_sse
from tests.conftest import API_KEY, ServerThread

CASES = {
    "/v1/completions": {"prompt": "the cat sat " * 30, "max_tokens": 3, "stream": True,
                        "stream_options": {"include_usage": True}},
    "/v1/responses": {"input": "run the tests " * 30, "max_output_tokens": 3, "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": "fix the bug " * 30}],
                     "max_tokens": 3, "stream": True},
}


def _raw_stream(served: ServerThread, path: str) -> bytes:
    req = urllib.request.Request(served.url + path, json.dumps(CASES[path]).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


@pytest.mark.parametrize("path", list(CASES))
def test_each_apis_stream_end_and_cached_tokens(served: ServerThread, path: str) -> None:
    _raw_stream(served, path)  # (caches the prompt)
    raw = _raw_stream(served, path)
    d = Dialect(path)
    assert d.complete(raw)
    cut = raw[:len(raw) * 2 // 3]
    assert not d.complete(cut)
    cached = usage_from_sse(raw[-2000:], raw[:2000])
    assert cached is not None and cached > 0
    fixed = cut + d.error(cut, "broke")
    assert d.complete(fixed)  # what the client gets: a stream that ends in an error event
    last = fixed.rstrip().rsplit(b"\n\n", 1)[-1]
    if path == "/v1/completions":
        assert last == b"data: [DONE]"
        assert b"broke" in fixed.rstrip().rsplit(b"\n\n", 2)[-2]  # the error event before it
    else:
        name, data = last.split(b"\n", 1)
        assert name == b"event: error"
        body = json.loads(data[len(b"data: "):])
        assert body["type"] == "error" and "broke" in json.dumps(body)
        if path == "/v1/responses":  # the next number after the last event kept
            seqs = [json.loads(line[6:])["sequence_number"] for line in cut.split(b"\n")
                    if line.startswith(b"data: {") and line.endswith(b"}")]
            assert body["sequence_number"] == seqs[-1] + 1


def test_cached_tokens_in_each_usage_shape() -> None:
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 3}}) == 3
    assert cached_tokens_of({"input_tokens_details": {"cached_tokens": 4}}) == 4
    assert cached_tokens_of({"cache_read_input_tokens": 5, "input_tokens": 9}) == 5
    assert cached_tokens_of({"output_tokens": 2}) is None
