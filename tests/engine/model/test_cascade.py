"""Decodes that share a cached prefix read it once (cascade attention, engine/model/attention.py
with the clustering of kv/decode_groups.py) and still equal the dense model."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.engine.model import attention, paged_prefix
from agentserve.kv import decode_groups
from agentserve.engine.model.attention import prepare_batch
from agentserve.kv.decode_groups import padded_keys, read_keys, shared_prefixes
from tests.engine.model.test_model import ATOL, Seq, _cache, _step, _tokens

BS = 4


@st.composite
def _decodes(draw):
    """Decodes under a few shared prompts (equal block ids, as the prefix cache hands them
    out), each with blocks of its own after; contexts end inside the table's last block."""
    prompts = [list(range(1000 * (k + 1), 1000 * (k + 1) + draw(st.integers(1, 12))))
               for k in range(draw(st.integers(1, 3)))]
    nxt, tables, ctx = 100, [], []
    for _ in range(draw(st.integers(0, 8))):
        p = prompts[draw(st.integers(0, len(prompts) - 1))]
        keep = draw(st.integers(1, len(p)))  # a decode may share only part of its prompt
        own = draw(st.integers(1, 6))
        tables.append(p[:keep] + list(range(nxt, nxt + own)))
        nxt += own
        ctx.append((len(tables[-1]) - 1) * BS + draw(st.integers(1, BS)))
    return tables, ctx


