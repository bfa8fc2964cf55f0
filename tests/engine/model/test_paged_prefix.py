"""Attention over a cached prefix read in place (engine/model/paged_prefix.py) == dense attention."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.engine.model import attention, paged_prefix
from agentserve.engine.model.attention import PrefillMeta, _prefill_attention, prepare_batch
from agentserve.engine.model.paged_prefix import Workspace, attend_chunk, merge, prefix_layout
from tests.engine.model.test_model import ATOL, Seq, _cache, _step, _tokens

BS = 8


def _table(kind: str, n_blocks: int, rng: random.Random) -> list[int]:
    """A block table of `n_blocks` distinct ids laid out as the pool might hand them out."""
    ids = list(range(3, 3 + n_blocks))
    if kind == "reversed":  # freed tail-first, reallocated in that order
        ids.reverse()
    elif kind == "shuffled":
        rng.shuffle(ids)
    elif kind == "runs":  # runs of 1-12 consecutive ids, runs in random order
        runs, i = [], 0
        while i < n_blocks:
            n = rng.randint(1, 12)
            runs.append(ids[i:i + n])
            i += n
        rng.shuffle(runs)
        ids = [b for r in runs for b in r]
    return ids


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(1, 9), st.integers(1, 8), st.integers(1, 20),
       st.sampled_from(["sequential", "reversed", "shuffled", "runs"]), st.integers(0, 10**6))
def test_layout_covers_exactly_the_prefix_tokens(n_blocks, tail, min_run, max_run, kind, seed):
    """Runs, rest blocks and tail slots together are the slots of tokens [0, n), each once;
    long runs come in pieces of at most max(min_run, max_run) blocks."""
    n_tokens = n_blocks * BS + tail % BS
    table = _table(kind, n_blocks + 1, random.Random(seed))
    lay = prefix_layout(table, n_tokens, BS, torch.device("cpu"), min_run, max_run)
    slots = [s for a, b in lay.runs for s in range(a * BS, b * BS)]
    most = max(min_run, max_run)
    assert all(min(min_run, most // 2) <= b - a <= most for a, b in lay.runs)
    if lay.rest_blocks is not None:
        slots += [b * BS + o for b in lay.rest_blocks.tolist() for o in range(BS)]
    if lay.tail_slots is not None:
        slots += lay.tail_slots.tolist()
    want = [table[p // BS] * BS + p % BS for p in range(n_tokens)]
    assert sorted(slots) == sorted(want) and len(slots) == len(set(slots))
    assert lay.n_rest == len(slots) - sum(b - a for a, b in lay.runs) * BS


@pytest.mark.parametrize("kind", ["sequential", "reversed", "shuffled", "runs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_then_chunk_equals_dense_causal_attention(kind, dtype):
    g = torch.Generator().manual_seed(1)
    start, n, heads, kv_heads, dim = 203, 13, 4, 2, 16
    kv_len = start + n
    table = _table(kind, -(-kv_len // BS), random.Random(2))
    kc, vc = (torch.randn(64, BS, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(kv_len)])
    k_all, v_all = (c.view(-1, kv_heads, dim)[slots] for c in (kc, vc))  # [kv_len, Hkv, D]
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    mask = torch.arange(kv_len)[None, :] <= torch.arange(start, kv_len)[:, None]
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), k_all.transpose(0, 1)[None].float(),
        v_all.transpose(0, 1)[None].float(), attn_mask=mask, scale=0.25, enable_gqa=True)
    lay = prefix_layout(table, start, BS, torch.device("cpu"), min_run=3)
    if kind == "sequential":
        assert lay.runs and lay.n_rest == start % BS  # all in place but the tail
    meta = PrefillMeta(0, n, start, kv_len, None, None, lay)
    k, v = k_all[start:], v_all[start:]
    ws = Workspace(max_elems=10**6, min_bytes=0)  # every gather through its buffers
    for _layer in range(2):  # the workspace is reused by the next layer
        got = _prefill_attention(q, k, v, kc, vc, meta, 0.25, ws)
        torch.testing.assert_close(got.float(), want[0].transpose(0, 1),
                                   atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_merge_is_attention_over_the_union():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    k2, v2 = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(2))
    o, lse = merge(attend_chunk(q, k, v, 0.3), *paged_prefix.flash(q, k2, v2, 0.0, False, scale=0.3))
    mask = torch.cat([torch.ones(5, 40, dtype=torch.bool), torch.ones(5, 5).tril().bool()], 1)
    want = F.scaled_dot_product_attention(q, torch.cat([k2, k], 2), torch.cat([v2, v], 2),
                                          attn_mask=mask, scale=0.3)
    torch.testing.assert_close(o, want, atol=1e-6, rtol=0)


def test_workspace_reuses_its_buffer_and_caps_what_it_keeps():
    ws, like = Workspace(max_elems=100, min_bytes=0), torch.zeros(1)
    a = ws.get("k", (4, 5), like)
    b = ws.get("k", (2, 3), like)
    assert a.data_ptr() == b.data_ptr()
    big = ws.get("k", (20, 20), like)  # over the cap: a fresh tensor, nothing kept
    assert big.shape == (20, 20) and ws.get("k", (4, 5), like).data_ptr() == a.data_ptr()
    grown = ws.get("k", (21,), like)  # grows by half again (30), so 22-30 reuse it
    assert ws.get("k", (30,), like).data_ptr() == grown.data_ptr() != a.data_ptr()
    assert ws.get("k", (99,), like).numel() == 99  # never past the cap when growing
    small = Workspace(max_elems=100, min_bytes=64)  # under 16 float32: not worth a buffer
    assert small.get("k", (15,), like) is None and small.get("k", (16,), like) is not None


@pytest.mark.parametrize("kind", ["sequential", "reversed", "shuffled", "runs"])
def test_long_decodes_attend_in_place_beside_short_ones(tiny, monkeypatch, kind):
    """With the thresholds lowered to this scale, a long decode alone in its group reads its
    blocks in place, short ones share a padded group, a prefill chunk follows; all match the
    dense model."""
    monkeypatch.setattr(attention, "LONG_DECODE_TOKENS", 100)
    monkeypatch.setattr(paged_prefix, "MIN_RUN_TOKENS", 48)  # 3 blocks
    monkeypatch.setattr(paged_prefix, "MAX_RUN_TOKENS", 80)  # runs split in pieces of 3-5
    model, cfg, ref = tiny
    rng = random.Random(5)
    lens, bs = [3000, 1300, 100, 20], 16  # groups: [3000], [1300], [100, 20]
    nbs = [-(-(n + 9) // bs) for n in lens]
    pool = list(range(1, sum(nbs) + 1))
    if kind == "shuffled":  # blocks scattered over the whole pool
        rng.shuffle(pool)
    seqs, used = [], 0
    for i, (n, nb) in enumerate(zip(lens, nbs)):
        mine = pool[used:used + nb]
        order = _table(kind if kind != "shuffled" else "sequential", nb, rng)
        seqs.append(Seq(_tokens(n + 9, 60 + i), [mine[j - 3] for j in order]))
        used += nb
    kv = _cache(cfg, bs, num_blocks=used + 1)
    kv.ws.min_bytes = 0  # gathers at this scale go through the reused buffers too
    for s, n in zip(seqs, lens):
        _step(model, kv, [s.chunk(n, need_logits=False)], bs)
    for _ in range(2):  # two decode steps, then one with a prefill chunk beside them
        chunks = [s.chunk(1) for s in seqs]
        meta = prepare_batch(chunks, bs, "cpu")
        assert [(g.n, g.layout is not None) for g in meta.decodes] == [(1, True), (1, True), (2, False)]
        out = model(meta, kv)
        want = torch.stack([ref.logits(s.tokens[:s.done])[-1] for s in seqs])
        torch.testing.assert_close(out, want, atol=ATOL, rtol=1e-4)
    chunks = [s.chunk(1) for s in seqs[:3]] + [seqs[3].chunk(5)]
    out = _step(model, kv, chunks, bs)
    want = torch.stack([ref.logits(s.tokens[:s.done])[-1] for s in seqs])
    torch.testing.assert_close(out, want, atol=ATOL, rtol=1e-4)


def test_metrics_count_the_context_read_in_place_and_gathered():
    """A turn over a cached 2,400-token context (pool fresh: its blocks run consecutively)
    reads the prefix's whole blocks in place; its decodes, in groups, gather. /metrics says so."""
    from agentserve.engine.core.engine import AsyncEngine
    from agentserve.engine.http.metrics import ServerMetrics
    from agentserve.engine.core.request import SamplingParams
    from agentserve.engine.core.sequence import Sequence

    eng = AsyncEngine.from_args(kv_cache_tokens=8192,
                                long_prefill_token_threshold=0)  # chunks: the whole budget
    core = eng.core
    prompt = _tokens(2400, 7)

    def serve(rid: str, toks: list[int]) -> None:
        seq = Sequence(rid, toks, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        core.seqs[rid] = seq
        core.scheduler.add(seq)
        for _ in range(100):
            if seq.num_output_tokens >= 3:
                break
            core.step([])
        core.scheduler.finish(seq, seq.status)

    serve("a", prompt)  # chunks of 2,048 + 352: the second reads the first in place
    first = eng.stats()
    assert first.attn_read_in_place_tokens == 2048 and first.attn_read_gathered_tokens > 0
    serve("b", prompt + _tokens(40, 8))  # the turn: 2,400 cached tokens, 150 whole blocks
    s = eng.stats()
    assert s.attn_read_in_place_tokens - first.attn_read_in_place_tokens == 2400
    body = ServerMetrics(eng).render()[0].decode()
    assert f"agentserve:attn_read_in_place_tokens_total{{model_name=\"{eng.model_name}\"}} " \
           f"{float(s.attn_read_in_place_tokens)}" in body
    assert "agentserve:attn_read_gathered_tokens_total" in body
