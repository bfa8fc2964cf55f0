"""Which load generator the reference ran: AIPerf's agentic replay or a closed loop (SIM-1, stop 27).

SPEC.md describes the reference's benchmark as "C simulated clients, each keeping one request
active"; the reference's own aiperf command runs `--scenario inferencex-agentx-mvp`, whose lanes
pause for each trace's recorded think time and run sub-agents in parallel (sim/lanes.py). This
script drives the calibration deployment (3P1D DEP16, MTP, 100 GiB CPU tier, full inputs) with
both, on the same corpus, and prints what the load itself looks like beside the reference's
published load figures: requests sent, input tok/s and the input median over the stage's
requests. Nothing here sets a constant.

    .venv/bin/python docs/studies/sim_clients/sim_clients.py --duration 900 --out docs/studies/sim_clients/sim_clients.json
"""

from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # the suite's helpers
from _seeds import seed_mean  # noqa: E402

from agentserve.sim.config import IDLE_GAP_CAP_S, parse_idle_gap_cap
from agentserve.sim.run import SimConfig, Simulation, session_stream

# SPEC.md, calibration run; requests from the guide's table (900 s profiled); None: not published
REFERENCE = {16: {"requests": None, "input_tok_s": 86_000, "output_tok_s": 1167},
             64: {"requests": 3543, "input_tok_s": None, "output_tok_s": 3679},
             128: {"requests": 6242, "input_tok_s": 431_000, "output_tok_s": 6281}}
SPEC_INPUT_P50 = (47_000, 57_000)  # "median input 47K-57K" over the stage's requests
CLIENTS = ("agentx", "closed")


def run(args: tuple[int, str, float, int, float | None]) -> dict:
    c, clients, duration, seed, idle_cap = args
    cfg = SimConfig(concurrency=c, duration=duration, seed=seed, clients=clients,
                    idle_gap_cap_s=idle_cap)
    sim = Simulation(cfg, session_stream(cfg.workload, max(8, 2 * c), seed))
    s = sim.run()
    ins = [r.input_tokens for r in sim.records if sim.counted(r.start, r.end)]
    return {"concurrency": c, "clients": clients, "seed": seed, "requests": s["requests_ok"],
            "input_tok_s": s["input_tok_s"], "output_tok_s": s["output_tok_s"],
            "input_p50": float(np.median(ins)) if ins else 0.0,
            "ttft_p50_s": s["ttft_s"]["p50"], "itl_p50_ms": s["itl_ms"]["p50"],
            "in_flight_per_client": s["requests_in_flight"] / c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--concurrency", default="16,64,128", help="comma-separated, of 16, 64, 128")
    ap.add_argument("--idle-gap-cap-s", type=parse_idle_gap_cap, default=IDLE_GAP_CAP_S,
                    help="the replay's per-trace idle-gap cap, s or off (SimConfig.idle_gap_cap_s)")
    ap.add_argument("--out", default="docs/studies/sim_clients/sim_clients.json")
    a = ap.parse_args()
    conc = [int(c) for c in a.concurrency.split(",")]
    if not set(conc) <= set(REFERENCE):
        ap.error(f"--concurrency: the reference published 16, 64 and 128, got {a.concurrency}")
    jobs = [(c, k, a.duration, sd, a.idle_gap_cap_s) for c in conc for k in CLIENTS
            for sd in range(a.seeds)]
    with Pool(2) as pool:
        runs = pool.map(run, jobs)
    rows = []
    for c in conc:
        for k in CLIENTS:
            rows.append({"concurrency": c, "clients": k,
                         **seed_mean(runs, concurrency=c, clients=k)})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"duration": a.duration, "seeds": a.seeds,
                                       "idle_gap_cap_s": a.idle_gap_cap_s, "rows": rows,
                                       "reference": REFERENCE, "spec_input_p50": SPEC_INPUT_P50},
                                      indent=2))
    t = Table(title=f"load generators on the calibration deployment, {a.duration:.0f} simulated s, "
                    f"{a.seeds} seed(s) (reference)")
    for col in ("c", "clients", "requests", "input tok/s", "input p50", "output tok/s",
                "TTFT p50 s", "ITL p50 ms", "in flight / client"):
        t.add_column(col, justify="right")
    for r in rows:
        ref = REFERENCE[r["concurrency"]]

        def cell(k: str, v: float) -> str:
            return f"{v:,.0f}" + (f" ({ref[k]:,}, {v / ref[k] - 1:+.0%})" if ref.get(k) else "")
        t.add_row(str(r["concurrency"]), r["clients"], cell("requests", r["requests"]),
                  cell("input_tok_s", r["input_tok_s"]),
                  f"{r['input_p50'] / 1e3:.0f}K (47-57K)", cell("output_tok_s", r["output_tok_s"]),
                  f"{r['ttft_p50_s']:.2f}", f"{r['itl_p50_ms']:.1f}", f"{r['in_flight_per_client']:.2f}")
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
