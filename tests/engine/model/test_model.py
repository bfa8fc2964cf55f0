"""Paged forward == dense reference on the tiny preset (fp32), block sizes 16 and 7."""

from __future__ import annotations

import json

import pytest
import torch

from agentserve.engine.model.checkpoint import load_model
from agentserve.engine.model.llama import KVCache, SeqChunk, prepare_batch, rope_cos_sin
from safetensors.torch import load_file, save_file

from agentserve.engine.model.tiny import make_tiny
from tests.engine.model.reference import DenseLlama

ATOL = 2e-4


class Seq:
    """A sequence's tokens and block table, as the runner would keep them."""

    def __init__(self, tokens: list[int], blocks: list[int]) -> None:
        self.tokens, self.blocks, self.done = tokens, blocks, 0

    def chunk(self, n: int, need_logits: bool = True) -> SeqChunk:
        c = SeqChunk(self.tokens[self.done:self.done + n], self.done, self.blocks, need_logits)
        self.done += n
        return c


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _blocks(first: int, n_tokens: int, bs: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // bs)))


def _step(model, kv, chunks, bs):
    return model(prepare_batch(chunks, bs, "cpu"), kv)


def _cache(cfg, bs, num_blocks=200):
    return KVCache.allocate(cfg, num_blocks, bs, torch.float32, "cpu")


@pytest.mark.parametrize("bs", [16, 7])
def test_single_prefill(tiny, bs):
    model, cfg, ref = tiny
    toks = _tokens(45, 1)
    seq = Seq(toks, _blocks(3, 45, bs))
    out = _step(model, _cache(cfg, bs), [seq.chunk(45)], bs)
    assert out.shape == (1, cfg.vocab_size) and out.dtype == torch.float32
    torch.testing.assert_close(out[0], ref.logits(toks)[-1], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("bs", [16, 7])
def test_chunked_prefill_odd_sizes(tiny, bs):
    model, cfg, ref = tiny
    toks = _tokens(60, 2)
    dense = ref.logits(toks)
    seq, kv = Seq(toks, _blocks(10, 60, bs)[::-1]), _cache(cfg, bs)  # non-contiguous blocks
    for n in (5, 11, 1, 17, 3, 23):
        out = _step(model, kv, [seq.chunk(n)], bs)
        torch.testing.assert_close(out[0], dense[seq.done - 1], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("bs", [16, 7])
def test_mixed_batch_prefill_and_decode(tiny, bs):
    model, cfg, ref = tiny
    lens = [30, 9, 52, 17]
    seqs = [Seq(_tokens(n + 6, 10 + i), _blocks(1 + 20 * i, n + 6, bs)) for i, n in enumerate(lens)]
    dense = [ref.logits(s.tokens) for s in seqs]
    kv = _cache(cfg, bs)
    _step(model, kv, [seqs[0].chunk(30), seqs[1].chunk(9)], bs)  # two prefills
    plan = [  # per step: chunk size per sequence (0 = not scheduled)
        [1, 1, 20, 0],
        [1, 1, 13, 8],
        [1, 1, 1, 9],  # three decodes and one last prefill chunk
        [1, 0, 18, 1],
        [1, 1, 1, 1],  # all decodes
    ]
    for sizes in plan:
        chunks, owners = [], []
        for s, n in zip(seqs, sizes):
            if n:
                chunks.append(s.chunk(n, need_logits=(s is not seqs[2] or n == 1)))
                owners.append(s)
        out = _step(model, kv, chunks, bs)
        want = [dense[seqs.index(s)][s.done - 1] for s, c in zip(owners, chunks) if c.need_logits]
        assert out.shape[0] == len(want)
        torch.testing.assert_close(out, torch.stack(want), atol=ATOL, rtol=1e-4)


def test_prompt_rows_return_hidden_states_of_every_scored_position(tiny):
    """Chunks asking for ``prompt_rows`` get those rows' final hidden states after the logits
    rows; projected, they are the dense logits at those positions. A one-token chunk (laid
    out among the decodes) and a chunk after a cached prefix too."""
    model, cfg, ref = tiny
    bs = 16
    a, b, c = (Seq(_tokens(n, 40 + n), _blocks(1 + 20 * i, n, bs)) for i, n in enumerate((40, 30, 25)))
    dense = [ref.logits(s.tokens) for s in (a, b, c)]
    kv = _cache(cfg, bs)
    model.forward_hidden(prepare_batch([a.chunk(20, False), b.chunk(29, False)], bs, "cpu"), kv)
    chunks = [a.chunk(19, False), b.chunk(1), c.chunk(25, False)]  # a: after its first 20
    chunks[0].prompt_rows, chunks[1].prompt_rows, chunks[2].prompt_rows = 19, 1, 24
    meta = prepare_batch(chunks, bs, "cpu")
    h = model.forward_hidden(meta, kv)
    assert h.shape[0] == 1 + 19 + 1 + 24
    got = model.compute_logits(h)
    want = torch.cat([dense[1][29:30],  # b's logits row, then the scored rows chunk by chunk
                      dense[0][20:39], dense[1][29:30], dense[2][0:24]])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("bs", [16, 7])
def test_prefix_hit_then_greedy(tiny, bs):
    model, cfg, ref = tiny
    prompt = _tokens(50, 3)
    kv = _cache(cfg, bs)
    first = Seq(prompt[:40], _blocks(0, 40, bs))
    _step(model, kv, [first.chunk(40, need_logits=False)], bs)
    # the second request shares the first's full blocks, then owns fresh ones
    shared = 40 // bs
    blocks = first.blocks[:shared] + _blocks(100, 50 + 8 - shared * bs, bs)
    seq = Seq(list(prompt), blocks)
    seq.done = shared * bs
    out = _step(model, kv, [seq.chunk(50 - shared * bs)], bs)
    torch.testing.assert_close(out[0], ref.logits(prompt)[-1], atol=ATOL, rtol=1e-4)
    gen = []
    for _ in range(8):
        gen.append(int(out[0].argmax()))
        seq.tokens.append(gen[-1])
        out = _step(model, kv, [seq.chunk(1)], bs)
    assert gen == ref.greedy(prompt, 8)


def test_no_logits_and_bytes_per_token(tiny):
    model, cfg, _ = tiny
    seq = Seq(_tokens(8, 4), [0])
    out = _step(model, _cache(cfg, 16, 4), [seq.chunk(8, need_logits=False)], 16)
    assert out.shape == (0, cfg.vocab_size)
    assert KVCache.bytes_per_token(cfg, torch.bfloat16) == 2 * 4 * 2 * 64 * 2


def test_qwen2_bias_and_tied_embeddings(tmp_path):
    d = make_tiny(tmp_path / "q", "tiny", seed=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True)
    (d / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(d / "model.safetensors"))
    del w["lm_head.weight"]
    g = torch.Generator().manual_seed(7)
    for i in range(cfg["num_hidden_layers"]):
        for p in "qkv":
            out = w[f"model.layers.{i}.self_attn.{p}_proj.weight"].shape[0]
            w[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.randn(out, generator=g) * 0.1
    save_file(w, str(d / "model.safetensors"))
    model, mcfg = load_model(d, torch.float32, "cpu")
    assert mcfg.qkv_bias and not mcfg.o_bias and model.lm_head is None
    toks = _tokens(33, 5)
    seq, kv = Seq(toks, _blocks(0, 33, 16)), _cache(mcfg, 16, 8)
    out = _step(model, kv, [seq.chunk(20)], 16)
    out = _step(model, kv, [seq.chunk(13)], 16)
    torch.testing.assert_close(out[0], DenseLlama(d).logits(toks)[-1], atol=ATOL, rtol=1e-4)


def test_rope_long_positions():
    import math

    pos = torch.tensor([0, 1, 4097, 131071, 131072, 1_000_003])
    cos, sin = rope_cos_sin(pos, 64, 500000.0, torch.float32)
    assert cos.shape == (6, 1, 32) and cos.dtype == torch.float32
    for r, p in enumerate(pos.tolist()):
        for j in (0, 1, 17, 31):
            ang = p * (1.0 / 500000.0 ** (2 * j / 64))
            assert abs(cos[r, 0, j].item() - math.cos(ang)) < 1e-6
            assert abs(sin[r, 0, j].item() - math.sin(ang)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_right_causal_bias_reaches_every_layer(dtype):
    """Off the CPU a chunk after a cached prefix carries a lower-right ``CausalBias``, which
    every layer reuses (run here on CPU tensors). Converting it to the model dtype (as bool masks are) once gave the
    second layer a CausalBias without its lengths: every bf16 prefix hit failed on CUDA."""
    from torch.nn.attention.bias import causal_lower_right

    from agentserve.engine.model.attention import PrefillMeta, _prefill_attention
    from agentserve.engine.model.paged_prefix import Workspace

    g = torch.Generator().manual_seed(0)
    start, n, heads, kv_heads, dim, bs = 20, 12, 4, 2, 16, 8
    kv_len = start + n
    kc, vc = (torch.randn(4, bs, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    k, v = kc.view(-1, kv_heads, dim)[start:kv_len], vc.view(-1, kv_heads, dim)[start:kv_len]
    blocks = torch.arange(4)
    bias = PrefillMeta(0, n, start, kv_len, blocks, causal_lower_right(n, kv_len))
    q_pos = torch.arange(start, kv_len)
    mask = torch.arange(kv_len)[None, :] <= q_pos[:, None]
    k_all, v_all = (c.view(-1, kv_heads, dim)[:kv_len].transpose(0, 1)[None] for c in (kc, vc))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_all, v_all, attn_mask=mask, scale=0.25, enable_gqa=True
    )[0].transpose(0, 1)
    ws = Workspace(max_elems=10**5)
    for _layer in range(2):
        got = _prefill_attention(q, k, v, kc, vc, bias, 0.25, ws)
        torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_decodes_of_very_different_contexts_attend_in_groups(tiny):
    """A short context decoding beside long ones gets its own attention call (not padded to
    the longest); the logits still come back in chunk order and match the dense model."""
    model, cfg, ref = tiny
    bs, lens = 16, [1400, 20, 1400, 300]
    seqs, first = [], 0
    for i, n in enumerate(lens):
        seqs.append(Seq(_tokens(n + 1, 40 + i), _blocks(first, n + 1, bs)))
        first += len(seqs[-1].blocks)
    kv = _cache(cfg, bs, num_blocks=first + 1)
    for s, n in zip(seqs, lens):
        _step(model, kv, [s.chunk(n, need_logits=False)], bs)
    chunks = [s.chunk(1) for s in seqs]
    meta = prepare_batch(chunks, bs, "cpu")
    assert [g.n for g in meta.decodes] == [2, 2]  # the two long ones, then 300 and 20
    out = model(meta, kv)
    want = torch.stack([ref.logits(s.tokens)[-1] for s in seqs])
    torch.testing.assert_close(out, want, atol=ATOL, rtol=1e-4)


def test_decode_groups_split_only_where_padding_costs():
    from agentserve.engine.model.attention import decode_groups

    assert decode_groups([512] * 8) == [list(range(8))]
    assert decode_groups([100, 300, 40]) == [[1, 0, 2]]  # pads < 1,024 keys: one call
    groups = decode_groups([4096, 205, 2048, 3000, 600, 4000])
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert len(groups) > 1 and groups[0][0] == 0  # longest first
    for g in groups:  # within a group: padding under a quarter of the keys or 1,024 keys
        top, n = max([4096, 205, 2048, 3000, 600, 4000][i] for i in g), len(g)
        pad = n * top - sum([4096, 205, 2048, 3000, 600, 4000][i] for i in g)
        assert pad <= max(1024, 0.25 * n * top)
