"""`agentserve plan`: search xPyD topologies under a GPU budget with the simulator.

Candidates (SIM-1): DEP width 8 or 16 (prefill and decode instances of the same width), every
split xPyD with x >= y that uses the whole budget (input is ~98% of agentic tokens), MTP on/off,
CPU tier 0 or 100 GiB per prefill rank: 24 configurations for 64 GPUs. Each is simulated at a
ladder of concurrencies (closed loop, short stages by default); a point is one (config, C).

Frontier: output tok/s per GPU against end-to-end output tok/s per user (mean of
`output_tokens / e2e`, as the reference's 36.6 at c128); a point is on it when no other point
is better on both. Recommendation: among points meeting `--min-tok-s-per-user`, the highest
output tok/s per GPU, i.e. the lowest rental per output token; its $/M input and output are
the reference's method (`cost.pool_cost`: prefill rental -> input, decode rental -> output).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing import Pool
from pathlib import Path

from agentserve.sim.cost import pool_cost
from agentserve.sim.memory import Topology, plan_memory
from agentserve.sim.run import SimConfig, simulate
from agentserve.sim.specs import hardware_spec, model_spec


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment to simulate."""

    prefill: int
    decode: int
    width: int
    mtp: bool
    cpu_gib: float

    @property
    def name(self) -> str:
        return (f"{self.prefill}P{self.decode}D DEP{self.width} "
                f"{'MTP' if self.mtp else 'noMTP'} cpu{self.cpu_gib:g}")

    @property
    def gpus(self) -> int:
        return (self.prefill + self.decode) * self.width


