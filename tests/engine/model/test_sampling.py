"""Sampling controls vLLM users send: logit_bias, min_tokens, penalties, min_p, and
response_format (JSON through the grammar constraint). Unit tests of the row math, then
the same controls end to end through a real server with the official client."""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
import torch

from agentserve.engine.core.request import SamplingParams
from agentserve.engine.model.sampler import apply_penalties, logits_to_probs, sample
from agentserve.engine.core.sequence import Sequence
from agentserve.prompt.tokenizer import IncrementalDetokenizer
from tests.conftest import API_KEY, ServerThread
from tests.engine.model.test_tools import check_schema


def seq_with(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(temperature=0.0, **params))
    s.token_ids.extend(output)
    return s


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    row = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0])
    apply_penalties(row, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    # tokens 0 (prompt) and 1 (output) seen; 2-4 untouched
    assert row.tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]


def test_frequency_counts_occurrences_presence_counts_once_output_only() -> None:
    row = torch.zeros(4)
    apply_penalties(row, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
                    prompt_ids=[3, 3, 3], output_ids=[1, 1, 2])
    assert row.tolist() == [0.0, -2.0, -1.5, 0.0]  # prompt-only token 3 is not penalized


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, 1.0, 0, 1.0, min_p=0.25)  # threshold 0.125
    assert probs[3] == 0 and probs[2] > 0
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_logit_bias_and_min_tokens_steer_the_greedy_batch() -> None:
    logits = torch.zeros(3, 6)
    logits[:, 0] = 5.0  # token 0 is everyone's greedy pick (and, below, an EOS)
    seqs = [seq_with([1], []),
            seq_with([1], [], logit_bias={4: 9.0}),
            seq_with([1], [2], min_tokens=3, min_tokens_blocked=[0])]
    assert sample(logits, seqs) == [0, 4, 1]  # row 2: token 0 blocked before 3 outputs
    logits = torch.zeros(1, 6)
    logits[0, 0] = 5.0
    assert sample(logits, [seq_with([1], [2, 3, 4], min_tokens=3, min_tokens_blocked=[0])]) == [0]


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos() -> None:
    """Blocking the only allowed token would leave no token at all (a NaN draw that fails
    the whole step): the hard constraint wins over min_tokens."""
    class OnlyEos:
        def apply(self, row: torch.Tensor) -> None:
            row[1:] = float("-inf")

    logits = torch.zeros(1, 6)
    seq = seq_with([1], [], min_tokens=5, min_tokens_blocked=[0], constraint=OnlyEos())
    seq.params.temperature = 1.0
    seq.generator = torch.Generator().manual_seed(0)
    assert sample(logits, [seq]) == [0]


def test_stop_strings_wait_for_min_tokens(tiny_tokenizer) -> None:
    def run(min_tokens: int) -> str:
        detok = IncrementalDetokenizer(tiny_tokenizer, stop=["stop"], min_tokens=min_tokens)
        text = ""
        for i in tiny_tokenizer.encode(" stop here stop there"):
            delta, stopped = detok.push([i])
            text += delta
            if stopped:
                return text
        raise AssertionError(f"no stop in {text!r}")

    assert run(0) == " "
    assert run(len(tiny_tokenizer.encode(" stop here"))) == " stop here "


# ---- end to end ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(served: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)


def complete(client: openai.OpenAI, **kw):
    return client.completions.create(model="agentserve-tiny", prompt="def main():",
                                     temperature=0, **kw)


