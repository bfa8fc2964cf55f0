"""The published DEP8 points under what other sources measured of a DEP8 prefill rank, together.

The simulator misses the limited sweep's DEP8 prefill pools (P8/D16 c128: output +75%, TTFT
p50 4.6 s against 20.9 s; docs/sim/notebook.md, stops 37-44). Three facts about the reference's DEP8
prefill ranks that disagree with what the model takes from SPEC were each tried alone before
(stops 42-43, a sixth to a twelfth of the gap each): a third party's campaign of the same
manifests measured vLLM's KV footprint for GLM-5.2 at 54.6 KB a token (the model: 48,276 B, the
latent and indexer caches) and ~115K tokens of KV a single-node DEP8 prefill rank (the memory
model: SPEC's 182K); and the offloading connector's restore path before batched copies runs at
~211 ms/GB for GLM-5.2's 100 per-layer regions a block (SPEC: 26). This script runs the DEP8
points with them alone and together. It changes no default and fits nothing: SPEC's 182K is a
memory fact the memory model must reproduce (tests/sim/test_memory.py), so the smaller KV is
applied here from outside, by wrapping `run.plan_memory` for DEP8 prefill ranks.

Variants (each a point's `SimConfig` plus):
- `spec`: the model as it stands;
- `kv`: DEP8 prefill ranks hold `--kv-scale` of the memory model's KV (0.63: ~115K tokens, the
  third party's; 0.82: ~150K, the MTP head's layer on prefill ranks too, stop 42);
- `path`: the footprint (`--footprint` 1.13 = 54.6 KB / 48,276 B: every restored token moves
  1.13x the bytes and the 100 GiB tier holds 1/1.13 the tokens) at `--restore-ms-per-gb` 211;
- `all`: both.
`--kv-scale` applies to every point: a no-MTP point (the offloading A/B) loads no MTP head, so
under the 150K reading its `path` row is the one that applies.
Restored GiB are reported at the footprint's bytes, as the reference's metric would count them.

    .venv/bin/python benchmarks/sim_dep8_factors.py --duration 900 --seeds 2 \
        --out benchmarks/results/sim_dep8_factors.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from multiprocessing import Pool
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sim_published import POINTS

from _seeds import seed_mean

import agentserve.sim.run as simrun
from agentserve.sim.memory import MemoryPlan, Topology
from agentserve.sim.run import SimConfig, Simulation, session_stream

NAMES = ("lim P8/D16 c128", "lim P8/D8 c128", "offload A/B P8/D16 no-MTP CPU c128")
VARIANTS = ("spec", "kv", "path", "all")


def _scaled_plan_memory(scale: float):
    """`plan_memory` with DEP8 prefill ranks' KV scaled by `scale` (whole blocks)."""
    orig = simrun.plan_memory

    def plan(m, hw, t: Topology, **kw) -> MemoryPlan:
        p = orig(m, hw, t, **kw)
        if t.role == "prefill" and t.kind == "dep" and t.width == 8:
            bs = kw.get("block_size", 64)
            p = dataclasses.replace(p, kv_tokens=int(p.kv_tokens * scale) // bs * bs)
        return p
    return plan


def run(args: tuple) -> dict:
    """One seed of one point under one variant (in a worker process: the wrap stays there)."""
    name, variant, duration, seed, kv_scale, footprint, restore_ms = args
    over, c, _ = POINTS[name]
    kv = variant in ("kv", "all")
    path = variant in ("path", "all")
    simrun.plan_memory = _scaled_plan_memory(kv_scale if kv else 1.0)
    foot = footprint if path else 1.0
    gib = over.get("cpu_offload_gib", 100.0)
    cfg = SimConfig(concurrency=c, duration=duration, seed=seed,
                    **{**over, "cpu_offload_gib": gib / foot},
                    cpu_restore_s_per_gb=restore_ms / 1e3 * foot if path else None)
    s = Simulation(cfg, session_stream(cfg.workload, max(8, 2 * c), seed)).run()
    return {"name": name, "variant": variant, "seed": seed, "out": s["output_tok_s"],
            "ttft": s["ttft_s"]["p50"], "ttft_p90": s["ttft_s"]["p90"],
            "restore": s["cpu_restore_gib"] * foot, "gpu_hit": s["prefill_gpu_hit_rate"],
            "cpu_hit": s["prefill_cpu_hit_rate"] or 0.0, "prefill_busy": s["prefill_busy_frac"],
            "rejected": s["rejected_share"] or 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kv-scale", type=float, default=0.63, help="DEP8 prefill KV (115K / 183K)")
    ap.add_argument("--footprint", type=float, default=1.13, help="bytes a token (54.6K / 48,276)")
    ap.add_argument("--restore-ms-per-gb", type=float, default=211.0)
    ap.add_argument("--out", default="benchmarks/results/sim_dep8_factors.json")
    a = ap.parse_args()
    if not (0 < a.kv_scale <= 1 and a.footprint >= 1 and a.restore_ms_per_gb > 0 and a.seeds >= 1
            and a.duration >= 1 and a.workers >= 1):
        ap.error("need 0 < --kv-scale <= 1, --footprint >= 1, --restore-ms-per-gb > 0, --seeds >= 1, "
                 "--duration >= 1, --workers >= 1")
    jobs = [(n, v, a.duration, s, a.kv_scale, a.footprint, a.restore_ms_per_gb)
            for n in NAMES for v in VARIANTS for s in range(a.seeds)]
    # A fresh process per job: each sets its own plan_memory wrap.
    with Pool(a.workers, maxtasksperchild=1) as pool:
        runs = pool.map(run, jobs, chunksize=1)
    rows = {n: {v: seed_mean(runs, name=n, variant=v) for v in VARIANTS} for n in NAMES}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows, "runs": runs,
                                       "published": {n: POINTS[n][2] for n in NAMES}}, indent=2))
    t = Table(title=f"DEP8 points, {a.seeds} seeds x {a.duration:.0f} s: SPEC's model vs "
                    f"other sources' DEP8 prefill facts (kv x{a.kv_scale}, footprint x{a.footprint}, "
                    f"restore {a.restore_ms_per_gb:.0f} ms/GB)")
    for col in ("point", "variant", "output tok/s", "vs published", "TTFT p50 s", "restored GiB",
                "GPU / CPU hit", "rejected"):
        t.add_column(col)
    for n in NAMES:
        pub = POINTS[n][2]
        for v in VARIANTS:
            r = rows[n][v]
            err = f"{r['out'] / pub['out'] - 1:+.0%} ({pub['out']:,})" if "out" in pub else ""
            ttft = f"{r['ttft']:.2f}" + (f" ({pub['ttft']})" if "ttft" in pub else "")
            rest = f"{r['restore']:,.0f}" + (f" ({pub['restore']:,})" if "restore" in pub else "")
            t.add_row(n, v, f"{r['out']:,.0f}", err, ttft, rest,
                      f"{r['gpu_hit']:.3f} / {r['cpu_hit']:.3f}", f"{r['rejected']:.2%}")
    Console(width=170).print(t)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