def candidates(model: str, gpu: str, gpus: int, widths: tuple[int, ...] = (8, 16),
               cpu_sizes: tuple[float, ...] = (0.0, 100.0)) -> list[Candidate]:
    """xPyD splits (x >= y >= 1) filling the budget, for each width, MTP and CPU size; those
    whose weights do not fit a GPU are dropped."""
    m, hw, out = model_spec(model), hardware_spec(gpu), []
    for w in widths:
        n = gpus // w
        try:
            plan_memory(m, hw, Topology("dep", w, "prefill"))
            plan_memory(m, hw, Topology("dep", w, "decode", mtp=True))
        except ValueError:
            continue
        for y in range(1, n // 2 + 1):
            for mtp, cpu in itertools.product((True, False), cpu_sizes):
                out.append(Candidate(n - y, y, w, mtp, cpu))
    return out


# Where the model is known to be optimistic against the reference's published runs, by
# (model, gpu, prefill width): the planner marks those points, so that a frontier row the
# published comparison says is too good is not read as a plain prediction (docs/sim.md, "Open
# gaps"; `benchmarks/sim_published.py`, `benchmarks/sim_dep8_factors.py`).
KNOWN_OPTIMISTIC: dict[tuple[str, str, int], str] = {
    ("glm-5.2-fp8", "h200", 8): (
        "DEP8 prefill pools: the model's output runs up to 75% above the reference's published "
        "DEP8 point and its TTFT p50 at a fifth of it (limited P8/D16 c128, "
        "benchmarks/sim_published.py); read these rows as an upper bound (sim README, Open gaps)"),
}


def caveat(model: str, gpu: str, prefill_width: int) -> str | None:
    """What the published comparison says of this model's prefill pools at this width, if the
    model is known to be optimistic there; None otherwise."""
    return KNOWN_OPTIMISTIC.get((model, gpu, prefill_width))


def _job(args: tuple) -> dict:
    """One (candidate, concurrency) stage: `sweep`'s job tuple in, a frontier point out."""
    c, conc, model, gpu, workload, duration, seed, warmup, clients, eff = args
    cfg = SimConfig(model=model, gpu=gpu, prefill=c.prefill, decode=c.decode, prefill_width=c.width,
                    decode_width=c.width, concurrency=conc, mtp=c.mtp, cpu_offload_gib=c.cpu_gib,
                    workload=workload, duration=duration, seed=seed, warmup=warmup, clients=clients,
                    efficiency=eff)
    s = simulate(cfg)
    return {"config": c.name, **asdict(c), "gpus": c.gpus, "concurrency": conc,
            "output_tok_s": s["output_tok_s"], "input_tok_s": s["input_tok_s"],
            "output_tok_s_per_gpu": s["output_tok_s"] / c.gpus,
            "tok_s_per_user": s["output_tok_s_per_user"]["mean"] or 0.0,
            "ttft_p50_s": s["ttft_s"]["p50"], "itl_p50_ms": s["itl_ms"]["p50"],
            "cost_per_m_input": s["cost_per_m_input"], "cost_per_m_output": s["cost_per_m_output"],
            "cost_per_hour": s["cost_per_hour"], "rejected_share": s["rejected_share"] or 0.0,
            "caveat": caveat(model, gpu, c.width)}


def sweep(cands: list[Candidate], concurrencies: list[int], model: str, gpu: str, workload: str,
          duration: float, seed: int = 0, workers: int = 2,
          warmup: float | None = None, clients: str | None = None,
          efficiency: dict[str, float] | None = None,
          on_done: Callable[[], None] | None = None) -> list[dict]:
    """Simulate every (candidate, concurrency); `workers` processes, biggest jobs first.
    `clients`: the load generator (`SimConfig.clients`; None: AIPerf's agentic replay);
    `warmup`: closed clients' simulated seconds before each stage (None: the default);
    `efficiency`: overrides of the step model's factors (`SimConfig.efficiency`);
    `on_done`: called as each simulation completes (progress)."""
    jobs = [(c, k, model, gpu, workload, duration, seed, warmup, clients, efficiency)
            for c in cands for k in concurrencies]
    jobs.sort(key=lambda j: -j[1])
    out: list[dict] = []
    with Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for point in (pool.imap_unordered(_job, jobs) if pool is not None else map(_job, jobs)):
            out.append(point)
            if on_done is not None:
                on_done()
    return out


def price(points: list[dict], per_gpu_hour: float) -> None:
    """Reference cost method at `per_gpu_hour`: prefill rental -> input, decode -> output."""
    for p in points:
        c = pool_cost(p["prefill"] * p["width"], p["decode"] * p["width"], p["input_tok_s"],
                      p["output_tok_s"], per_gpu_hour)
        p["cost_per_m_input"], p["cost_per_m_output"], p["cost_per_hour"] = (
            c.per_m_input, c.per_m_output, c.per_hour)


def frontier(points: list[dict]) -> list[dict]:
    """Pareto points: no other point has both more tok/s per GPU and more tok/s per user."""
    pts = sorted(points, key=lambda p: (-p["tok_s_per_user"], -p["output_tok_s_per_gpu"]))
    out, best = [], -1.0
    for p in pts:
        if p["output_tok_s_per_gpu"] > best:
            out.append(p)
            best = p["output_tok_s_per_gpu"]
    return out


def recommend(points: list[dict], min_per_user: float) -> dict | None:
    """The point meeting the per-user target with the most output tok/s per GPU, among those
    serving every request: one that rejects requests longer than its ranks' KV (DEP8) would
    look cheaper only by dropping the longest work."""
    ok = [p for p in points if p["tok_s_per_user"] >= min_per_user and p["output_tok_s"] > 0
          and not p.get("rejected_share")]
    return max(ok, key=lambda p: p["output_tok_s_per_gpu"]) if ok else None


def plot(points: list[dict], front: list[dict], best: dict | None, target: float, path: Path) -> None:
    """Scatter of all points, the frontier line, the target and the recommendation (PNG);
    configurations with a `caveat` are dotted, starred in the legend and footnoted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from agentserve.workload.plots import distinct_styles  # colour x marker x line: 24 lines, 24 looks

    fig, ax = plt.subplots(figsize=(8, 5.5))
    names = sorted({p["config"] for p in points})
    for name, style in zip(names, distinct_styles(len(names))):
        ps = sorted((p for p in points if p["config"] == name), key=lambda p: p["concurrency"])
        flagged = bool(ps[0].get("caveat"))
        ax.plot([p["tok_s_per_user"] for p in ps], [p["output_tok_s_per_gpu"] for p in ps],
                ms=3.5, lw=0.9, alpha=0.75, **(style | ({"ls": ":"} if flagged else {})),
                label=name + (" *" if flagged else ""))
    ax.plot([p["tok_s_per_user"] for p in front], [p["output_tok_s_per_gpu"] for p in front],
            "k--", lw=1.5, label="frontier")
    ax.axvline(target, color="red", lw=1, ls=":", label=f"target {target:g} tok/s/user")
    if best:
        ax.plot(best["tok_s_per_user"], best["output_tok_s_per_gpu"], "r*", ms=16)
    ax.set_xlabel("output tok/s per user (end to end)")
    ax.set_ylabel("output tok/s per GPU")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    notes = sorted({p["caveat"] for p in points if p.get("caveat")})
    if notes:  # the known-optimistic rows' note (`KNOWN_OPTIMISTIC`), wrapped under the axes
        fig.text(0.01, 0.005, "\n".join(textwrap.fill("* " + n, 140) for n in notes), fontsize=6,
                 va="bottom")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, points: list[dict], front: list[dict], best: dict | None, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps({"meta": meta, "recommendation": best,
                                               "frontier": front, "points": points}, indent=2))
    plot(points, front, best, meta["min_tok_s_per_user"], out / "frontier.png")
