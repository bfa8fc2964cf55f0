"""SIM-1 on a lent GPU: the step model's GEMM term against one rank's real GEMMs.

The simulator prices a GLM-5.2 step's linear layers with one roofline per step at two global
factors (`sim/constants.py` `Efficiency`: `hbm` 0.80 of HBM bandwidth for streaming weights,
`flops` 0.55 of FP8 peak), both taken from published figures, none measured. One H200 can
run a DEP16 rank's share of those GEMMs at the model's own shapes (`sim/specs.py`
GLM_5_2_FP8): per layer the replicated attention projections (q_a, kv_a, q_b, the absorbed
MLA's bf16 W_UK / W_UV, o_proj, the indexer's projections), the router gate, the shared
expert, the rank's local experts (256 / 16) with the tokens the instance routes to them
(balanced: tokens x top_k / n_routed each), the dense FFN on the first layers, and the bf16
LM head, all with random FP8 weights (cuBLASLt through `torch._scaled_mm`; experts as one
grouped GEMM, `torch._scaled_grouped_mm`, where the build has it, else a loop). The whole step
is captured in a CUDA graph (vLLM replays decode steps from graphs) and timed by replay.

It reports, for decode loads (tokens on the rank = requests x (1 + MTP drafts)) and prefill
chunks: the measured time; the roofline of exactly these kernels at the model's factors
(`max(bytes / (bw x hbm), FLOPs / (peak x flops))` over the step, as `PerfModel` prices a
decode step's GEMMs); the factors this run implies (achieved bytes / s over peak bandwidth,
achieved FLOP/s over peak); and `PerfModel`'s own GEMM term for the same load, so the two byte
counts can be compared. Left out, as no kernel here is the deployment's: sparse MLA
attention and the indexer's logits (FlashMLA / DeepGEMM), the all-to-all, sampling. cuBLAS
is not DeepGEMM, so a factor measured here bounds what the deployment gets from below.

    python3 benchmarks/sim_gpu_rank.py --device cuda --out bench-out/sim_gpu_rank.json
    .venv/bin/python benchmarks/sim_gpu_rank.py --device cpu --scale 32 --layers 2 --decode 16 \
        --prefill 64 --out /tmp/rank.json     # a dry run of the script at toy sizes
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agentserve.sim.constants import Efficiency
from agentserve.sim.memory import Topology
from agentserve.sim.perf import PerfModel
from agentserve.sim.specs import GLM_5_2_FP8, H200, ModelSpec

FP8 = torch.float8_e4m3fn
PARTS = frozenset({"attn", "ffn", "experts", "head"})  # what a whole step runs (`Rank.step`)


def r16(x: float) -> int:
    """Round to a positive multiple of 16 (FP8 GEMMs want K and N divisible by 16)."""
    return max(16, int(round(x / 16)) * 16)


def scaled_spec(m: ModelSpec, scale: int, layers: int | None) -> ModelSpec:
    """The model with every width divided by `scale` (a dry run's toy sizes) and `layers`."""
    if scale == 1 and layers is None:
        return m
    s = scale
    return replace(m, hidden=r16(m.hidden / s), q_lora=r16(m.q_lora / s),
                   kv_lora=r16(m.kv_lora / s), rope_dim=r16(m.rope_dim / s),
                   nope_dim=r16(m.nope_dim / s), v_head_dim=r16(m.v_head_dim / s),
                   n_heads=max(1, m.n_heads // s), indexer_heads=r16(m.indexer_heads / s),
                   indexer_dim=r16(m.indexer_dim / s), vocab=r16(m.vocab / s),
                   expert_intermediate=r16(m.expert_intermediate / s),
                   dense_intermediate=r16(m.dense_intermediate / s),
                   n_routed=max(16, m.n_routed // s),
                   layers=layers or m.layers,
                   dense_layers=min(m.dense_layers, max(1, (layers or m.layers) // 2)))


@dataclass
class Tally:
    """Bytes and FLOPs of the kernels a step launches, by weight precision."""

    weight_bytes: float = 0.0
    act_bytes: float = 0.0
    fp8_flops: float = 0.0
    bf16_flops: float = 0.0
    kernels: int = 0


class Rank:
    """One DEPn rank's GEMM weights for the whole model (random, FP8 where the checkpoint is)."""

    def __init__(self, m: ModelSpec, width: int, device: torch.device, fp8: bool, grouped: bool):
        self.m, self.dev, self.fp8, self.grouped = m, device, fp8, grouped
        self.wdt = FP8 if fp8 else torch.bfloat16
        self.local = m.n_routed // width
        h, H = m.hidden, m.n_heads
        self.layers = []
        for li in range(m.layers):
            w = {"q_a": self._w(m.q_lora, h), "kv_a": self._w(m.kv_lora + m.rope_dim, h),
                 "q_b": self._w(H * (m.nope_dim + m.rope_dim), m.q_lora),
                 "o": self._w(h, H * m.v_head_dim),
                 "idx_q": self._w(m.indexer_heads * m.indexer_dim, m.q_lora),
                 "idx_k": self._w(m.indexer_dim, h), "idx_w": self._w(r16(m.indexer_heads), h)}
            # absorbed MLA: bf16 per-head W_UK (nope -> latent) and W_UV (latent -> v)
            w["uk"] = self._bf16(H, m.nope_dim, m.kv_lora)
            w["uv"] = self._bf16(H, m.kv_lora, m.v_head_dim)
            if li < m.dense_layers:
                w["ffn_gu"] = self._w(2 * m.dense_intermediate, h)
                w["ffn_d"] = self._w(h, m.dense_intermediate)
            else:
                w["gate"] = self._w(r16(m.n_routed), h)
                w["sh_gu"] = self._w(2 * m.expert_intermediate, h)
                w["sh_d"] = self._w(h, m.expert_intermediate)
                w["ex_gu"] = self._w(self.local, 2 * m.expert_intermediate, h)
                w["ex_d"] = self._w(self.local, h, m.expert_intermediate)
            self.layers.append(w)
        self.head = self._bf16(m.vocab, h)
        self.one = torch.ones((), dtype=torch.float32, device=device)

    def _w(self, *shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device=self.dev).uniform_(-1, 1)
        return t.to(self.wdt)

    def _bf16(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device=self.dev).uniform_(-1, 1)

    def weight_gib(self) -> float:
        n = sum(t.numel() * t.element_size() for w in self.layers for t in w.values())
        return (n + self.head.numel() * 2) / 2**30

    # -- one step ------------------------------------------------------------------------
    def inputs(self, tokens: int, per_expert: int) -> dict:
        """Activations for `tokens` rows on this rank and `per_expert` rows per local expert."""
        m, d = self.m, self.dev

        def act(rows: int, k: int) -> torch.Tensor:
            return torch.empty(rows, k, dtype=torch.bfloat16, device=d).uniform_(-1, 1).to(self.wdt)

        widths = {m.hidden, m.q_lora, m.n_heads * m.v_head_dim, m.expert_intermediate,
                  m.dense_intermediate}
        x = {k: act(tokens, k) for k in widths}
        ex = {k: act(per_expert * self.local, k) for k in (m.hidden, m.expert_intermediate)}
        rows = per_expert * self.local
        return {"x": x, "ex": ex, "tokens": tokens, "per_expert": per_expert,
                "qn": self._bf16(m.n_heads, tokens, m.nope_dim),
                "lat": self._bf16(m.n_heads, tokens, m.kv_lora),
                "hb": self._bf16(tokens, m.hidden),
                "offs": torch.arange(per_expert, rows + 1, max(1, per_expert), device=d,
                                     dtype=torch.int32)[: self.local],
                "sa": torch.ones(rows, dtype=torch.float32, device=d),
                "sb_gu": torch.ones(self.local, 2 * m.expert_intermediate, dtype=torch.float32,
                                    device=d),
                "sb_d": torch.ones(self.local, m.hidden, dtype=torch.float32, device=d)}

    def _mm(self, a: torch.Tensor, w: torch.Tensor, t: Tally) -> torch.Tensor:
        t.kernels += 1
        t.weight_bytes += w.numel() * w.element_size()
        t.act_bytes += a.numel() * a.element_size() + a.shape[0] * w.shape[0] * 2
        flops = 2.0 * a.shape[0] * a.shape[1] * w.shape[0]
        if self.fp8:
            t.fp8_flops += flops
            return torch._scaled_mm(a, w.t(), self.one, self.one, out_dtype=torch.bfloat16)
        t.bf16_flops += flops
        return a @ w.t()

    def _bmm(self, a: torch.Tensor, w: torch.Tensor, t: Tally) -> torch.Tensor:
        t.kernels += 1
        t.weight_bytes += w.numel() * 2
        t.act_bytes += a.numel() * 2 + a.shape[0] * a.shape[1] * w.shape[2] * 2
        t.bf16_flops += 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * w.shape[2]
        return torch.bmm(a, w)

    def _experts(self, a: torch.Tensor, w: torch.Tensor, sb: torch.Tensor, inp: dict,
                 t: Tally) -> None:
        pe = inp["per_expert"]
        if pe == 0:
            return
        if self.grouped:
            t.kernels += 1
            t.weight_bytes += w.numel() * w.element_size()
            t.act_bytes += a.numel() * a.element_size() + a.shape[0] * w.shape[1] * 2
            t.fp8_flops += 2.0 * a.shape[0] * a.shape[1] * w.shape[1]
            torch._scaled_grouped_mm(a, w.transpose(-2, -1), inp["sa"], sb, offs=inp["offs"],
                                     out_dtype=torch.bfloat16)
            return
        for e in range(self.local):
            self._mm(a[e * pe:(e + 1) * pe], w[e], t)

    def step(self, inp: dict, parts: frozenset[str] = PARTS) -> Tally:
        """Every GEMM of one forward of `inp["tokens"]` rows (no attention core, no comms);
        `parts` keeps some of them: "attn" (the attention and indexer projections), "ffn"
        (router gate, shared expert, dense FFN), "experts" (the local routed experts), "head"."""
        m, x, ex, t = self.m, inp["x"], inp["ex"], Tally()
        h, H = m.hidden, m.n_heads
        for w in self.layers:
            if "attn" in parts:
                self._mm(x[h], w["q_a"], t)
                self._mm(x[h], w["kv_a"], t)
                self._mm(x[m.q_lora], w["q_b"], t)
                self._mm(x[m.q_lora], w["idx_q"], t)
                self._mm(x[h], w["idx_k"], t)
                self._mm(x[h], w["idx_w"], t)
                self._bmm(inp["qn"], w["uk"], t)
                self._bmm(inp["lat"], w["uv"], t)
                self._mm(x[H * m.v_head_dim], w["o"], t)
            if "ffn_gu" in w:
                if "ffn" in parts:
                    self._mm(x[h], w["ffn_gu"], t)
                    self._mm(x[m.dense_intermediate], w["ffn_d"], t)
                continue
            if "ffn" in parts:
                self._mm(x[h], w["gate"], t)
                self._mm(x[h], w["sh_gu"], t)
                self._mm(x[m.expert_intermediate], w["sh_d"], t)
            if "experts" in parts:
                self._experts(ex[h], w["ex_gu"], inp["sb_gu"], inp, t)
                self._experts(ex[m.expert_intermediate], w["ex_d"], inp["sb_d"], inp, t)
        if "head" in parts:  # LM head, bf16
            t.kernels += 1
            t.weight_bytes += self.head.numel() * 2
            t.bf16_flops += 2.0 * inp["tokens"] * h * m.vocab
            inp["hb"] @ self.head.t()
        return t


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_step(rank: Rank, inp: dict, reps: int, graph: bool,
              parts: frozenset[str] = PARTS) -> tuple[float, Tally, bool]:
    """Median seconds of one step (CUDA graph replay where asked and possible)."""
    dev = rank.dev
    tally = rank.step(inp, parts)  # warm-up: cuBLAS picks its kernels, workspaces are allocated
    _sync(dev)
    run = lambda: rank.step(inp, parts)  # noqa: E731
    used_graph = False
    if graph and dev.type == "cuda":
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                rank.step(inp, parts)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                rank.step(inp, parts)
            run, used_graph = g.replay, True
        except RuntimeError as e:  # recorded, not hidden: the eager figure carries launch gaps
            print(f"CUDA graph capture failed ({e}); timing eagerly")
    run()
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tally, used_graph


def time_part(rank: Rank, inp: dict, args: argparse.Namespace, part: str, hw) -> dict:
    """One part of a step timed alone: its bytes, FLOPs and what share of peak it reaches."""
    sec, t, _ = time_step(rank, inp, args.reps, graph=not args.no_graph, parts=frozenset({part}))
    return {"part": part, "measured_s": sec, "kernels": t.kernels,
            "weight_gb": t.weight_bytes / 1e9, "act_gb": t.act_bytes / 1e9, **implied(t, sec, hw)}


def implied(t: Tally, sec: float, hw) -> dict:
    """The share of peak HBM bandwidth and of peak FLOP/s kernels of `t` reached in `sec`, as if
    the step were bound by that resource alone."""
    return {"implied_hbm": (t.weight_bytes + t.act_bytes) / sec / hw.hbm_bw,
            "implied_flops": (t.fp8_flops / hw.fp8_flops + t.bf16_flops / hw.bf16_flops) / sec}


def grouped_works(dev: torch.device) -> bool:
    """Whether this build runs an FP8 grouped GEMM here (SM90 CUTLASS kernels)."""
    if dev.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        a = torch.zeros(32, 64, device=dev).to(FP8)
        b = torch.zeros(2, 32, 64, device=dev).to(FP8)
        torch._scaled_grouped_mm(a, b.transpose(-2, -1), torch.ones(32, device=dev),
                                 torch.ones(2, 32, device=dev),
                                 offs=torch.tensor([16, 32], device=dev, dtype=torch.int32),
                                 out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return True
    except (RuntimeError, NotImplementedError) as e:
        print(f"no FP8 grouped GEMM here ({e}); experts run as a loop of GEMMs")
        return False


def copy_bandwidth(dev: torch.device, gib: int = 4) -> float:
    """GB/s of a device-to-device copy counting bytes read and written (median of 10): the
    streaming ceiling this chip shows to PyTorch, beside the datasheet's 4.8 TB/s."""
    a = torch.empty(gib * 2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * gib * 2**30 / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=16, help="DEP width whose rank is emulated")
    ap.add_argument("--decode", default="16,64,256",
                    help="decode loads: tokens on the rank (requests x (1 + drafts))")
    ap.add_argument("--prefill", default="2048,8192", help="prefill chunks: tokens on the rank")
    ap.add_argument("--scale", type=int, default=1, help="divide every width (dry runs)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (dry runs)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--parts", action="store_true",
                    help="also time each part of a decode step alone (attn, ffn, experts, head)")
    ap.add_argument("--out", default="bench-out/sim_gpu_rank.json")
    args = ap.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    m = scaled_spec(GLM_5_2_FP8, args.scale, args.layers)
    if m.n_routed % args.width:
        raise SystemExit(f"{m.n_routed} experts do not split over {args.width} ranks")
    fp8 = hasattr(torch, "_scaled_mm")  # FP8 GEMMs (CPU builds have them too, for dry runs)
    grouped = grouped_works(dev)
    t0 = time.perf_counter()
    rank = Rank(m, args.width, dev, fp8, grouped)
    _sync(dev)
    print(f"{m.name} rank of DEP{args.width}: {rank.weight_gib():.1f} GiB of weights "
          f"in {time.perf_counter() - t0:.1f} s; experts {'grouped' if grouped else 'looped'}")

    eff, hw = Efficiency(), H200
    stream = copy_bandwidth(dev) if dev.type == "cuda" else None
    loads = [("decode", int(x)) for x in args.decode.split(",") if x] + \
            [("prefill", int(x)) for x in args.prefill.split(",") if x]
    rows = []
    for phase, tok in loads:
        total = tok * args.width  # the instance's tokens; each local expert gets its share
        per_expert = math.ceil(total * m.top_k / m.n_routed)
        inp = rank.inputs(tok, per_expert)
        experts = "grouped" if rank.grouped else "loop"
        try:
            sec, t, used_graph = time_step(rank, inp, args.reps, graph=not args.no_graph)
        except RuntimeError as e:
            if not rank.grouped:
                raise
            # a grouped kernel that refuses this shape (rows per expert, say): loop, and say so
            print(f"{phase} {tok}: grouped experts failed ({e}); this load loops over them")
            rank.grouped, experts = False, "loop"
            sec, t, used_graph = time_step(rank, inp, args.reps, graph=not args.no_graph)
            rank.grouped = grouped
        byts = t.weight_bytes + t.act_bytes
        t_bytes = byts / (hw.hbm_bw * eff.hbm)
        t_flops = (t.fp8_flops / (hw.fp8_flops * eff.flops)
                   + t.bf16_flops / (hw.bf16_flops * eff.flops))
        # PerfModel's own GEMM term for this load (decode: weights touched vs linear FLOPs)
        role = "decode" if phase == "decode" else "prefill"
        pm = PerfModel(model=m, hw=hw, topo=Topology("dep", args.width, role))
        pm_bytes = pm.rank_weight_bytes(pm._touched(total))
        pm_flops = tok * pm._lin_flops_rank() + total * pm._routed_flops() / args.width
        pm_s = max(pm_bytes / (hw.hbm_bw * eff.hbm), pm_flops / pm._lin_rate())
        rows.append({
            "phase": phase, "tokens_rank": tok, "tokens_per_expert": per_expert,
            "measured_s": sec, "cuda_graph": used_graph, "kernels": t.kernels,
            "experts": experts,
            "weight_gb": t.weight_bytes / 1e9, "act_gb": t.act_bytes / 1e9,
            "fp8_tflop": t.fp8_flops / 1e12, "bf16_tflop": t.bf16_flops / 1e12,
            "roofline_s": max(t_bytes, t_flops),
            "bound": "bytes" if t_bytes >= t_flops else "flops",
            "measured_over_roofline": sec / max(t_bytes, t_flops),
            **implied(t, sec, hw),  # what this run implies for each factor
            "perfmodel_gemm_s": pm_s, "perfmodel_weight_gb": pm_bytes / 1e9,
        })
        if args.parts and phase == "decode":
            rows[-1]["parts"] = [time_part(rank, inp, args, p, hw) for p in sorted(PARTS)]
        del inp
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__,
           "model": asdict(m) if args.scale > 1 or args.layers else m.name,
           "width": args.width, "fp8": fp8, "experts": "grouped" if grouped else "loop",
           "copy_gb_s": stream, "efficiency": {"hbm": eff.hbm, "flops": eff.flops},
           "peaks": {"hbm_bw": hw.hbm_bw, "fp8_flops": hw.fp8_flops, "bf16_flops": hw.bf16_flops},
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))

    tab = Table(title=f"one DEP{args.width} rank's GEMMs on {res['device']} "
                      f"({res['experts']} experts)")
    for c in ("phase", "tok/rank", "tok/expert", "measured ms", "roofline ms", "bound",
              "meas/roof", "hbm implied", "flops implied", "PerfModel ms", "weights GB (PM)"):
        tab.add_column(c, justify="right")
    for r in rows:
        tab.add_row(r["phase"], str(r["tokens_rank"]), str(r["tokens_per_expert"]),
                    f"{r['measured_s'] * 1e3:.2f}", f"{r['roofline_s'] * 1e3:.2f}", r["bound"],
                    f"{r['measured_over_roofline']:.2f}", f"{r['implied_hbm']:.2f}",
                    f"{r['implied_flops']:.2f}", f"{r['perfmodel_gemm_s'] * 1e3:.2f}",
                    f"{r['weight_gb']:.1f} ({r['perfmodel_weight_gb']:.1f})")
    Console(width=170).print(tab)
    parts = Table(title="decode steps by part, each timed alone")
    for c in ("tok/rank", "part", "kernels", "measured ms", "weights GB", "hbm implied",
              "flops implied"):
        parts.add_column(c, justify="right")
    for r in rows:
        for p in r.get("parts", []):
            parts.add_row(str(r["tokens_rank"]), p["part"], str(p["kernels"]),
                          f"{p['measured_s'] * 1e3:.2f}", f"{p['weight_gb']:.2f}",
                          f"{p['implied_hbm']:.2f}", f"{p['implied_flops']:.2f}")
    if parts.row_count:
        Console(width=170).print(parts)
    if stream:
        print(f"device-to-device copy: {stream:,.0f} GB/s (read + written) = "
              f"{stream * 1e9 / hw.hbm_bw:.2f} of the datasheet's bandwidth")


if __name__ == "__main__":
    main()
