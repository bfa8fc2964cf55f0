"""SIM-1 calibration check: 3P1D DEP16 (MTP, 100 GiB CPU tier) at c16/c64/c128 against SPEC.md.

Prints simulated vs reference output tok/s, ITL p50, TTFT p50 and cost with the relative error,
and writes JSON. Two worker processes (the machine has two cores).

    .venv/bin/python benchmarks/sim_calibration.py --duration 900 --out benchmarks/results/sim_calibration.json

`--trends` instead runs the kinds of configuration SPEC.md holds back (more decoders, narrower
pools, MTP off, offload off, limited inputs) at c64/c128 with the same constants, for the
direction of each change (no reference numbers are published for them):

    .venv/bin/python benchmarks/sim_calibration.py --trends --out benchmarks/results/sim_trends.json
"""

from __future__ import annotations

import argparse
import json
from multiprocessing import Pool
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentserve.sim.config import IDLE_GAP_CAP_S, ROUTE_MISS, parse_efficiency, parse_idle_gap_cap
from agentserve.sim.run import SimConfig, simulate

# SPEC.md "Reference scale", calibration run (None: not published)
REFERENCE = {
    16: {"output_tok_s": 1167, "itl_p50_ms": 11.7, "ttft_p50_s": 1.5, "input_tok_s": 86_000,
         "ttft_p90_s": 4.3, "itl_p90_ms": 14.4},
    64: {"output_tok_s": 3679, "itl_p50_ms": 15.5, "ttft_p50_s": 1.71, "input_tok_s": None,
         "ttft_p90_s": 6.36, "itl_p90_ms": 18.9, "e2e_p50_s": 9.6, "requests": 3543,
         "out_per_request": 935},
    128: {"output_tok_s": 6281, "itl_p50_ms": 19.1, "ttft_p50_s": 2.18, "input_tok_s": 431_000,
          "cost_in": 0.08, "cost_out": 1.92, "ttft_p90_s": 15.82, "itl_p90_ms": 23.1,
          "e2e_p50_s": 14.0, "output_tok_s_per_user": 36.6, "prompt_tokens_in_flight": 14.1e6,
          "requests": 6242, "out_per_request": 906},
}


# name -> SimConfig overrides of the calibration deployment (3P1D DEP16, MTP, 100 GiB CPU tier)
TRENDS = {
    "3P1D (calibration)": {},
    "3P2D (more decoders, 80 GPUs)": {"decode": 2},
    "2P2D (more decoders, 64 GPUs)": {"prefill": 2, "decode": 2},
    "6P2D DEP8 (narrower pools)": {"prefill": 6, "prefill_width": 8, "decode": 2, "decode_width": 8},
    "MTP off": {"mtp": False},
    "CPU offload off": {"cpu_offload_gib": 0.0},
    "limited inputs (<142K)": {"workload": "sweep-limited"},
}


def point(args: tuple) -> dict:
    c, duration, seed, warmup, *over = args
    s = simulate(SimConfig(concurrency=c, duration=duration, seed=seed, warmup=warmup,
                           **(over[0] if over else {})))
    return {"concurrency": c, "output_tok_s": s["output_tok_s"], "input_tok_s": s["input_tok_s"],
            "itl_p50_ms": s["itl_ms"]["p50"], "ttft_p50_s": s["ttft_s"]["p50"],
            "ttft_p90_s": s["ttft_s"]["p90"], "ttft_mean_s": s["ttft_s"]["mean"],
            "itl_token_mean_ms": s["itl_token_ms"]["mean"], "cost_in": s["cost_per_m_input"],
            "cost_out": s["cost_per_m_output"], "decode_busy_frac": s["decode_busy_frac"],
            "prefill_busy_frac": s["prefill_busy_frac"], "prefill_gpu_hit_rate": s["prefill_gpu_hit_rate"],
            "captured_reuse": s["captured_reuse"], "mean_input": s["input_tokens"] / max(1, s["requests_ok"]),
            "mean_output": s["output_tokens"] / max(1, s["requests_ok"]),
            # the reference's table: answered requests, and output tok/s x the stage / requests
            "requests": s["requests_ok"],
            "out_per_request": s["output_tok_s"] * duration / max(1, s["requests_ok"]),
            "cpu_write_tb": s.get("cpu_write_tb"),
            "itl_p90_ms": s["itl_ms"]["p90"], "e2e_p50_s": s["e2e_s"]["p50"],
            "output_tok_s_per_user": s["output_tok_s_per_user"]["mean"],
            "decode_preemptions": s["decode_preemptions"], "ttft_phases_s": s["ttft_phases_s"],
            "rejected_share": s["rejected_share"] or 0.0,
            "decode_local_hit_rate": s["decode_local_hit_rate"] or 0.0,
            "requests_in_flight": s["requests_in_flight"],
            "prompt_tokens_in_flight": s["prompt_tokens_in_flight"]}


