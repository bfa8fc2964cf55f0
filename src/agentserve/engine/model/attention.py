"""Paged KV cache, per-step batch metadata and attention over the paged cache.

A step is a list of `SeqChunk`s. `prepare_batch` lays the step's tokens out as
[all decode tokens (q_len == 1) | prefill chunk 0 | prefill chunk 1 | ...] and builds every
index tensor once; each layer then reuses them:

- decodes of similar context share one block-table gather and one SDPA call (key-padding
  mask to the group's longest context); `decode_groups` splits a batch whose contexts differ
  widely (long main agents beside short sub-agents), so a short context is not padded to the
  longest one in the step; on CPU a long context alone in its group reads its blocks in place
  (`paged_prefix`); on CPU decodes whose tables start with the same blocks (a burst of
  sub-agents under their prompt) first read that shared prefix once, all their queries in one
  call, and their groups then cover only the rest, merged by log-sum-exp (cascade attention);
- each prefill chunk gets its own SDPA call when it starts at position 0 (plain causal). A
  chunk after cached tokens attends, on CPU, to the cached prefix in place and then to itself
  causally, merged by log-sum-exp (`paged_prefix`: no copy of the prefix, no mask); on GPUs to
  the gathered blocks under a lower-right causal bias.

Gathered K / V land in a reused workspace (`KVCache.ws`), not in fresh tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from agentserve.engine.model.checkpoint import ModelConfig
from agentserve.kv.decode_groups import decode_groups, decode_plan
from agentserve.engine.model.paged_prefix import (
    PrefixLayout,
    Workspace,
    attend_chunk,
    attend_prefix,
    flash,
    merge,
    prefix_layout,
)

# On CPU a decode group of one context of at least this many tokens reads its blocks in
# place (paged_prefix.py) rather than gathering them: 8-14% faster at 4-16K tokens (tiny
# model, 2-core Xeon). Groups of several stay gathered: at batch 8 one batched SDPA call over
# a copy beat per-sequence calls in place by 11-32% at every context up to 16K (at batch 32
# and 8-16K the calls in place won by 5-14%; one rule kept for simplicity).
LONG_DECODE_TOKENS = 4096


@dataclass(slots=True)
class KVCache:
    """Paged K/V pool. k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor
    # gathered K / V of one layer reuse these buffers (up to one layer's K in size)
    ws: Workspace = field(init=False)

    def __post_init__(self) -> None:
        self.ws = Workspace(max_elems=self.k[0].numel())

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """K and V bytes one token occupies across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device) -> KVCache:
        """Zeroed pool of `num_blocks` blocks of `block_size` tokens."""
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


@dataclass(slots=True)
class SeqChunk:
    """The new tokens of one sequence in one step."""

    token_ids: list[int]  # the new tokens to compute this step (prefill chunk or 1 decode token)
    start_pos: int  # tokens of this sequence already in the KV cache before this chunk
    block_ids: list[int]  # the sequence's whole block table (covers start_pos + len(token_ids))
    need_logits: bool  # True if the last token's logits are needed
    # rows of this chunk, from its first, whose hidden states are also returned (prompt
    # logprobs: row i predicts prompt token start_pos + i + 1)
    prompt_rows: int = 0


@dataclass(slots=True)
class PrefillMeta:
    """One prefill chunk: rows [q_start, q_start + q_len) of the step."""

    q_start: int
    q_len: int
    start_pos: int
    kv_len: int  # start_pos + q_len
    # GPU: blocks [ceil(kv_len / block_size)] gathered under a lower-right CausalBias.
    # CPU: the cached prefix's layout (attended in place), then the chunk causally.
    # All None when start_pos == 0.
    block_ids: torch.Tensor | None
    mask: CausalBias | None
    layout: PrefixLayout | None = None


@dataclass(slots=True)
class BatchMeta:
    """Everything a forward step needs, built once per step by `prepare_batch`."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] block_id * block_size + offset of each new token
    logits_idx: torch.Tensor  # [N] rows whose logits are returned, in chunk order
    decodes: list[DecodeGroup]  # the decode rows, group by group, one SDPA call each
    prefills: list[PrefillMeta]
    # CPU: prefixes several decodes share, each read once for all of them (cascade); the
    # groups of those decodes then read only what follows it
    shared: list[SharedPrefix] = field(default_factory=list)
    # [P] rows whose hidden states `forward_hidden` returns after the N above: chunk by
    # chunk, each chunk's `prompt_rows` in order (empty unless a request asked for them)
    prompt_idx: torch.Tensor | None = None
    # cached context tokens the step's attention reads (per layer): in place from the pool,
    # or gathered into a copy first (decode groups, short runs of blocks, GPU prefill)
    read_in_place: int = 0
    read_gathered: int = 0
    # ... and not read at all: a shared prefix's tokens once per decode beyond the first
    read_shared: int = 0

    @property
    def keep_idx(self) -> torch.Tensor:
        """The rows the last layer keeps: the logits rows, then the prompt-logprob rows."""
        if self.prompt_idx is None:
            return self.logits_idx
        return torch.cat((self.logits_idx, self.prompt_idx))

    @property
    def num_decodes(self) -> int:
        """Rows [0, num_decodes) are decode tokens."""
        return sum(g.n for g in self.decodes)


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, start + n) of the step, attended in one call, or one long decode
    (n == 1) attended over its blocks in place (`layout`; table and mask None). With
    `shared`, its rows' context starts with `BatchMeta.shared[shared]`, and the table,
    mask or layout cover only what follows it."""

    start: int
    n: int
    block_table: torch.Tensor | None  # [n, max_blocks], padded with block 0
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool, True = attend
    # (the mask turns into an additive mask of the model dtype on first use, then is reused)
    layout: PrefixLayout | None = None
    shared: int | None = None


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows [start, start + n) all begin with these blocks (`layout`: every token
    of them, read in place where they run consecutively)."""

    start: int
    n: int
    layout: PrefixLayout


