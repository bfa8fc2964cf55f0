"""Attention over a sequence's cached prefix without copying it into one tensor (CPU).

Every query of a step may see every token of the prefix cached before the step, so over the
prefix attention is order-free: the prefix's KV blocks can be taken as a *set*. Sorted, they
fall into runs of consecutive block ids, and a run is a strided view of the pool
([run_blocks * block_size, Hkv, D]) that SDPA reads in place. Each run is one flash-attention
call that also returns its log-sum-exp; the calls merge exactly (`merge`), as flash-decoding
merges its splits. Blocks in short runs, and the prefix's partly filled last block, are
gathered (into a reused workspace when 4 MB or more) and attended in one more call.

Why: the gather it replaces copies the whole context once per layer and step (K and V: 100K
tokens of the tiny model are 2 x 51 MB per layer), and a step that starts past a cached prefix
needs a [q_len, kv_len] causal mask as well. A prefill chunk over its own tokens is the
square, top-left causal case SDPA does without a mask (`attend_chunk`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MAX_RUN_TOKENS", "MIN_RUN_TOKENS", "Workspace", "PrefixLayout", "prefix_layout", "attend_prefix",
           "attend_chunk", "flash", "merge"]

# A run shorter than this many tokens is gathered instead: an SDPA call costs ~20-30 us on
# top of its reads, about what copying 16-32 blocks of K and V costs. A longer run is split
# into calls of at most MAX_RUN_TOKENS: a call's K and V then stay in cache while the
# kernel's query blocks reread them (512-token chunk over 100K cached tokens: 16% faster than
# one call over the whole run). Both measured on the tiny model, 2-core Xeon.
MIN_RUN_TOKENS = 1024
MAX_RUN_TOKENS = 2048

# SDPA's CPU flash kernel, called directly for its log-sum-exp: -> (output, lse)
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class Workspace:
    """Reused buffers for gathered K and V: a fresh 50 MB tensor per layer costs more in page
    faults than the copy itself (~14 ms vs ~4 ms on the 2-core box; glibc maps anything over
    32 MB afresh). Buffers grow to the largest gather seen, up to `max_elems` each; a larger
    gather gets a fresh tensor, and one under `min_bytes` None: the allocator reuses those,
    and the caller's own `index_select` is cheaper (a 33-block decode gather: 9 us, against
    12-16 us into a buffer)."""

    def __init__(self, max_elems: int, min_bytes: int = 4 << 20) -> None:
        self.max_elems, self.min_bytes = max_elems, min_bytes
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """A tensor of `shape` (contents undefined), dtype and device of `like`; None when it
        is too small to be worth a buffer."""
        n = math.prod(shape)
        if n * like.element_size() < self.min_bytes:
            return None
        if n > self.max_elems:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != like.dtype or buf.device != like.device:
            buf = None
        if buf is None or buf.numel() < n:
            # grow by half again at least: a decode's context grows a block at a time, and
            # growing to the exact size would reallocate every time it crossed a block
            size = n if buf is None else min(self.max_elems, max(n, buf.numel() * 3 // 2))
            buf = torch.empty(max(size, 1), dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


@dataclass(slots=True)
class PrefixLayout:
    """Tokens [0, n_tokens) of one sequence: runs read in place, the rest gathered."""

    n_tokens: int
    runs: list[tuple[int, int]]  # [first block, end block) of each run of consecutive ids
    rest_blocks: torch.Tensor | None  # full blocks outside the runs (any order)
    tail_slots: torch.Tensor | None  # pool slots of the tokens in the partly filled last block
    n_rest: int  # tokens gathered: the rest blocks' and the tail's


def prefix_layout(block_ids: Sequence[int], n_tokens: int, block_size: int,
                  device: torch.device, min_run: int | None = None, max_run: int | None = None
                  ) -> PrefixLayout:
    """Split the first `n_tokens` tokens of a block table into in-place runs and the rest.

    Runs of at least `min_run` consecutive blocks (default MIN_RUN_TOKENS' worth) are read in
    place, in equal pieces of at most `max_run` blocks (default MAX_RUN_TOKENS' worth, and
    never under `min_run`)."""
    min_run = max(1, MIN_RUN_TOKENS // block_size) if min_run is None else min_run
    max_run = max(1, MAX_RUN_TOKENS // block_size) if max_run is None else max_run
    full = n_tokens // block_size
    ids = np.sort(np.asarray(block_ids[:full], dtype=np.int64))
    runs: list[tuple[int, int]] = []
    rest = ids
    if len(ids) >= min_run:
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, len(ids)]
        long = ends - starts >= min_run
        most = max(min_run, max_run)
        for s, e in zip(starts[long], ends[long]):
            first, n = int(ids[s]), int(e - s)
            k = -(-n // most)  # equal pieces of at most `most` blocks
            runs += [(first + n * i // k, first + n * (i + 1) // k) for i in range(k)]
        rest = (np.concatenate([ids[s:e] for s, e in zip(starts[~long], ends[~long])])
                if (~long).any() else ids[:0])
    tail = n_tokens - full * block_size
    tail_slots = (block_ids[full] * block_size + np.arange(tail, dtype=np.int64)) if tail else None
    return PrefixLayout(
        n_tokens, runs,
        torch.from_numpy(rest).to(device) if len(rest) else None,
        torch.from_numpy(tail_slots).to(device) if tail_slots is not None else None,
        len(rest) * block_size + tail,
    )


def merge(acc: tuple[torch.Tensor, torch.Tensor] | None, o: torch.Tensor, lse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets from their outputs and log-sum-exps.
    o: [1, H, L, D] (any float dtype); lse: [1, H, L] float32."""
    if acc is None:
        return o.float(), lse
    o0, lse0 = acc
    new = torch.logaddexp(lse0, lse)
    o_acc = o0 * (lse0 - new).exp_()[..., None]
    o_acc.addcmul_(o.float(), (lse - new).exp_()[..., None])
    return o_acc, new


def _rest_kv(cache: torch.Tensor, layout: PrefixLayout, ws: Workspace, name: str) -> torch.Tensor:
    """The gathered tokens of `layout` from one layer's cache: [1, Hkv, n_rest, D]."""
    bs, hkv, d = cache.shape[1:]
    shape = (layout.n_rest, hkv, d)
    out = ws.get(name, shape, cache)
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    n = 0
    if layout.rest_blocks is not None:
        n = len(layout.rest_blocks) * bs
        torch.index_select(cache, 0, layout.rest_blocks, out=out[:n].view(-1, bs, hkv, d))
    if layout.tail_slots is not None:
        torch.index_select(cache.view(-1, hkv, d), 0, layout.tail_slots, out=out[n:])
    return out.transpose(0, 1)[None]


def attend_prefix(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, layout: PrefixLayout,
                  scale: float, ws: Workspace, acc: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [1, H, L, D]; kc, vc: [num_blocks, block_size, Hkv, D]. Every query sees every
    token of the layout. Returns the merged (output float32 [1, H, L, D], lse [1, H, L])."""
    hkv, d = kc.shape[2], kc.shape[3]
    for a, b in layout.runs:
        k = kc[a:b].view(-1, hkv, d).transpose(0, 1)[None]  # a view: nothing is copied
        v = vc[a:b].view(-1, hkv, d).transpose(0, 1)[None]
        acc = merge(acc, *flash(q, k, v, 0.0, False, scale=scale))
    if layout.n_rest:
        k, v = _rest_kv(kc, layout, ws, "k"), _rest_kv(vc, layout, ws, "v")
        acc = merge(acc, *flash(q, k, v, 0.0, False, scale=scale))
    assert acc is not None, "an empty prefix has nothing to attend to"
    return acc


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk over its own tokens, causal (square, so top-left is right).
    q: [1, H, L, D]; k, v: [1, Hkv, L, D] -> (output [1, H, L, D], lse [1, H, L])."""
    return flash(q, k, v, 0.0, True, scale=scale)