def test_logit_bias_forces_and_bans_tokens(client, served: ServerThread) -> None:
    tok = served.engine.tokenizer
    forced = complete(client, max_tokens=6, logit_bias={"1234": 100},
                      extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([1234] * 6)
    plain = complete(client, max_tokens=8)
    first = tok.encode(plain.choices[0].text)[0]
    banned = complete(client, max_tokens=8, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_min_tokens_holds_back_eos(client, served: ServerThread) -> None:
    eos = served.engine.tokenizer.eos_token_ids[0]
    quick = complete(client, max_tokens=20, logit_bias={str(eos): 100})
    assert quick.choices[0].finish_reason == "stop" and quick.usage.completion_tokens <= 1
    held = complete(client, max_tokens=20, logit_bias={str(eos): 100},
                    extra_body={"min_tokens": 5})
    assert held.choices[0].finish_reason == "stop"
    assert 5 <= held.usage.completion_tokens <= 6  # 5 tokens, then the EOS (counted, as vLLM)


def test_repetition_penalty_changes_a_looping_greedy_answer(client) -> None:
    plain = complete(client, max_tokens=48, extra_body={"ignore_eos": True})
    pen = complete(client, max_tokens=48,
                   extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
    assert pen.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_is_obeyed(client, stream: bool) -> None:
    # every value bounded (an enum, a boolean), so the answer always fits max_tokens
    schema = {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
              "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}}}
    kw = {"model": "agentserve-tiny", "max_tokens": 200, "temperature": 1.0, "seed": 3,
          "messages": [{"role": "user", "content": "pick a color"}],
          "response_format": {"type": "json_schema",
                              "json_schema": {"name": "pick", "schema": schema}}}
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", text
    check_schema(json.loads(text), schema)


def test_response_format_json_object_on_completions(client) -> None:
    r = complete(client, max_tokens=300, extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # ran out of tokens inside the object: still a JSON object's beginning
        assert r.choices[0].text.startswith("{")


def test_a_generate_refused_at_submission_leaves_nothing_behind(served: ServerThread) -> None:
    import asyncio

    async def first(seed: int):
        stream = served.engine.generate("refused-1", [5, 6, 7], SamplingParams(max_tokens=1,
                                                                               seed=seed))
        async with contextlib.aclosing(stream):
            return await stream.__anext__()

    def run(seed: int):
        return asyncio.run_coroutine_threadsafe(first(seed), served.loop).result(30)

    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        run(2**70)  # past a torch.Generator's range: refused before submission
    # the same id again is not a "duplicate request id": nothing of the first stayed
    assert run(7).request_id == "refused-1"


def test_logprobs_are_the_models_raw_distribution() -> None:
    """Each sampled token's logprob and its top 5 are log_softmax of the model's own logits
    at that position (the dense reference), also when a bias, a penalty and a temperature
    changed what was sampled (vLLM's raw_logprobs)."""
    from agentserve.engine.model.tiny import default_model_dir
    from tests.engine.model.reference import DenseLlama
    from tests.engine.core.test_engine import _prompt, _with_engine

    dense = DenseLlama(default_model_dir())
    prompt = _prompt(40, 3)
    forced = 1234
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=4, temperature=0.7, seed=1, ignore_eos=True, logprobs=5,
                             logit_bias={forced: 100.0}, repetition_penalty=1.3)]

    async def go(eng):
        outs = []
        for i, p in enumerate(params):
            lps = []
            async for out in eng.generate(f"r{i}", prompt, p):
                lps += out.logprobs or []
            outs.append(lps)
        return outs

    greedy, biased = asyncio.run(_with_engine(go))
    for lps in (greedy, biased):
        assert len(lps) == 4
        ids = list(prompt)
        for e in lps:
            ref = torch.log_softmax(dense.logits(ids)[-1].float(), -1)
            top = torch.topk(ref, 5)
            assert [i for i, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert e.logprob == pytest.approx(float(ref[e.token]), abs=1e-4)
            ids.append(e.token)
    assert all(e.token == e.top[0][0] for e in greedy)
    assert [e.token for e in biased] == [forced] * 4  # the bias chose it, not its raw odds
    assert biased[0].logprob < biased[0].top[0][1]


def test_batched_draw_follows_the_distribution_and_seeds_ignore_the_batch() -> None:
    """The batched draw (inverse CDF) samples each row from its own tempered, filtered
    distribution; a seeded row draws the same tokens alone or beside other rows."""
    from agentserve.engine.model.sampler import make_generator

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf")])

    def seq(temperature: float = 1.0, seed: int | None = None, **kw) -> Sequence:
        s = Sequence("r", [1], SamplingParams(temperature=temperature, seed=seed, **kw))
        s.generator = make_generator(seed)
        return s

    rows = [seq(), seq(temperature=0.5), seq(top_k=2)]
    counts = torch.zeros(3, 5)
    for _ in range(6000):
        for r, t in enumerate(sample(logits.repeat(3, 1), rows)):
            counts[r, t] += 1
    want = [torch.softmax(logits, -1), torch.softmax(logits / 0.5, -1),
            torch.softmax(torch.tensor([-9e9, 1.0, 2.0, -9e9, -9e9]), -1)]
    for r in range(3):
        assert (counts[r] / 6000 - want[r]).abs().max() < 0.03, (r, counts[r])
    assert counts[:, 4].sum() == 0 and counts[2, [0, 3]].sum() == 0

    def seeded_run(company: int) -> list:
        s = seq(seed=42)
        others = [seq() for _ in range(company)]
        return [sample(logits.repeat(company + 1, 1), others + [s])[-1] for _ in range(50)]

    assert seeded_run(0) == seeded_run(5) and len(set(seeded_run(0))) > 1


@pytest.mark.parametrize("top_k, top_p, min_p", [(1, 1.0, 0.0), (20, 0.8, 0.0), (50, 1.0, 0.1),
                                                  (200, 0.95, 0.05), (4095, 0.5, 0.0)])
def test_top_k_on_candidates_equals_masking_the_vocabulary(top_k, top_p, min_p) -> None:
    """The candidate path (topk, then softmax / min-p / top-p over k values) gives what masking
    every other logit to -inf and filtering the whole vocabulary gives."""
    from agentserve.engine.model import sampler

    g = torch.Generator().manual_seed(top_k)
    for _ in range(5):
        logits = torch.randn(4096, generator=g) * 3
        fast = sampler.logits_to_probs(logits, 0.7, top_k, top_p, min_p)
        kth = torch.topk(logits / 0.7, top_k).values[-1]
        masked = torch.where(logits / 0.7 < kth, torch.full_like(logits, -float("inf")), logits)
        full = sampler.logits_to_probs(masked, 0.7, 0, top_p, min_p)  # top_k off: the full path
        torch.testing.assert_close(fast, full, atol=1e-6, rtol=1e-5)


def test_top_k_with_a_tie_at_the_kth_logit_keeps_every_tie() -> None:
    """Masking keeps every logit equal to the k-th (as vLLM does); the candidate path would
    keep exactly k, so a tie takes the full path."""
    logits = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0])
    probs = logits_to_probs(logits, 1.0, 2, 1.0)
    assert (probs[1:4] > 0).all() and probs[4] == 0 and probs[0] > probs[1]


def _nucleus_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float,
                          min_p: float) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    sp, idx = torch.sort(probs, descending=True)
    sp = sp.masked_fill(torch.cumsum(sp, -1) - sp >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, sp)
    return out / out.sum()


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (nucleus of thousands) to peaked
@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.5, 0.0), (0.95, 0.02)])
def test_top_p_among_candidates_equals_the_full_sort(scale, top_p, min_p) -> None:
    """top-p looks for its cut among the most likely tokens first and sorts the vocabulary
    only when they hold less than top_p: the same nucleus either way."""
    g = torch.Generator().manual_seed(int(scale * 10))
    for _ in range(4):
        logits = torch.randn(4096, generator=g) * scale
        torch.testing.assert_close(logits_to_probs(logits, 0.8, 0, top_p, min_p),
                                   _nucleus_by_full_sort(logits, 0.8, top_p, min_p),
                                   atol=1e-6, rtol=1e-5)


