"""How much of the simulator's TTFT gap is where decode ranks are picked (SIM-1, stops 26-27).

llm-d's decode profile weighs requests in flight only (`active-request-scorer`, counted from the
gateway's routing until the response completes). The reference measured a decode-local prefix
hit of 0.513 at c64 and 0.446 at c128 (limited inputs, DEP16 1P1D; llm-d blog "Serving GLM-5.2
for Agentic Workloads on llm-d", 2026-07-22). Driven by a closed loop with no think time (stop
26) the simulator's next turn went straight back to the rank its client had just freed (hit
~0.93); driven by AIPerf's agentic replay (stop 27, the reference's load generator) a client
returns after its recorded think time, when other requests have moved the load, and the hit
falls to 0.20-0.32, below the reference's.

This script runs each point twice: with the reference's decode scorers, and with every decode
rank scored alike (`SimConfig.decode_scorers={}`: the max-score picker then draws the rank at
random, the least sticky placement there is). It is a diagnostic: the counterfactual is not the
reference's mechanism and sets no constant.

    .venv/bin/python benchmarks/sim_decode_locality.py --duration 900 --out benchmarks/results/sim_decode_locality.json
"""

from __future__ import annotations

import json
from multiprocessing import Pool
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _seeds import seed_mean
from sim_published import POINTS, parse_args

from agentserve.sim.run import SimConfig, simulate

# published points (sim_published.POINTS: overrides, concurrency, figures) on the calibration
# layout and the limited 1P1D sweep, where the reference reports its decode-local hit
NAMES = ("full 3P1D c16", "full 3P1D c64", "full 3P1D c128", "lim 1P1D MTP c64", "lim 1P1D MTP c128")
PICKERS = {"llm-d": None, "random": {}}
METRICS = ("dlocal", "ttft", "itl", "out")


def run(args: tuple) -> dict:
    name, picker, duration, seed = args
    over, c, _ = POINTS[name]
    s = simulate(SimConfig(concurrency=c, duration=duration, seed=seed,
                           decode_scorers=PICKERS[picker], **over))
    return {"name": name, "picker": picker, "seed": seed, "dlocal": s["decode_local_hit_rate"],
            "ttft": s["ttft_s"]["p50"], "itl": s["itl_ms"]["p50"], "out": s["output_tok_s"],
            "pd_transfer_mean_s": s["ttft_phases_s"]["pd_transfer"]["mean"]}


def main() -> None:
    a, names = parse_args(__doc__, "benchmarks/results/sim_decode_locality.json", NAMES)
    jobs = [(n, p, a.duration, sd) for n in names for p in PICKERS for sd in range(a.seeds)]
    with Pool(2) as pool:
        runs = pool.map(run, jobs)
    rows: dict[str, dict[str, dict]] = {}
    for n in names:
        for p in PICKERS:
            rows.setdefault(n, {})[p] = seed_mean(runs, name=n, picker=p)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"duration": a.duration, "seeds": a.seeds, "rows": rows,
                                       "published": {n: POINTS[n][2] for n in names}}, indent=2))
    t = Table(title=f"decode placement: llm-d's picker / random ranks (published), "
                    f"{a.duration:.0f} simulated s, {a.seeds} seed(s)")
    for col in ("point",) + METRICS + ("P->D phase mean s",):
        t.add_column(col, justify="right")
    for n in names:
        sim, pub = rows[n], POINTS[n][2]

        def cell(k: str) -> str:
            v = " / ".join(f"{sim[p][k]:,.3g}" for p in PICKERS)
            return f"{v} ({pub[k]:,})" if k in pub else v
        t.add_row(n, *[cell(k) for k in METRICS],
                  " / ".join(f"{sim[p]['pd_transfer_mean_s']:.2f}" for p in PICKERS))
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