def _slots(block_ids: list[int], start: int, n: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, start + n)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def _decode_meta(chunks: list[SeqChunk], block_size: int, device: torch.device
                 ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """One group: slots [B], padded block table [B, MB] and key mask [B, 1, 1, MB * block_size]."""
    starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=len(chunks))
    nblk = starts // block_size + 1
    table = np.zeros((len(chunks), int(nblk.max())), dtype=np.int64)
    for i, c in enumerate(chunks):
        table[i, : nblk[i]] = c.block_ids[: nblk[i]]
    slots = table[np.arange(len(chunks)), starts // block_size] * block_size + starts % block_size
    table_t = torch.from_numpy(table).to(device, non_blocking=True)
    ctx = torch.from_numpy(starts + 1).to(device, non_blocking=True)
    keys = torch.arange(table.shape[1] * block_size, device=device)
    mask = (keys[None, :] < ctx[:, None])[:, None, None, :]
    return slots, table_t, mask


def _prefill_meta(c: SeqChunk, q_start: int, block_size: int, device: torch.device) -> PrefillMeta:
    n, start = len(c.token_ids), c.start_pos
    kv_len = start + n
    if start == 0:
        return PrefillMeta(q_start, n, 0, kv_len, None, None)
    if device.type == "cpu":
        layout = prefix_layout(c.block_ids, start, block_size, device)
        return PrefillMeta(q_start, n, start, kv_len, None, None, layout)
    nblk = -(-kv_len // block_size)  # fused GPU kernels apply the offset causal mask themselves
    blocks = torch.tensor(c.block_ids[:nblk], dtype=torch.long, device=device)
    return PrefillMeta(q_start, n, start, kv_len, blocks, causal_lower_right(n, kv_len))


def prepare_batch(chunks: list[SeqChunk], block_size: int, device: str | torch.device) -> BatchMeta:
    """Lay out one step's tokens (decodes first) and build all index tensors."""
    device = torch.device(device)
    if any(not c.token_ids for c in chunks):
        raise ValueError("every SeqChunk needs at least one token")
    dec = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    pre = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    row_of_last = [0] * len(chunks)
    ids, pos, slots = [], [], []
    groups: list[DecodeGroup] = []
    row = 0
    shared: list[SharedPrefix] = []
    plan = decode_plan([chunks[i].block_ids for i in dec], [chunks[i].start_pos + 1 for i in dec],
                       block_size, cascade=device.type == "cpu")
    for members, n_shared in plan:
        first, sh = row, None
        d_all = orig = [chunks[dec[j]] for j in members]
        if n_shared:  # the groups below see only what follows the shared blocks
            sh, cut = len(shared), n_shared * block_size
            d_all = [SeqChunk(c.token_ids, c.start_pos - cut, c.block_ids[n_shared:],
                              c.need_logits) for c in d_all]
        for g in decode_groups([c.start_pos + 1 for c in d_all]):
            d_chunks = [d_all[j] for j in g]
            ids.append(np.fromiter((c.token_ids[0] for c in d_chunks), np.int64, len(g)))
            pos.append(np.fromiter((orig[j].start_pos for j in g), np.int64, len(g)))
            c = d_chunks[0]
            if len(g) == 1 and device.type == "cpu" and c.start_pos + 1 >= LONG_DECODE_TOKENS:
                slots.append(_slots(c.block_ids, c.start_pos, 1, block_size))
                layout = prefix_layout(c.block_ids, c.start_pos + 1, block_size, device)
                groups.append(DecodeGroup(row, 1, None, None, layout, sh))
            else:
                d_slots, table, mask = _decode_meta(d_chunks, block_size, device)
                slots.append(d_slots)
                groups.append(DecodeGroup(row, len(g), table, mask, shared=sh))
            for j in g:
                row_of_last[dec[members[j]]] = row
                row += 1
        if n_shared:
            blocks = chunks[dec[members[0]]].block_ids[:n_shared]
            shared.append(SharedPrefix(first, len(members), prefix_layout(
                blocks, n_shared * block_size, block_size, device)))
    prefills, q_start = [], row
    for i in pre:
        c = chunks[i]
        n = len(c.token_ids)
        prefills.append(_prefill_meta(c, q_start, block_size, device))
        ids.append(np.asarray(c.token_ids, dtype=np.int64))
        pos.append(np.arange(c.start_pos, c.start_pos + n, dtype=np.int64))
        slots.append(_slots(c.block_ids, c.start_pos, n, block_size))
        q_start += n
        row_of_last[i] = q_start - 1
    logits_rows = np.asarray([row_of_last[i] for i, c in enumerate(chunks) if c.need_logits],
                             dtype=np.int64)
    prompt_rows = []
    for i, c in enumerate(chunks):
        if c.prompt_rows:  # a chunk's rows run up to its last (a one-token chunk is its own row)
            first = row_of_last[i] - len(c.token_ids) + 1
            prompt_rows.append(np.arange(first, first + c.prompt_rows, dtype=np.int64))
    T, N = q_start, len(logits_rows)
    # one host->device copy for all 1-D index arrays
    flat = torch.from_numpy(np.concatenate([*ids, *pos, *slots, logits_rows, *prompt_rows]))
    flat = flat.to(device, non_blocking=True)
    layouts = [x.layout for x in (*groups, *prefills, *shared) if x.layout is not None]
    in_place = sum(lay.n_tokens - lay.n_rest for lay in layouts)
    saved = sum((s.n - 1) * s.layout.n_tokens for s in shared)
    read = (sum(c.start_pos + 1 for c in (chunks[i] for i in dec))
            + sum(p.start_pos for p in prefills))
    return BatchMeta(
        input_ids=flat[:T], positions=flat[T:2 * T], slot_mapping=flat[2 * T:3 * T],
        logits_idx=flat[3 * T:3 * T + N], decodes=groups, prefills=prefills, shared=shared,
        prompt_idx=flat[3 * T + N:] if prompt_rows else None,
        read_in_place=in_place, read_gathered=read - in_place - saved, read_shared=saved,
    )


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive float mask; SDPA would redo this every layer."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, ws: Workspace, name: str) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; blocks: [..., n] -> [..., n * block_size, Hkv, D].

    index_select into a reused buffer: ~3x faster than cache[blocks], and a fresh tensor of
    this size costs more in page faults than the copy."""
    flat = blocks.flatten()
    # small (most decode groups): the allocator reuses that memory, a plain select is cheaper
    out = (None if len(flat) * cache.stride(0) * cache.element_size() < ws.min_bytes
           else ws.get(name, (len(flat), *cache.shape[1:]), cache))
    if out is None:
        out = cache.index_select(0, flat)
    else:
        torch.index_select(cache, 0, flat, out=out)
    return out.view(*blocks.shape[:-1], -1, *cache.shape[2:])


def _decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, g: DecodeGroup,
                      scale: float, ws: Workspace,
                      shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One group. q: [B, H, D]; kc, vc: [num_blocks, block_size, Hkv, D] -> [B, H, D].
    `shared`: these rows' attention over their shared prefix (output float32 [1, H, B, D],
    lse [1, H, B]), merged with the group's over the rest of its context."""
    B, H, D = q.shape
    if g.layout is not None:  # one long decode: over its blocks in place
        o, lse = attend_prefix(q.view(1, H, 1, D), kc, vc, g.layout, scale, ws, shared)
        return o.to(q.dtype).view(1, H, D)
    assert g.block_table is not None and g.mask is not None
    Hkv = kc.shape[2]
    # the G = H / Hkv query heads of one KV head become G query rows of an MHA problem
    qg = q.view(B, Hkv, H // Hkv, D)  # [B, Hkv, G, D]
    k = _gather(kc, g.block_table, ws, "k").transpose(1, 2)  # [B, Hkv, K, D]
    v = k if vc is kc else _gather(vc, g.block_table, ws, "v").transpose(1, 2)
    g.mask = _additive(g.mask, q.dtype)  # once per step, then reused by every layer
    if shared is None:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
        return o.reshape(B, H, D)
    # the same kernel, with the log-sum-exp the merge needs ([B, Hkv, G] -> [1, H, B])
    o, lse = flash(qg, k, v, 0.0, False, attn_mask=g.mask, scale=scale)
    o, _ = merge(shared, o.reshape(B, H, D).transpose(0, 1)[None], lse.reshape(B, H).T[None])
    return o.to(q.dtype)[0].transpose(0, 1)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
                       vc: torch.Tensor, p: PrefillMeta, scale: float, ws: Workspace
                       ) -> torch.Tensor:
    """q: [L, H, D]; k, v: [L, Hkv, D] (this chunk) -> [L, H, D].

    Inputs stay 4-D ([1, heads, L, D]): on CPU only 4-D inputs reach the flash kernel
    (3-D ones fall back to the math path, which materializes [L, L] scores). On GPUs the
    fused kernels that take a lower-right causal mask lack GQA, so K/V heads are repeated.
    """
    if p.layout is not None:  # CPU, earlier tokens cached: the prefix in place, then the chunk
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
        acc = attend_prefix(qh, kc, vc, p.layout, scale, ws)
        o, _ = merge(acc, *attend_chunk(qh, kh, vh, scale))
        return o.to(q.dtype)[0].transpose(0, 1)
    if p.block_ids is not None:  # earlier tokens are cached: attend over the gathered blocks
        k = _gather(kc, p.block_ids, ws, "k")[: p.kv_len]  # [kv_len, Hkv, D]
        v = k if vc is kc else _gather(vc, p.block_ids, ws, "v")[: p.kv_len]
    gqa = q.device.type == "cpu"
    if not gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, L or kv_len, D]
    if p.mask is None:  # nothing cached before this chunk: plain causal over the chunk
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # CausalBias must reach SDPA as it is: converting it to another dtype yields a
        # CausalBias without its lengths.
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=p.mask, scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer: int,
                    meta: BatchMeta, scale: float) -> torch.Tensor:
    """Write k, v at meta.slot_mapping, then attend. q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]."""
    kc = kv.k[layer]  # [num_blocks, block_size, Hkv, D]
    # a latent cache (mla.py) is one tensor: k is v, written and gathered once
    vc = kc if kv.v is kv.k else kv.v[layer]
    Hkv, D = kc.shape[2], kc.shape[3]
    kc.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)
    if vc is not kc:
        vc.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)
    # a shared prefix first: all its rows' queries over it in one pass ([1, H, n, D])
    shared = [attend_prefix(q[s.start:s.start + s.n].transpose(0, 1)[None], kc, vc, s.layout,
                            scale, kv.ws) for s in meta.shared]
    outs = []
    for g in meta.decodes:
        acc = None
        if g.shared is not None:  # this group's rows of its shared prefix's result
            a = g.start - meta.shared[g.shared].start
            acc = tuple(x[:, :, a:a + g.n] for x in shared[g.shared])
        outs.append(_decode_attention(q[g.start:g.start + g.n], kc, vc, g, scale, kv.ws, acc))
    for p in meta.prefills:
        s, e = p.q_start, p.q_start + p.q_len
        outs.append(_prefill_attention(q[s:e], k[s:e], v[s:e], kc, vc, p, scale, kv.ws))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