def _mean(runs: list[dict]) -> dict:
    """Mean over seeds of every number (phases too); the per-seed values under `seeds`."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "concurrency":
            out[k] = sum(r[k] for r in runs) / len(runs)
    out["ttft_phases_s"] = {ph: {q: sum(r["ttft_phases_s"][ph][q] for r in runs) / len(runs)
                                 for q in ("mean", "p50")} for ph in runs[0]["ttft_phases_s"]}
    out["seeds"] = [{k: r[k] for k in ("output_tok_s", "itl_p50_ms", "ttft_p50_s", "input_tok_s")}
                    for r in runs]
    return out


def _err(sim: float, ref: float | None) -> str:
    return "" if not ref else f"{(sim / ref - 1) * 100:+.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per point (a 600 s stage's heavy-tailed "
                    "inputs move output tok/s by ~5%% from seed to seed); the table shows their mean")
    ap.add_argument("--warmup", type=float, default=None, help="simulated s before the stage (None: the default)")
    ap.add_argument("--out", default="benchmarks/results/sim_calibration.json")
    ap.add_argument("--trends", action="store_true", help="run TRENDS at c64/c128 instead")
    ap.add_argument("--replay-run", type=int, default=None,
                    help="turns per replayed run (default: the simulator's REPLAY_RUN); a larger "
                    "value starts fewer cold conversations: how the TTFT tail moves ITL and output")
    ap.add_argument("--idle-gap-cap-s", type=parse_idle_gap_cap, default=IDLE_GAP_CAP_S,
                    help="AIPerf's per-trace idle-gap cap, s or off (SimConfig.idle_gap_cap_s)")
    ap.add_argument("--route-miss", type=float, default=ROUTE_MISS,
                    help="share of prefill picks made on load alone (SimConfig.route_miss)")
    ap.add_argument("--efficiency", type=parse_efficiency, default=None,
                    help="what-if factors, e.g. hbm=0.5 (SimConfig.efficiency; default: the model's)")
    a = ap.parse_args()
    if a.trends:
        return trends(a)
    seeds = range(a.seed, a.seed + a.seeds)
    with Pool(2) as pool:
        over = {} if a.replay_run is None else {"replay_run": a.replay_run}
        over["idle_gap_cap_s"] = a.idle_gap_cap_s
        over["route_miss"] = a.route_miss
        over["efficiency"] = a.efficiency
        runs = pool.map(point, [(c, a.duration, sd, a.warmup, over) for c in (128, 64, 16) for sd in seeds])
    rows = [_mean([r for r in runs if r["concurrency"] == c]) for c in (16, 64, 128)]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"duration": a.duration, "warmup": a.warmup, "seeds": list(seeds),
                                      "replay_run": a.replay_run,
                                      "idle_gap_cap_s": a.idle_gap_cap_s,
                                      "route_miss": a.route_miss, "efficiency": a.efficiency,
                                      "rows": rows,
                                      "reference": REFERENCE},
                                      indent=2))
    rr = "" if a.replay_run is None else f", runs of {a.replay_run} turns"
    rr += ", no idle-gap cap" if a.idle_gap_cap_s is None else f", idle-gap cap {a.idle_gap_cap_s:g} s"
    rr += f", route miss {a.route_miss:g}"
    rr += f", efficiency {a.efficiency}" if a.efficiency else ""
    t = Table(title=f"3P1D DEP16 calibration, {a.duration:.0f} simulated s, mean of {a.seeds} seeds{rr}")
    keys = ("output_tok_s", "itl_p50_ms", "ttft_p50_s", "input_tok_s", "cost_in", "cost_out",
            "ttft_p90_s", "itl_p90_ms", "e2e_p50_s", "output_tok_s_per_user", "prompt_tokens_in_flight",
            "requests", "out_per_request")
    for col in ("c",) + keys:
        t.add_column(col, justify="right")
    for r in rows:
        ref = REFERENCE[r["concurrency"]]
        t.add_row(str(r["concurrency"]), *[f"{r[k]:,.3g} ({_err(r[k], ref.get(k))})" for k in keys])
    Console(width=220).print(t)
    for r in rows:
        print({k: r[k] for k in ("concurrency", "mean_input", "mean_output", "prefill_gpu_hit_rate", "captured_reuse",
                                 "decode_busy_frac", "prefill_busy_frac", "cpu_write_tb", "decode_preemptions")})
        print("  TTFT phases (mean / p50 s):", {k: (round(v["mean"], 3), round(v["p50"], 3))
                                                for k, v in r["ttft_phases_s"].items()})


def trends(a: argparse.Namespace) -> None:
    jobs = [(c, a.duration, a.seed, a.warmup, over) for over in TRENDS.values() for c in (128, 64)]
    with Pool(2) as pool:
        rows = pool.map(point, jobs)
    out = []
    for (c, *_, over), r in zip(jobs, rows):
        name = next(k for k, v in TRENDS.items() if v is over)
        out.append({"config": name, "overrides": over, **{k: v for k, v in r.items() if k != "ttft_phases_s"}})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"duration": a.duration, "warmup": a.warmup, "rows": out}, indent=2))
    t = Table(title=f"held-back kinds of configuration, {a.duration:.0f} simulated s (no reference numbers)")
    keys = ("output_tok_s", "input_tok_s", "itl_p50_ms", "ttft_p50_s", "ttft_p90_s",
            "output_tok_s_per_user", "prefill_gpu_hit_rate", "decode_preemptions", "rejected_share")
    for col in ("config", "c") + keys:
        t.add_column(col, justify="right")
    for r in out:
        t.add_row(r["config"], str(r["concurrency"]),
                  *[f"{r[k]:,.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys])
    Console(width=220).print(t)


if __name__ == "__main__":
    main()
