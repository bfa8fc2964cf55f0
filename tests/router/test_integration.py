"""Two of our engines behind `agentserve route` (real processes, real KV events)."""

import json
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentserve.engine.model.tiny import default_model_dir

from .procs import free_port, our_engine, router, stop, wait_http
from .sessions import run_sessions

pytestmark = pytest.mark.slow


@contextmanager
def two_engines(tmp_path: Path, policy: str, **engine_kw: Any) -> Iterator[str]:
    """Two of our engines (real KV events) behind `agentserve route` with `policy`; yields
    the router's URL and stops every process on exit."""
    model = str(default_model_dir())
    ports, evs, rport = [free_port() for _ in range(2)], [free_port() for _ in range(2)], free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"policy": policy, "endpoints": [
        {"url": f"http://127.0.0.1:{p}", "kv_events": f"tcp://127.0.0.1:{e}", "block_size": 16}
        for p, e in zip(ports, evs)]}))
    procs = [our_engine(p, e, tmp_path / f"engine{i}.log", **engine_kw)
             for i, (p, e) in enumerate(zip(ports, evs))]
    try:
        for p, proc in zip(ports, procs):
            wait_http(f"http://127.0.0.1:{p}/health", proc)
        procs.append(router(rport, cfg, tmp_path / "router.log", model))
        wait_http(f"http://127.0.0.1:{rport}/health", procs[-1], 60)
        yield f"http://127.0.0.1:{rport}"
    finally:
        stop(procs)


def _post_json(url: str, body: dict) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_two_engines_precise_routing(tmp_path: Path):
    with two_engines(tmp_path, "precise-prefix") as url:
        rows = run_sessions(url, n_sessions=4, turns=4)
        id_rows = token_id_sessions(url)
        # /tokenize and /detokenize pass through the router to an engine
        tok = _post_json(f"{url}/tokenize", {"prompt": "hello world"})
        assert tok["count"] == len(tok["tokens"]) > 0
        assert _post_json(f"{url}/detokenize", {"tokens": tok["tokens"]}) == {"prompt": "hello world"}
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read()
    later = [r for r in rows if r["turn"] > 0]
    for r in later:
        first = next(x for x in rows if x["session"] == r["session"] and x["turn"] == 0)
        assert r["endpoint"] == first["endpoint"], r
    assert all(r["predicted"] == r["cached"] for r in rows), rows
    assert sum(r["cached"] for r in later) > 0.8 * sum(r["prompt"] for r in later)
    assert len({r["endpoint"] for r in rows}) == 2  # sessions spread over both engines
    # token-id prompts (the openai client), read incrementally from the body bytes
    assert all(r["predicted"] == r["cached"] for r in id_rows), \
        [r for r in id_rows if r["predicted"] != r["cached"]]
    later = [r for r in id_rows if r["turn"] > 0]
    assert sum(r["cached"] for r in later) > 0.8 * sum(r["prompt"] for r in later)
    m = re.search(rb'agentserve_router_token_id_parses{mode="incremental"} (\S+)', metrics)
    assert m and float(m.group(1)) >= len(later), metrics[-2000:]


def token_id_sessions(base: str, n: int = 3, turns: int = 4) -> list[dict]:
    """Growing token-id prompts through the official client; predicted vs reported."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 500) for _ in range(700)] for _ in range(n)]
    out = []
    for turn in range(turns):
        for i, p in enumerate(prompts):
            raw = client.completions.with_raw_response.create(
                model=model, prompt=p, max_tokens=4, temperature=0,
                extra_headers={"x-session-id": f"ids{i}"})
            c = raw.parse()
            out.append({"session": i, "turn": turn,
                        "predicted": int(raw.headers["x-agentserve-predicted-cached"]),
                        "cached": c.usage.prompt_tokens_details.cached_tokens,
                        "prompt": c.usage.prompt_tokens})
            p += [rng.randrange(1, 500) for _ in range(rng.randrange(20, 200))]
        # The policy (precise-prefix) has no speculative entries: a turn's prediction
        # rests on the previous turn's BlockStored events, published as the engine
        # finishes it. Sent back to back, a turn could be decided before those arrive
        # (seen once: predicted < cached). The pause lets them land, as run_sessions does.
        time.sleep(0.3)
    return out


def test_a_sub_agent_burst_computes_its_shared_head_once(tmp_path: Path):
    """Four requests at once over a 1,536-token head neither engine has seen (a sub-agent
    group), through the router's default policy: its speculative index sends them all to
    the engine the first went to, and that engine computes the head once (the others wait
    for it, kv/inflight.py) instead of each of them, on either engine, computing it.
    The engines cap a request's prefill chunk (vLLM's long_prefill_token_threshold), so the
    others would otherwise be admitted next to the first one's first chunk."""
    import concurrent.futures

    import openai

    with two_engines(tmp_path, "default", threads=1,
                     extra=["--long-prefill-token-threshold", "256"]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        rng = random.Random(9)
        head = [rng.randrange(16, 3900) for _ in range(1536)]
        prompts = [head + [rng.randrange(16, 3900) for _ in range(64)] for _ in range(4)]

        def one(p: list[int]) -> tuple[str, int]:
            raw = client.completions.with_raw_response.create(model=name, prompt=p,
                                                              max_tokens=2, temperature=0)
            return (raw.headers["x-agentserve-endpoint"],
                    raw.parse().usage.prompt_tokens_details.cached_tokens)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, prompts))
    assert len({ep for ep, _ in got}) == 1, got  # one engine took the whole group
    # the head computed once: without the wait, [0, 256, 256, 256] or [0, 0, 0, 0]
    assert sorted(c for _, c in got) == [0, 1536, 1536, 1536], got


