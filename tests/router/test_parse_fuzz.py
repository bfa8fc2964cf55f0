"""Property: the router's request parsing turns any body into a routing input or a
`BadRequest` (a 400 with a message), never another exception (a 500), for every path."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.engine.model.tiny import default_model_dir
from agentserve.prompt.tokenizer import Tokenizer
from agentserve.prompt.rawprompt import RawPromptCache
from agentserve.router.requests import BadRequest, parse_request
from agentserve.prompt.incremental import IncrementalTokenizer
from tests.fuzzing import bodies, json_values


@pytest.fixture(scope="module")
def tok() -> IncrementalTokenizer:
    return IncrementalTokenizer(Tokenizer.from_dir(default_model_dir()))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages",
                                  "/v1/responses"])
def test_any_body_parses_or_is_a_bad_request(tok, path: str) -> None:
    raw = RawPromptCache()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(bodies(path), json_values))
    def check(body) -> None:
        data = json.dumps(body).encode()
        try:
            route = parse_request(path, data, {}, tok, raw)
        except BadRequest as e:
            assert str(e)
            return
        assert all(isinstance(t, int) for t in route.token_ids)

    check()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a", "add_special_tokens": None}),  # (a 500 before)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "add_generation_prompt": "yes"}),
])
def test_flags_of_the_wrong_type_are_bad_requests(tok, path, body) -> None:
    with pytest.raises(BadRequest, match="must be a boolean"):
        parse_request(path, json.dumps(body).encode(), {}, tok)
