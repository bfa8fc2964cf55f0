"""The report's latency and throughput plots, for one run or several on the same axes.

Each function takes `Run`s and returns a `Plot` (PNG bytes, a title, a one-line explanation)
or None when the plot would say nothing: scaling and the user/GPU frontier need two stages or
more (one stage is a row of the summary table, not a dot on an axis). Per-turn, per-session
and P/D plots are in report_plots.py.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from agentserve.workload.record import RequestRecord, itl_token_samples  # noqa: E402
from agentserve.workload.report_data import Plot, Run, stage_label  # noqa: E402

MAX_POINTS = 20_000  # a CDF needs no more; keeps plotting fast on long runs
COLORS = plt.get_cmap("tab10").colors
STYLES = ("-", "--", ":", "-.")


def distinct_styles(n: int) -> list[dict]:
    """`n` line styles no two alike: ten colours, then each further ten with a new marker and
    line style (a planner's 24 configurations are 24 lines, not 10 colours reused)."""
    markers, lines = "os^Dv<>P", ("-", "--", "-.")
    return [{"color": COLORS[i % 10], "marker": markers[(i // 10) % len(markers)],
             "ls": lines[(i // 10) % len(lines)]} for i in range(n)]


def png(fig: plt.Figure, top: float = 1.0) -> bytes:
    """The figure as PNG bytes (closed); `top` < 1 leaves room for a figure-level legend."""
    fig.tight_layout(rect=(0, 0, 1, top))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def by_stage(records: list[RequestRecord]) -> dict[int, list[RequestRecord]]:
    out: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.ok:
            out.setdefault(r.stage, []).append(r)
    return out


def series(runs: list[Run]) -> list[tuple[str, dict, list[RequestRecord], dict]]:
    """(legend label, stage summary, its answered records, line style) for every run x stage:
    colour by stage, line style by run, so runs compare stage for stage."""
    out = []
    for k, run in enumerate(runs):
        groups = by_stage(run.records)
        for i, s in enumerate(run.stages):
            label = stage_label(s, i) if len(runs) == 1 else (
                run.name if len(run.stages) == 1 else f"{run.name}, {stage_label(s, i)}")
            style = {"color": COLORS[(k if len(run.stages) == 1 else i) % len(COLORS)],
                     "ls": STYLES[(0 if len(run.stages) == 1 else k) % len(STYLES)]}
            out.append((label, s, groups.get(s.get("stage", i), []), style))
    return out


def _cdf(ax: plt.Axes, values: np.ndarray, label: str, style: dict) -> bool:
    a = np.sort(np.asarray(values, dtype=float))
    if a.size > MAX_POINTS:
        a = a[np.linspace(0, a.size - 1, MAX_POINTS).astype(int)]
    if not a.size:
        return False
    ax.plot(a, np.linspace(0, 1, a.size), label=f"{label} (n={len(values):,})", lw=1.5, **style)
    return True


def log_x(ax: plt.Axes, values: np.ndarray) -> None:
    """A log x axis with plain numbers: 1-2-5 ticks when the data span under three decades
    (matplotlib's default labels every minor tick there, 1.4x10^4 over 1.5x10^4)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    pos = values[values > 0]
    if pos.size and pos.max() < 1000 * pos.min():
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _log_if_wide(ax: plt.Axes, values: list[np.ndarray]) -> bool:
    """Log x when the positive samples span more than a decade (a tail to 16 s beside a 20 ms
    body is invisible on a linear axis)."""
    pos = np.concatenate([v[v > 0] for v in values]) if values else np.empty(0)
    if pos.size and pos.max() > 10 * pos.min():
        log_x(ax, pos)
        return True
    return False


def ttft_cdf(runs: list[Run]) -> Plot | None:
    fig, ax = plt.subplots(figsize=(7, 4))
    vals = []
    for label, _, rs, style in series(runs):
        v = np.asarray([r.ttft for r in rs if r.ttft is not None], dtype=float)
        if _cdf(ax, v, label, style):
            vals.append(v)
    if not vals:
        plt.close(fig)
        return None
    log = _log_if_wide(ax, vals)
    ax.set(xlabel="time to first token (s)" + (", log scale" if log else ""), ylabel="fraction of requests")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return Plot("ttft_cdf", "TTFT distribution", png(fig),
                "Share of answered requests whose first token came within x seconds of sending "
                "(one sample per request). Further left is better; the top of each curve is the tail.")


def itl_cdf(runs: list[Run]) -> Plot | None:
    fig, ax = plt.subplots(figsize=(7, 4))
    vals = []
    for label, _, rs, style in series(runs):
        v = itl_token_samples(rs) * 1e3
        v = v[v > 0]  # tokens that arrived in one chunk have no gap of their own (log axis)
        if _cdf(ax, v, label, style):
            vals.append(v)
    if not vals:
        plt.close(fig)
        return None
    log_x(ax, np.concatenate(vals))
    ax.set(xlabel="inter-token latency (ms, log scale)", ylabel="fraction of output tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return Plot("itl_cdf", "ITL distribution, token-weighted", png(fig),
                "Token-weighted: each streamed token counts once (a chunk of n tokens after a gap g gives n "
                "samples of g/n), unlike the table's ITL, which is one (E2E - TTFT) / (tokens - 1) per request.")


def _bins(records: list[RequestRecord], width: float) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in `width`-second bins, by chunk arrival time (numpy: a
    simulated stage streams ~10^6 chunks)."""
    t, n = [], []
    for r in records:
        if not r.chunk_times:
            continue
        k = len(r.chunk_times)
        t.append(r.start + np.asarray(r.chunk_times, dtype=float))
        toks = np.ones(k)
        m = min(k, len(r.chunk_tokens))
        toks[:m] = r.chunk_tokens[:m]
        n.append(toks)
    if not t:
        return np.empty(0), np.empty(0)
    ta = np.concatenate(t) - min(r.start for r in records)
    edges = np.arange(0, ta.max() + width, width)
    counts, _ = np.histogram(ta, bins=edges, weights=np.concatenate(n))
    return edges[:-1] + width / 2, counts / width


def throughput(runs: list[Run]) -> Plot | None:
    """Output tok/s over the run, every run on the same time axis."""
    span = max((r.end for run in runs for r in run.records if r.ok), default=0.0)
    if span <= 0:
        return None
    width = max(span / 60, 0.5)  # ~60 bins a run
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, _, rs, style in series(runs):
        x, y = _bins(rs, width)
        if x.size:
            ax.step(x, y, where="mid", label=label, **style)
    ax.set(xlabel="time since the stage's first request (s)", ylabel="output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Plot("throughput", "Output throughput over time", png(fig),
                f"Output tokens streamed per second in {width:.1f}-s bins, counted when each chunk "
                "arrived; ramps and stalls show here, not in the stage's mean.")


def _numeric_x(run: Run) -> tuple[str, list[float]] | None:
    for key, name in (("concurrency", "concurrency"), ("sessions", "sessions at once"),
                      ("session_rate", "sessions/s")):
        xs = [s.get(key) for s in run.stages]
        if all(isinstance(x, (int, float)) for x in xs):
            return name, [float(x) for x in xs]
    return None


def scaling(runs: list[Run]) -> Plot | None:
    """Output and input tok/s against the stage's load, when some run has two stages or more."""
    multi = [(run, nx) for run in runs if len(run.stages) > 1 and (nx := _numeric_x(run))]
    if not multi:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for k, (run, (xname, xs)) in enumerate(multi):
        c = COLORS[k % len(COLORS)]
        a1.plot(xs, [s["output_tok_s"] for s in run.stages], "o-", color=c, label=run.name)
        a2.plot(xs, [s["input_tok_s"] for s in run.stages], "s--", color=c, label=run.name)
    for ax, what in ((a1, "output"), (a2, "input")):
        ax.set(xlabel=multi[0][1][0], ylabel=f"{what} tokens/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return Plot("scaling", "Throughput by load", png(fig),
                "Each point is a stage: tokens/s over the stage's wall time against the load it ran at.", wide=True)


def frontier(runs: list[Run]) -> Plot | None:
    """Output tok/s per user against per GPU, one point a stage, when a run has two or more."""
    multi = [run for run in runs if len(run.stages) > 1]
    if not multi:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, run in enumerate(multi):
        gx = [s["output_tok_s_per_gpu"] for s in run.stages]
        uy = [(s.get("output_tok_s_per_user") or {}).get("mean") or 0.0 for s in run.stages]
        ax.plot(gx, uy, "o-", color=COLORS[k % len(COLORS)], label=f"{run.name} ({run.stages[0]['gpus']} GPU)")
        for i, (s, x, y) in enumerate(zip(run.stages, gx, uy)):
            ax.annotate(stage_label(s, i), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="output tokens/s per GPU", ylabel="output tokens/s per user (mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Plot("frontier", "User speed against GPU throughput", png(fig),
                "The trade-off across stages: up and to the right is better; more load moves a point right "
                "and down.")


def latency_plots(runs: list[Run]) -> list[Plot]:
    return [p for f in (ttft_cdf, itl_cdf, throughput, scaling, frontier) if (p := f(runs)) is not None]
