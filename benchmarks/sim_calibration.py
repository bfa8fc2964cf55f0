"""SIM-1 calibration check: 3P1D DEP16 (MTP, 100 GiB CPU tier) at c16/c64/c128 against SPEC.md.

Prints simulated vs reference output tok/s, ITL p50, TTFT p50 and cost with the relative error,
and writes JSON. Two worker processes (the machine has two cores).

    .venv/bin/python benchmarks/sim_calibration.py --duration 900 --out benchmarks/results/sim_calibration.json
"""

from __future__ import annotations

import argparse
import json
from multiprocessing import Pool
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentserve.sim.run import SimConfig, simulate

# SPEC.md "Reference scale", calibration run (None: not published)
REFERENCE = {
    16: {"output_tok_s": 1167, "itl_p50_ms": 11.7, "ttft_p50_s": 1.5, "input_tok_s": 86_000},
    64: {"output_tok_s": 3679, "itl_p50_ms": 15.5, "ttft_p50_s": 1.71, "input_tok_s": None},
    128: {"output_tok_s": 6281, "itl_p50_ms": 19.1, "ttft_p50_s": 2.18, "input_tok_s": 431_000,
          "cost_in": 0.08, "cost_out": 1.92},
}


def point(args: tuple[int, float, int]) -> dict:
    c, duration, seed = args
    s = simulate(SimConfig(concurrency=c, duration=duration, seed=seed))
    return {"concurrency": c, "output_tok_s": s["output_tok_s"], "input_tok_s": s["input_tok_s"],
            "itl_p50_ms": s["itl_ms"]["p50"], "ttft_p50_s": s["ttft_s"]["p50"],
            "ttft_p90_s": s["ttft_s"]["p90"], "cost_in": s["cost_per_m_input"],
            "cost_out": s["cost_per_m_output"], "decode_busy_frac": s["decode_busy_frac"],
            "prefill_busy_frac": s["prefill_busy_frac"], "prefill_gpu_hit_rate": s["prefill_gpu_hit_rate"],
            "mean_input": s["input_tokens"] / max(1, s["requests_ok"]),
            "mean_output": s["output_tokens"] / max(1, s["requests_ok"]),
            "cpu_write_tb": s.get("cpu_write_tb")}


def _err(sim: float, ref: float | None) -> str:
    return "" if not ref else f"{(sim / ref - 1) * 100:+.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/sim_calibration.json")
    a = ap.parse_args()
    with Pool(2) as pool:
        rows = pool.map(point, [(c, a.duration, a.seed) for c in (128, 64, 16)])
    rows.sort(key=lambda r: r["concurrency"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"duration": a.duration, "rows": rows, "reference": REFERENCE},
                                      indent=2))
    t = Table(title=f"3P1D DEP16 calibration, {a.duration:.0f} simulated s")
    keys = ("output_tok_s", "itl_p50_ms", "ttft_p50_s", "input_tok_s", "cost_in", "cost_out")
    for col in ("c",) + keys:
        t.add_column(col, justify="right")
    for r in rows:
        ref = REFERENCE[r["concurrency"]]
        t.add_row(str(r["concurrency"]), *[f"{r[k]:,.3g} ({_err(r[k], ref.get(k))})" for k in keys])
    Console(width=160).print(t)
    for r in rows:
        print({k: r[k] for k in ('concurrency', 'mean_input', 'mean_output', 'prefill_gpu_hit_rate', 'decode_busy_frac', 'prefill_busy_frac', 'ttft_p90_s', 'cpu_write_tb')})


if __name__ == "__main__":
    main()