@settings(max_examples=300, deadline=None)
@given(_decodes(), st.integers(1, 40))
def test_shared_prefixes_are_the_longest_common_prefixes_of_first_block_clusters(dec, min_tokens):
    """Brute force: decodes clustered by first block; a cluster of 2+ shares the element-wise
    longest common prefix of its members' whole blocks before their last token, kept when it
    holds `min_tokens`; nothing else is shared."""
    tables, ctx = dec
    need = -(-min_tokens // BS)
    want = {}
    for i, t in enumerate(tables):
        if (ctx[i] - 1) // BS >= need:
            want.setdefault(t[0], []).append(i)
    expect = []
    for members in want.values():
        if len(members) < 2:
            continue
        n = 0
        cap = min((ctx[i] - 1) // BS for i in members)
        while n < cap and len({tables[i][n] for i in members}) == 1:
            n += 1
        if n >= need:
            expect.append((members, n))
    got = shared_prefixes(tables, ctx, BS, min_tokens)
    assert sorted(map(str, got)) == sorted(map(str, expect))
    for members, n in got:  # what the engine relies on: the same blocks, all of them full
        assert all(tables[i][:n] == tables[members[0]][:n] and n * BS < ctx[i] for i in members)


def test_read_keys_counts_a_shared_prefix_once():
    shared = list(range(1, 65))  # 64 blocks of 16: 1,024 tokens
    tables = [shared + [100], shared + [101, 102], [200, 201]]
    ctx = [1024 + 10, 1024 + 20, 30]
    assert read_keys(tables, ctx, 16) == 1024 + padded_keys([10, 20]) + 30
    assert read_keys(tables, ctx, 16, min_tokens=1025) == padded_keys(ctx)  # too short to share
    assert read_keys(tables, ctx, 16, shared_floor=1000) == padded_keys(ctx)  # floored under


@pytest.mark.parametrize("kind", ["sequential", "shuffled"])
def test_decodes_sharing_a_prefix_read_it_once_and_match_the_dense_model(tiny, monkeypatch, kind):
    """Three decodes under one prompt (one of them long enough past it to read the rest in
    place), two under another, one sharing too little with a third, one alone: the shared
    prefixes are read once per step, and every decode's logits equal the dense model's, also
    beside a prefill chunk."""
    monkeypatch.setattr(decode_groups, "MIN_SHARED_TOKENS", 64)  # 4 blocks
    monkeypatch.setattr(attention, "LONG_DECODE_TOKENS", 100)
    monkeypatch.setattr(paged_prefix, "MIN_RUN_TOKENS", 48)
    monkeypatch.setattr(paged_prefix, "MAX_RUN_TOKENS", 80)
    model, cfg, ref = tiny
    bs, rng = 16, random.Random(3)
    free = list(range(1, 200))
    if kind == "shuffled":
        rng.shuffle(free)

    def take(n: int) -> list[int]:
        return [free.pop(0) for _ in range(n)]

    heads = {"a": (_tokens(200, 1), take(12)), "b": (_tokens(100, 2), take(6)),
             "d": (_tokens(40, 3), take(2))}  # whole blocks each: 192, 96 and 32 tokens
    plan = [("a", 30), ("a", 1500), ("a", 10), ("b", 20), ("b", 5), ("d", 9), ("d", 30), (None, 50)]
    kv = _cache(cfg, bs, num_blocks=200)
    kv.ws.min_bytes = 0
    seqs, written = [], set()
    for i, (h, tail) in enumerate(plan):
        toks, blocks = heads[h] if h else ([], [])
        toks = toks + _tokens(tail + 9, 10 + i)  # the last 9 are fed one step at a time
        seq = Seq(toks, blocks + take(-(-len(toks) // bs) - len(blocks)))
        seq.done = len(blocks) * bs if h in written else 0  # the head's blocks are cached
        written.add(h)
        _step(model, kv, [seq.chunk(len(toks) - 9 - seq.done, need_logits=False)], bs)
        seqs.append(seq)
    for step in range(3):  # two decode steps, then one with a prefill chunk beside them
        chunks = [s.chunk(1) for s in seqs[:-1]]
        chunks.append(seqs[-1].chunk(1 if step < 2 else 4))
        meta = prepare_batch(chunks, bs, "cpu")
        assert [(s.n, s.layout.n_tokens) for s in meta.shared] == [(3, 192), (2, 96)]
        assert sum(g.n for g in meta.decodes if g.shared is not None) == 5
        assert any(g.layout is not None and g.shared == 0 for g in meta.decodes)  # 1,500 past it
        assert meta.read_shared == 2 * 192 + 1 * 96
        out = model(meta, kv)
        want = torch.stack([ref.logits(s.tokens[:s.done])[-1] for s in seqs])
        torch.testing.assert_close(out, want, atol=ATOL, rtol=1e-4)


def test_metrics_count_a_prefix_two_decodes_share():
    """Two requests for one 2,400-token prompt decode together: each step reads their shared
    blocks once (149: the second request recomputes the prompt's last block, into a block of
    its own), and /metrics counts the 2,384 tokens not read again."""
    from agentserve.engine.core.engine import AsyncEngine
    from agentserve.engine.http.metrics import ServerMetrics
    from agentserve.engine.core.request import SamplingParams
    from agentserve.engine.core.sequence import Sequence

    eng = AsyncEngine.from_args(kv_cache_tokens=8192)
    core = eng.core
    prompt = _tokens(2400, 7)
    seqs = []
    for rid in ("a", "b"):
        seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        core.seqs[rid] = seq
        core.scheduler.add(seq)
        seqs.append(seq)
    for _ in range(100):
        if all(s.num_output_tokens >= 4 for s in seqs):
            break
        core.step([])
    assert [s.num_output_tokens for s in seqs] == [4, 4]
    assert seqs[0].output_token_ids == seqs[1].output_token_ids  # greedy, same prompt
    s = eng.stats()
    assert s.prefix_hits_tokens == 2384
    assert s.attn_read_shared_tokens > 0 and s.attn_read_shared_tokens % 2384 == 0
    body = ServerMetrics(eng).render()[0].decode()
    assert (f"agentserve:attn_read_shared_tokens_total{{model_name=\"{eng.model_name}\"}} "
            f"{float(s.attn_read_shared_tokens)}") in body