def test_prompt_logprobs_score_every_prompt_token_even_when_cached() -> None:
    """prompt_logprobs=k: entry i is log_softmax of the model's logits at position i - 1,
    taken at prompt token i, with its rank and the k most likely (the dense reference);
    None at 0; handed out once, with the first token. Also when the prompt is computed in
    several chunks, and when its prefix is cached: the request then reads no cached prefix
    (as vLLM), so every position is scored."""
    from agentserve.engine.model.tiny import default_model_dir
    from tests.engine.model.reference import DenseLlama
    from tests.engine.core.test_engine import _prompt, _with_engine

    dense = DenseLlama(default_model_dir())
    prompt = _prompt(150, 5)
    ref = torch.log_softmax(dense.logits(prompt).float(), -1)  # [150, V]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)

    async def go(eng):
        outs = []
        for rid, p in (("warm", SamplingParams(max_tokens=1)), ("a", params), ("b", params)):
            got = []
            async for out in eng.generate(rid, prompt, p):
                got.append(out)
            outs.append(got)
        return outs

    # a 33-token budget splits the prompt into chunks of 33 and leaves odd remainders
    _, first, cached = asyncio.run(_with_engine(go, max_num_batched_tokens=33, block_size=16))
    for outs in (first, cached):
        with_lps = [o for o in outs if o.prompt_logprobs is not None]
        assert len(with_lps) == 1 and with_lps[0] is outs[0]  # once, with the first token
        assert outs[0].num_cached_tokens == 0  # the warm request's blocks were not read
        plp = with_lps[0].prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for i in range(1, len(prompt)):
            e, row = plp[i], ref[i - 1]
            assert e.token == prompt[i]
            assert e.logprob == pytest.approx(float(row[prompt[i]]), abs=1e-4)
            assert e.rank == int((row >= row[prompt[i]]).sum())
            top = torch.topk(row, 3)
            assert [t for t, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_k) -> None:
    """top_p in (0, 1] however small (1e-169 is 0 in float32): the nucleus is the most
    likely token, never empty (an empty one failed the request)."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    for top_p in (1e-169, 1e-9):
        probs = logits_to_probs(logits, 1.0, top_k, top_p)
        assert probs.sum() == pytest.approx(1.0) and int(probs.argmax()) == int(logits.argmax())
        assert probs.max() == 1.0
