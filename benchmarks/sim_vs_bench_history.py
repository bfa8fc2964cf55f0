"""SIM-1 small scale: this checkout's simulator on every recorded check's benches.

Each recorded check that records its runs (stop 39 on: the bench runs and the calibrations
around them), `benchmarks/results/sim_vs_bench_checks/sim_vs_bench*.json`, is priced again by
`sim_vs_bench.py --resimulate`'s code, and each (run, concurrency) pair's output tok/s and TTFT
p50 errors are set beside the ones the check's own model gave. A model change that helps one check's benches and hurts the others'
shows here in seconds, without a 15-30 minute rerun; a rerun is still what shows it holds on
fresh benches. Checks recorded before per-run results existed are listed as skipped. A new
check (`sim_vs_bench.py` writes benchmarks/results/sim_vs_bench.json, the current one) joins the
history when it is copied into sim_vs_bench_checks/ under a name of its own.

    .venv/bin/python benchmarks/sim_vs_bench_history.py --out benchmarks/results/sim_vs_bench_history.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sim_vs_bench import resimulate  # noqa: E402

BAND = 0.20  # SIM-1's small-scale target on output tok/s and TTFT p50
STEAL = 0.10  # sim_vs_bench's --max-steal default: a phase losing more is not trusted


def pairs(rows: list[dict]) -> list[tuple[int | str, float | None, float | None]]:
    """(concurrency, output error, TTFT p50 error) for each run of each row."""
    out = []
    for r in rows:
        for eo, et in zip(r["output_tok_s"]["err_runs"], r["ttft_p50_s"]["err_runs"]):
            out.append((r["concurrency"], eo, et))
    return out


def in_band(p: tuple) -> bool:
    return p[1] is not None and p[2] is not None and abs(p[1]) <= BAND and abs(p[2]) <= BAND


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=HERE / "results" / "sim_vs_bench_checks")
    ap.add_argument("--out", default="benchmarks/results/sim_vs_bench_history.json")
    args = ap.parse_args()
    checks, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for f in sorted(args.results.glob("sim_vs_bench*.json")):
            if f.name.startswith("sim_vs_bench_history"):  # this script's own output
                continue
            old = json.loads(f.read_text())
            if "bench_runs" not in old or "rows" not in old or "resimulated_from" in old:
                skipped.append(f.name)  # before per-run records, or not a check
                continue
            new = resimulate(f, Path(tmp) / f.name)
            steal = [x for v in (old.get("cpu_steal_frac") or {}).values()
                     for x in (v if isinstance(v, list) else [v]) if x is not None]
            checks.append({"file": f.name, "mode": old["args"].get("mode", "concurrency"),
                           "max_steal": max(steal, default=None),  # any phase's
                           "then": pairs(old["rows"]), "now": pairs(new["rows"])})
    then = [p for c in checks for p in c["then"]]
    now = [p for c in checks for p in c["now"]]
    # since stop 41 a check sets aside runs whose phases lost over 10% of the CPU (`--max-steal`)
    calm = [p for c in checks if (c["max_steal"] or 0) <= STEAL for p in c["now"]]
    summary = {"pairs": len(now), "in_band_now": sum(map(in_band, now)),
               "in_band_then": sum(map(in_band, then)), "band": BAND,
               "pairs_steal_ok": len(calm), "in_band_now_steal_ok": sum(map(in_band, calm))}
    Path(args.out).write_text(json.dumps({"summary": summary, "checks": checks,
                                          "skipped": skipped}, indent=1))

    from rich.console import Console
    from rich.table import Table

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.0%}"

    tab = Table(title="each recorded check's runs priced by this checkout's simulator (output / "
                      "TTFT p50 error by run; then: the check's own model)")
    for col in ("check", "max steal", "c", "runs now", "runs then"):
        tab.add_column(col, justify="right")
    for c in checks:
        for conc in dict.fromkeys(p[0] for p in c["now"]):
            fmt = lambda ps: "  ".join(f"{pct(o)} / {pct(t)}" for k, o, t in ps if k == conc)  # noqa: E731
            tab.add_row(c["file"].removeprefix("sim_vs_bench").removesuffix(".json") or "-",
                        "-" if c["max_steal"] is None else f"{c['max_steal']:.1%}",
                        str(conc), fmt(c["now"]), fmt(c["then"]))
    Console(width=160).print(tab)
    print(f"(run, concurrency) pairs with both errors within ±{BAND:.0%}: "
          f"{summary['in_band_now']} of {summary['pairs']} now, {summary['in_band_then']} with "
          f"each check's own model; {summary['in_band_now_steal_ok']} of "
          f"{summary['pairs_steal_ok']} in checks with no phase over {STEAL:.0%} steal; skipped "
          f"(no per-run record): {len(skipped)}")


if __name__ == "__main__":
    main()