def test_agent_api_sessions_through_the_router(tmp_path: Path):
    """Claude Code's and Codex's APIs through the router: /v1/messages conversations (the
    session in metadata.user_id) and /v1/responses ones (in prompt_cache_key) stay on one
    engine, the router predicts each turn's cache read exactly (it renders these bodies as
    the engine does), and count_tokens passes through."""
    import anthropic

    with two_engines(tmp_path, "precise-prefix") as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        import openai
        name = openai.OpenAI(base_url=f"{url}/v1", api_key="none").models.list().data[0].id
        rows = []
        for s in range(3):
            msgs: list[dict] = []
            for turn in range(3):
                msgs.append({"role": "user", "content": f"session {s} turn {turn}: " + "fix the bug " * 40})
                raw = client.messages.with_raw_response.create(
                    model=name, max_tokens=4, system="You are a coding agent. " * 20, messages=msgs,
                    metadata={"user_id": f"user_x_session_{s}"}, extra_body={"temperature": 0})
                m = raw.parse()
                rows.append((s, turn, raw.headers["x-agentserve-endpoint"],
                             int(raw.headers["x-agentserve-predicted-cached"]),
                             m.usage.cache_read_input_tokens))
                msgs.append({"role": "assistant", "content": m.content})
                time.sleep(0.3)  # (the turn's KV events reach the router)
            counted = client.messages.count_tokens(model=name, messages=msgs,
                                                   system="You are a coding agent. " * 20)
            assert counted.input_tokens > 0
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for s in range(3, 5):
            conv: list[dict] = []
            for turn in range(3):
                conv.append({"role": "user", "content": f"codex {s} turn {turn}: " + "run tests " * 40})
                raw = oai.responses.with_raw_response.create(
                    model=name, input=conv, instructions="You are Codex. " * 20,
                    max_output_tokens=4, temperature=0, prompt_cache_key=f"conv-{s}")
                r = raw.parse()
                rows.append((s, turn, raw.headers["x-agentserve-endpoint"],
                             int(raw.headers["x-agentserve-predicted-cached"]),
                             r.usage.input_tokens_details.cached_tokens))
                conv += [o.model_dump(exclude_none=True) for o in r.output]
                time.sleep(0.3)
        # a tool-using Claude Code session: tool_use and tool_result blocks in every turn
        weather = {"name": "get_weather", "input_schema": {
            "type": "object", "additionalProperties": False, "required": ["city"],
            "properties": {"city": {"type": "string", "maxLength": 8}}}}
        msgs = [{"role": "user", "content": "check the weather " * 30}]
        for turn in range(3):
            raw = client.messages.with_raw_response.create(
                model=name, max_tokens=60, messages=msgs, tools=[weather],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                metadata={"user_id": "user_x_session_5"}, extra_body={"seed": turn})
            m = raw.parse()
            rows.append((5, turn, raw.headers["x-agentserve-endpoint"],
                         int(raw.headers["x-agentserve-predicted-cached"]),
                         m.usage.cache_read_input_tokens))
            [use] = [b for b in m.content if b.type == "tool_use"]
            msgs += [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": f"sunny {turn}"},
                                                  {"type": "text", "text": "and now?"}]}]
            time.sleep(0.3)
        # a prefill (a final assistant message: rendered and cut as the engine does)
        prefilled = [{"role": "user", "content": "name a colour " * 40},
                     {"role": "assistant", "content": "The colour is"}]
        for turn in range(2):
            raw = client.messages.with_raw_response.create(
                model=name, max_tokens=3, messages=prefilled, extra_body={"temperature": 0},
                metadata={"user_id": "user_x_session_6"})
            rows.append((6, turn, raw.headers["x-agentserve-endpoint"],
                         int(raw.headers["x-agentserve-predicted-cached"]),
                         raw.parse().usage.cache_read_input_tokens))
            time.sleep(0.3)
        # streamed through the router: each API's stream arrives whole, nothing appended
        with client.messages.stream(model=name, max_tokens=4, messages=msgs[:1],
                                    extra_body={"temperature": 0}) as stream:
            kinds = [ev.type for ev in stream]
            assert stream.get_final_message().usage.output_tokens == 4
        assert kinds[-1] == "message_stop" and "error" not in kinds
        events = list(oai.responses.create(model=name, input="run the tests", stream=True,
                                           max_output_tokens=4, temperature=0))
        assert events[-1].type == "response.incomplete"
        assert [e.type for e in events].count("error") == 0
        bad = {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}
        with pytest.raises(anthropic.BadRequestError) as err:  # the router's own 400
            client.messages.create(**bad, model=name)
        assert err.value.body["type"] == "error" and "image" in err.value.body["error"]["message"]
    for s in range(7):
        eps = {ep for ss, _, ep, _, _ in rows if ss == s}
        assert len(eps) == 1, rows
    assert all(pred == cached for _, _, _, pred, cached in rows), rows
    assert all(cached > 0 for _, turn, _, _, cached in rows if turn > 0), rows
