"""Step-time model: how long one engine step takes on one DEPn/TPn instance.

A roofline per kernel with a few global efficiency factors (`Efficiency`), not a lookup:

    kernel = max(FLOPs / (peak * eff_flops), bytes / (HBM_bw * eff_bw))
    step = sum over a rank's kernels (GEMMs, sparse attention, indexer)  # slowest rank
         + all-to-all: per MoE layer 2 x (latency + bytes / link_bw)      # dispatch + combine
         + MTP drafts (k sequential one-layer passes) + scheduling overhead

FLOPs per token (x2 for multiply-add):
- linear layers: replicated params (attention, dense FFN, shared expert) on the token's own
  rank; routed experts `top_k x 3 x h x I` spread over the instance's n ranks (EP).
- sparse MLA attention (absorbed, as FlashMLA sparse): `2 H k (kv_lora+rope + kv_lora)` per
  layer with k = min(context, index_topk); dense models attend to the whole context.
- lightning indexer: `2 x idx_heads x idx_dim x context` per indexer layer at FP8 (GLM-5.2's
  IndexCache: 21 of 78 layers score keys, the others reuse their top-k).
Bytes per decode step: the rank's replicated weights (less the input embedding and the FP8
`kv_b_proj`, which no forward reads whole), the local experts touched by any token of the
instance (`1 - (1 - top_k/E)^T` of them), each query token's top-k KV rows, the request's
indexer-key column (once per query token when the verify window exceeds the logits kernel's 2,
`MQA_LOGITS_MAX_NEXT_N`), the fp32 indexer logits (written, then read by top-k), and the LM
head of each MTP draft pass. A decode step that re-admits preempted requests also pays their
recompute (`recompute_time`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from agentserve.sim.constants import (CACHED_PREFILL_KERNEL, LOGIT_BYTES, MQA_LOGITS_MAX_NEXT_N,
                                      MTP_ACCEPT, Efficiency)
from agentserve.sim.memory import Topology
from agentserve.sim.specs import HardwareSpec, ModelSpec
from agentserve.sim.linkcost import TransferModel

def interp(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; the end segments extend beyond them."""
    i = 1
    while i < len(points) - 1 and points[i][0] < x:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _context_slopes(m: dict, curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Decode attention per context token by batch size, from a profile that measured the
    decode curve at a short context as well (`decode_step_short_s` at `decode_short_ctx`),
    for contexts below the curve's reference (above it every batch takes `attn_decode_s`):
    (step at the reference context - step at the short one) / (batch x the contexts' gap) at
    each batch measured at both, and `attn_decode_s` (the batch-8 fit over 256-2,048 tokens)
    from batch 8 up. On this box a step at batches 1-4 shrinks less below the reference
    context than batch 8's slope says (stop 48: 0.8-1.7e-6 s a token against 1.6-1.8e-6; with
    that slope the bench's own steps at 150-400 tokens a sequence ran 17-19% longer than
    priced at batches 3-4). Empty without such points."""
    short = m.get("decode_step_short_s")
    if not short or not curve:
        return []
    ref, low, big = m["decode_ref_ctx"], m["decode_short_ctx"], m["attn_decode_s"]
    pts = [(int(b), max((interp(curve, int(b)) - float(t)) / (int(b) * (ref - low)), 0.0))
           for b, t in short.items() if int(b) < 8]
    # interp's end segments extend beyond its points: flat from batch 8 up, by two points
    return sorted(pts) + [(8, big), (16, big)] if pts else []


def mtp_tokens_per_step(accept: tuple[float, ...] = MTP_ACCEPT) -> float:
    """Expected tokens per verify step: the bonus token plus each accepted draft position."""
    return 1.0 + sum(accept)


def _once(fn):
    """A `PerfModel` method without arguments, computed once per model: it is a constant of
    the (model, hw, topo, eff) the model was built with (the step paths ask ~10^5 times)."""
    @functools.wraps(fn)
    def get(self):
        memo = self._memo
        if fn not in memo:
            memo[fn] = fn(self)
        return memo[fn]
    return get


@dataclass(slots=True)
class PerfModel(TransferModel):
    """Step times for `model` on `hw` with instance topology `topo`; KV transfers from
    `TransferModel` (transfer.py)."""

    model: ModelSpec
    hw: HardwareSpec
    topo: Topology
    eff: Efficiency = field(default_factory=Efficiency)
    mtp_draft: int = 3  # draft tokens per step when topo.mtp
    # measured profile: (batch, step) points of the decode curve, sorted; empty when under two
    _decode_curve: list[tuple[int, float]] = field(init=False, repr=False, default_factory=list)
    # (batch, decode attention per context token) where the profile measured the curve at a
    # short context too; empty: `attn_decode_s` (the batch-8 fit) at every batch
    _ctx_slope: list[tuple[int, float]] = field(init=False, repr=False, default_factory=list)
    _memo: dict = field(init=False, repr=False, compare=False, default_factory=dict)  # `_once`'s

    def __post_init__(self) -> None:
        """A measured profile (cpu-local) gives effective rates and overheads: no factors."""
        m = self.hw.measured
        pts = sorted((int(b), float(t)) for b, t in (m or {}).get("decode_step_s", {}).items())
        self._decode_curve = pts if len(pts) >= 2 else []
        self._ctx_slope = _context_slopes(m or {}, self._decode_curve)
        if m and self.eff == Efficiency():
            self.eff = Efficiency(flops=1.0, attn_flops=1.0, hbm=1.0, sparse_prefill=1.0,
                                  sparse_decode=1.0, sparse_decode_h64=1.0,
                                  step_overhead_s=m.get("step_overhead_s", self.eff.step_overhead_s),
                                  per_request_s=m.get("per_request_s", self.eff.per_request_s))

    # -- per-token quantities -------------------------------------------------------------
    @_once
    def _lin_flops_rank(self) -> float:
        """FLOPs per token on its own rank: replicated linears (attention, dense, shared)."""
        m = self.model
        f = 2.0 * (m.replicated_params() + m.vocab * m.hidden / max(1, m.layers))
        return f if self.topo.kind == "dep" else f / self.topo.width

    @_once
    def _routed_flops(self) -> float:
        """Routed-expert FLOPs per token (to be divided over the instance)."""
        m = self.model
        return 2.0 * m.moe_layers * m.top_k * m.expert_params()

    def _attn_flops(self, ctx: float) -> float:
        """Attention-core + indexer FLOPs for one query token at context `ctx` (all layers)."""
        m = self.model
        if m.is_mla:
            k = min(ctx, m.index_topk) if m.index_topk else ctx
            core = 2.0 * m.n_heads * k * (2 * m.kv_lora + m.rope_dim)
        else:
            core = 2.0 * m.n_heads * ctx * 2 * m.head_dim
        eff = self.eff.sparse_prefill if m.is_mla and m.index_topk else self.eff.attn_flops
        t = core * m.layers / self.hw.bf16_flops / eff
        if m.indexer_heads and ctx > m.index_topk:
            li = m.indexer_layers()  # IndexCache: the other layers reuse the top-k
            idx = 2.0 * m.indexer_heads * m.indexer_dim * ctx * li
            t += idx / self.hw.fp8_flops / self.eff.attn_flops
            # the fp32 logits row (one per query token and indexer layer) is written to HBM by
            # the logits kernel and read back by the top-k kernel (vLLM: fp8_mqa_logits, then
            # top_k_per_row_prefill)
            t += LOGIT_BYTES * ctx * li / (self.hw.hbm_bw * self.eff.hbm)
        return t / (self.topo.width if self.topo.kind == "tp" else 1)

    @_once
    def _lin_rate(self) -> float:
        """Effective FLOP/s for linear layers (FP8 weights -> FP8 GEMMs)."""
        peak = self.hw.fp8_flops if self.model.weight_bytes <= 1 else self.hw.bf16_flops
        return peak * self.eff.flops

    # -- all-to-all --------------------------------------------------------------------------
    def a2a_time(self, tokens_per_rank: float, layers: int | None = None,
                 mode: str = "low_latency") -> float:
        """Dispatch (FP8) + combine (bf16) for each MoE layer; the slowest link bounds it.

        `mode` is the DeepEP kernel family (the reference runs `deepep_low_latency` on decode
        and `deepep_high_throughput` on prefill): low-latency kernels send a token to each of
        its top-k experts' GPUs directly (`internode_ll.cu`); high-throughput ones send it once
        per destination *node* over RDMA and forward it over NVLink inside that node
        (`internode.cu`), so inter-node bytes drop from top_k x (remote share) to the number
        of remote nodes the token's experts touch (DEP16: ~1 instead of 4 hidden vectors)."""
        if mode not in ("low_latency", "high_throughput"):
            raise ValueError(f"all-to-all mode {mode!r}: low_latency or high_throughput")
        m, t, hw = self.model, self.topo, self.hw
        if not m.is_moe or t.width == 1:
            return 0.0
        L = m.moe_layers if layers is None else layers
        if t.kind == "tp":  # TP: two all-reduces of the hidden state per layer, NVLink
            b = 2 * 2 * tokens_per_rank * m.hidden * 2.0 * (t.width - 1) / t.width
            return m.layers * (2 * self.eff.a2a_latency_intra_s + b / (hw.nvlink_bw * self.eff.link))
        inter = t.width > hw.gpus_per_node
        lat = self.eff.a2a_latency_s if inter else self.eff.a2a_latency_intra_s
        vec = m.hidden * (1.0 + 2.0)  # one token's hidden state out (fp8) and back (bf16)
        if mode == "high_throughput":
            nodes = -(-t.width // hw.gpus_per_node)
            per_node = t.width // nodes
            # expected destinations of one token (experts spread evenly; top-k picks taken as
            # independent): other GPUs of the instance, other nodes
            gpus = (t.width - 1) * (1.0 - (1.0 - 1.0 / t.width) ** m.top_k)
            remote_nodes = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** m.top_k)
            nvl = tokens_per_rank * gpus * (per_node - 1) / max(1, t.width - 1) * nodes * vec
            rdma = tokens_per_rank * remote_nodes * vec
            t_link = max(nvl / (hw.nvlink_bw * self.eff.link),
                         rdma / (hw.net_bw * self.eff.link) if inter else 0.0)
            return L * (2 * lat + t_link)
        remote = (t.width - hw.gpus_per_node) / t.width if inter else (t.width - 1) / t.width
        bw = (hw.net_bw if inter else hw.nvlink_bw) * self.eff.link
        return L * (2 * lat + tokens_per_rank * m.top_k * vec * remote / bw)

    # -- prefill -------------------------------------------------------------------------------
    def prefill_rank_time(self, chunks: list[tuple[int, int]]) -> float:
        """Rank-local compute for chunks `(new_tokens, prefix_tokens)`: linears + attention."""
        lin = attn = 0.0
        for n, p in chunks:
            lin += n * self._lin_flops_rank()
            attn += n * self._attn_flops(p + n / 2)  # mean context over the chunk (causal)
        return lin / self._lin_rate() + attn

    def prefill_step(self, ranks: list[list[tuple[int, int]]]) -> float:
        """One synchronous prefill step of the instance; `ranks[r]` = chunks on rank r."""
        n = self.topo.width
        tok = [sum(c[0] for c in r) for r in ranks]
        total = sum(tok)
        if total == 0:
            return 0.0
        local = max(self.prefill_rank_time(r) for r in ranks)
        moe = total * self._routed_flops() / n / self._lin_rate()
        weights = self.rank_weight_bytes(1.0) / (self.hw.hbm_bw * self.eff.hbm)
        compute = max(local + moe, weights)
        comm = self.a2a_time(max(tok), mode=self.eff.prefill_a2a)
        hidden = min(comm, compute) * self.eff.prefill_overlap
        return compute + comm - hidden + self.eff.step_overhead_s

    def recompute_time(self, ranks: list[list[tuple[int, int]]]) -> float:
        """Extra time of a decode step that also recomputes preempted requests' KV (chunks
        `(new, prefix)` per rank): their compute on top of the step, whose weight streaming,
        all-to-all latency and overhead are already paid."""
        tok = sum(n for r in ranks for n, _ in r)
        if tok == 0:
            return 0.0
        local = max(self.prefill_rank_time(r) for r in ranks)
        return local + tok * self._routed_flops() / self.topo.width / self._lin_rate()

    # -- decode --------------------------------------------------------------------------------
    def rank_weight_bytes(self, touched: float) -> float:
        """Weight bytes one rank streams per forward when a fraction `touched` of its experts is
        used: the resident weights less what a forward never reads whole: the input embedding
        (one row gathered per token) and, for MLA, the FP8 `kv_b_proj` (absorbed attention runs
        on its bf16 W_UK / W_UV copies, which are counted)."""
        read, routed = self._weight_reads()
        return read - routed * (1.0 - touched)

    @_once
    def _weight_reads(self) -> tuple[float, float]:
        """(bytes a forward reads with every expert used, of them the routed experts')."""
        from agentserve.sim.memory import weight_bytes_per_gpu

        m, t = self.model, self.topo
        routed = m.routed_params() * m.weight_bytes / t.width
        unread = (0.0 if m.tied_embeddings else m.vocab * m.hidden * m.embed_bytes)
        if m.is_mla:
            unread += m.layers * m.kv_lora * m.n_heads * (m.nope_dim + m.v_head_dim) * m.weight_bytes
        if t.kind == "tp":
            unread /= t.width
        return weight_bytes_per_gpu(m, t) - unread, routed

    def _touched(self, tokens_total: float) -> float:
        m = self.model
        if not m.is_moe:
            return 1.0
        return 1.0 - (1.0 - m.top_k / m.n_routed) ** tokens_total

    def ctx_features(self, c: float) -> tuple[float, float]:
        """(rows, indexer) per request at context `c`: the KV rows its attention reads (top-k
        for a sparse model, all for a dense one) and the keys its indexer scans (all when c > k)."""
        k = self.model.index_topk
        if not k:
            return float(c), 0.0
        return float(min(c, k)), (float(c) if c > k and self.model.indexer_heads else 0.0)

    @_once
    def _feature_costs(self) -> tuple[float, float, float, float]:
        """Seconds per query token per row / indexer key; bytes per row / indexer key."""
        m, hw, e = self.model, self.hw, self.eff
        if m.is_mla:
            row = 2.0 * m.n_heads * (2 * m.kv_lora + m.rope_dim) * m.layers
        else:
            row = 2.0 * m.n_heads * 2 * m.head_dim * m.layers
        idx = 2.0 * m.indexer_heads * m.indexer_dim * m.indexer_layers()
        split = self.topo.width if self.topo.kind == "tp" else 1
        if m.is_mla and m.index_topk:
            eff = e.sparse_decode if m.n_heads / split >= 128 else e.sparse_decode_h64
        else:
            eff = e.attn_flops
        return (row / hw.bf16_flops / eff / split, idx / hw.fp8_flops / e.attn_flops / split,
                m.kv_bytes_per_token() / split, m.indexer_bytes_per_token() / split)

    def decode_rank_mem(self, ctxs: list[int]) -> float:
        """KV bytes read by one rank's requests: top-k latent rows + the whole indexer column."""
        _, _, b_row, b_idx = self._feature_costs()
        f = [self.ctx_features(c) for c in ctxs]
        return sum(r for r, _ in f) * b_row + sum(i for _, i in f) * b_idx

    def decode_step(self, ranks: list[list[int]], draft: int | None = None) -> float:
        """One decode (verify) step; `ranks[r]` = context lengths of rank r's requests."""
        loads = []
        for ctxs in ranks:
            f = [self.ctx_features(c) for c in ctxs]
            loads.append((len(ctxs), sum(r for r, _ in f), sum(i for _, i in f)))
        return self.decode_step_agg(loads, draft)

    def decode_step_agg(self, loads: list[tuple[int, float, float]], draft: int | None = None) -> float:
        """Decode step from per-rank `(requests, sum of rows, sum of indexer keys)`."""
        k = (self.mtp_draft if self.topo.mtp else 0) if draft is None else draft
        q = 1 + k  # query tokens per request
        n_max = max(n for n, _, _ in loads)
        total_tok = q * sum(n for n, _, _ in loads)
        if total_tok == 0:
            return 0.0
        t_row, t_idx, b_row, b_idx = self._feature_costs()
        bw = self.hw.hbm_bw * self.eff.hbm
        wbytes = self.rank_weight_bytes(self._touched(total_tok))
        moe = total_tok * self._routed_flops() / self.topo.width
        lin, rate, per_req = self._lin_flops_rank(), self._lin_rate(), self.eff.per_request_s
        # A sparse kernel gathers each query token's own top-k rows; a dense one reads the
        # request's KV once for all its query tokens.
        gathers = q if self.model.index_topk else 1
        # Indexer: the key column is read once per pass of the logits kernel (at most
        # MQA_LOGITS_MAX_NEXT_N query tokens each); every query token's fp32 logits row is
        # written and read back by top-k.
        reads = q if q > MQA_LOGITS_MAX_NEXT_N else 1
        b_logit = LOGIT_BYTES * self.model.indexer_layers() / (self.topo.width if self.topo.kind == "tp" else 1)
        worst = 0.0
        for n, rows, idx in loads:
            # Kernels of a layer run back to back on one stream: each is bound by its own
            # bytes or FLOPs (roofline per kernel), and the step is their sum.
            gemm = max(wbytes / bw, (n * q * lin + moe) / rate)
            attn = max(gathers * rows * b_row / bw, q * rows * t_row)
            index = max(reads * idx * b_idx / bw, q * idx * t_idx) + q * idx * b_logit / bw
            worst = max(worst, gemm + attn + index + n * per_req)
        a2a = self.a2a_time(q * n_max)
        return worst + a2a + self.mtp_time(k, n_max) + self.eff.step_overhead_s

    def mtp_time(self, k: int, reqs_per_rank: int) -> float:
        """k sequential draft passes: one MoE layer + LM head each (weights streamed)."""
        m = self.model
        if k == 0 or not m.mtp_layers:
            return 0.0
        layer = self.rank_weight_bytes(1.0) / max(1, m.layers)  # ~one layer's share per rank
        head = m.vocab * m.hidden * m.embed_bytes
        per = (layer + head) / (self.hw.hbm_bw * self.eff.hbm)
        per += self.a2a_time(reqs_per_rank, layers=1) + self.eff.step_overhead_s / 4
        return k * per

    # -- measured linear model (cpu-local, our engine) ------------------------------------------
    @property
    def linear(self) -> bool:
        """The profile carries the fitted linear step model of `benchmarks/sim_calibrate_cpu.py`."""
        m = self.hw.measured
        return bool(m) and "tok_s" in m

    def measured_step(self, prefill: list[tuple[int, int]], decode_ctx: float, decode_n: int) -> float:
        """One engine step of a mixed batch from the calibrated profile (no roofline).

        Decoding part: the measured decode steps (`decode_step_s`, per batch size at the
        calibration context `decode_ref_ctx`) interpolated in batch size, plus the context
        read beyond the calibration's at `attn_decode_s`, and what it reads short of it at that
        batch's own cost per context token (`_context_slopes`; `attn_decode_s` when the
        profile has no short-context curve); without measured points,
        the line `step_overhead_s + (per_seq_s + tok_s) x decode_n + attn_decode_s x decode_ctx`.
        Each prefill chunk adds `per_seq_s + tok_s x new` and its attention as the engine runs
        it on CPU (engine/model/attention.py, paged_prefix.py): over its own tokens the plain causal
        kernel, `attn_cold_s x new^2 / 2`; over a cached prefix an unmasked kernel that reads
        the prefix's blocks in place: its scores, `attn_prefill_s x new x prefix`, and its
        reads of the prefix's K and V, `attn_decode_s x prefix` as a decode's (measured, one
        thread, tiny model: a 32-token chunk over 2,048 cached tokens costs 3.7 ms more than
        the same chunk cold; the score term alone gives 2.1 ms, with the read 3.5 ms).
        `prefill` = (new, prefix) chunks; `decode_ctx` = the context tokens the decode attention
        of the `decode_n` decoding requests reads (as our engine reads it: groups of similar
        contexts padded to their longest, a prefix decodes share read once; agg.py counts it
        with `decode_groups.read_keys`)."""
        m = self.hw.measured
        if decode_n + len(prefill) == 0:
            return 0.0
        if m.get("cached_prefill") != CACHED_PREFILL_KERNEL:
            raise ValueError("the cpu-local profile was fitted to an older engine kernel for "
                             "prefill over a cached prefix (cached_prefill is not "
                             f"{CACHED_PREFILL_KERNEL!r}): rerun benchmarks/sim_calibrate_cpu.py")
        new = sum(n for n, _ in prefill)
        cold = sum(n * n / 2 for n, _ in prefill)
        cached = sum(n * p for n, p in prefill)
        read = sum(p for _, p in prefill)
        step = (m["per_seq_s"] * len(prefill) + m["tok_s"] * new + m["attn_cold_s"] * cold
                + m["attn_prefill_s"] * cached + m["attn_decode_s"] * read)
        curve = self._decode_curve
        if decode_n and curve:
            ref = m.get("decode_ref_ctx", m.get("prompt", 0))
            extra = decode_ctx - decode_n * ref
            slope = (max(interp(self._ctx_slope, decode_n), 0.0) if self._ctx_slope and extra < 0
                     else m["attn_decode_s"])
            return step + interp(curve, decode_n) + slope * extra
        return (step + m["step_overhead_s"] + (m["per_seq_s"] + m["tok_s"]) * decode_n
                + m["attn_decode_s"] * decode_ctx)
