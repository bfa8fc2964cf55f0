"""How busy AIPerf's agentic lanes are: published AgentX runs against the simulator (SIM-1, stop 30).

A lane of `aiperf profile --scenario inferencex-agentx-mvp` holds one trace and waits each
recorded think time, so the share of its time it has a request in flight (its duty) is a
property of the corpus and of AIPerf's gap rules as much as of the server. Little's law gives
it from any run's published figures:

    decode duty = output tok/s / lanes x ITL p50          (time a lane spends decoding)
    lane duty   = decode duty + requests/s / lanes x TTFT p50   (plus waiting for a first token)

Medians stand in for means, so both are estimates; the script prints, for the simulator, the
estimate beside its time-averaged requests in flight per lane, which measures the bias.

The published rows are the AgentX runs at hand with throughput, ITL and TTFT: the reference
(SPEC.md's calibration table, request counts from the guide's table); the ROCm ATOM project's
DeepSeek-V4-Pro agentic recipe on 8 MI355X (ATOM PR 1640, the same scenario on the dated corpus
`semianalysis_cc_traces_weka_062126`, 3,600 s stages; its vLLM rows, one of them from
InferenceX CI run 28911223583); and InferenceX PR 2275's GLM-5.2 H200 P/D sweep (SGLang, full
context; mean TPOT and TTFT, no request rate, so decode duty only). Nothing here sets a constant.

    .venv/bin/python benchmarks/sim_lane_duty.py --duration 900 --out benchmarks/results/sim_lane_duty.json
"""

from __future__ import annotations

import argparse
import json
from multiprocessing import Pool
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _seeds import seed_mean

from agentserve.sim.run import SimConfig, simulate

# (source, lanes, output tok/s, ITL p50 ms, TTFT p50 s, requests/s or None)
PUBLISHED = [
    ("reference GLM-5.2 3P1D (SPEC)", 16, 1167, 11.7, 1.50, None),
    ("reference GLM-5.2 3P1D (SPEC)", 64, 3679, 15.5, 1.71, 3543 / 900),
    ("reference GLM-5.2 3P1D (SPEC)", 128, 6281, 19.1, 2.18, 6242 / 900),
    ("ATOM PR1640 DSv4-Pro MI355X TP8", 1, 53.7, 16.1, 1.42, 0.039),
    ("ATOM PR1640 DSv4-Pro MI355X TP8", 8, 351.6, 22.6, 1.05, 0.388),
    ("ATOM PR1640 DSv4-Pro MI355X TP8", 16, 471.5, 29.8, 1.32, 0.501),
    ("ATOM PR1640 DSv4-Pro MI355X TP8", 48, 680.4, 54.7, 1.99, 0.776),
    ("vLLM DSv4-Pro MI355X TP8, util 0.9", 48, 549.8, 89.0, 0.89, 0.658),
    ("vLLM DSv4-Pro MI355X TP8, InferenceX CI", 48, 197.6, 155.0, 1.60, 0.291),
    # GLM-5.2 on H200, P/D (8 PCP prefill + 16 TP decode GPUs, SGLang), full context; mean TPOT
    # in place of ITL p50, mean TTFT; request rate not published (InferenceX PR 2275)
    ("SGLang GLM-5.2 H200 P/D, InferenceX PR 2275", 1, 45.90, 19.85, 3.59, None),
    ("SGLang GLM-5.2 H200 P/D, InferenceX PR 2275", 2, 95.33, 21.91, 2.88, None),
    ("SGLang GLM-5.2 H200 P/D, InferenceX PR 2275", 3, 128.95, 22.12, 3.82, None),
]
CAPS = {"none": None, "60 s": 60.0, "10 s": 10.0}  # AIPerf's per-trace idle-gap cap, by version


def duty(lanes: int, out: float, itl_ms: float, ttft: float, rps: float | None) -> tuple[float, float | None]:
    """(decode duty, lane duty) by Little's law from a run's published figures."""
    d = out / lanes * itl_ms / 1e3
    return d, (None if rps is None else d + rps / lanes * ttft)


def point(args: tuple[int, str, float, int]) -> dict:
    c, cap, duration, seed = args
    s = simulate(SimConfig(concurrency=c, duration=duration, seed=seed, idle_gap_cap_s=CAPS[cap]))
    rps = s["requests_ok"] / duration
    dd, ld = duty(c, s["output_tok_s"], s["itl_ms"]["p50"], s["ttft_s"]["p50"], rps)
    return {"concurrency": c, "cap": cap, "seed": seed, "output_tok_s": s["output_tok_s"],
            "itl_p50_ms": s["itl_ms"]["p50"], "ttft_p50_s": s["ttft_s"]["p50"], "requests_s": rps,
            "decode_duty": dd, "lane_duty": ld, "in_flight_per_lane": s["requests_in_flight"] / c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--concurrency", default="16,64,128")
    ap.add_argument("--caps", default=",".join(CAPS), help=f"idle-gap caps to simulate, of {list(CAPS)}")
    ap.add_argument("--out", default="benchmarks/results/sim_lane_duty.json")
    a = ap.parse_args()
    caps = a.caps.split(",")
    if unknown := [k for k in caps if k not in CAPS]:
        ap.error(f"unknown cap(s) {unknown}; choose from {list(CAPS)}")
    cs = [int(x) for x in a.concurrency.split(",")]
    jobs = [(c, k, a.duration, sd) for k in caps for c in sorted(cs, reverse=True) for sd in range(a.seeds)]
    with Pool(2) as pool:
        runs = pool.map(point, jobs)
    sim = []
    for k in caps:
        for c in cs:
            sim.append({**seed_mean(runs, cap=k, concurrency=c), "concurrency": c, "cap": k})
    pub = []
    for src, c, out, itl, ttft, rps in PUBLISHED:
        dd, ld = duty(c, out, itl, ttft, rps)
        pub.append({"source": src, "concurrency": c, "output_tok_s": out, "itl_p50_ms": itl,
                    "ttft_p50_s": ttft, "requests_s": rps, "decode_duty": dd, "lane_duty": ld})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"duration": a.duration, "seeds": a.seeds, "published": pub,
                                      "simulated": sim}, indent=2))
    t = Table(title=f"lane duty by Little's law; simulator: 3P1D calibration, {a.duration:.0f} s, "
                    f"mean of {a.seeds} seeds")
    for col in ("run", "lanes", "out tok/s", "ITL p50 ms", "TTFT p50 s", "req/s",
                "decode duty", "lane duty", "in flight / lane"):
        t.add_column(col, justify="right")
    for r in pub:
        t.add_row(r["source"], str(r["concurrency"]), f"{r['output_tok_s']:,.0f}", f"{r['itl_p50_ms']:.1f}",
                  f"{r['ttft_p50_s']:.2f}", "" if r["requests_s"] is None else f"{r['requests_s']:.3f}",
                  f"{r['decode_duty']:.2f}", "" if r["lane_duty"] is None else f"{r['lane_duty']:.2f}", "")
    for r in sim:
        t.add_row(f"simulator, idle-gap cap {r['cap']}", str(r["concurrency"]), f"{r['output_tok_s']:,.0f}",
                  f"{r['itl_p50_ms']:.1f}", f"{r['ttft_p50_s']:.2f}", f"{r['requests_s']:.3f}",
                  f"{r['decode_duty']:.2f}", f"{r['lane_duty']:.2f}", f"{r['in_flight_per_lane']:.2f}")
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
