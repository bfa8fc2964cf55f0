"""The report's agent views: tokens per turn, the per-session timeline, TTFT against input
length, and the P/D split of a simulated xPyD stage. Same contract as plots.py: a `Plot`
or None when there is nothing to show."""

from __future__ import annotations

import numpy as np

from agentserve.workload.plots import COLORS, Plot, log_x, plt, png
from agentserve.workload.report_data import Run, stage_label, turn_rows

MAX_TIMELINE_SESSIONS = 24
MAX_SCATTER = 5_000  # points a run in the TTFT-vs-input scatter
SUB_COLORS = plt.get_cmap("Set2").colors  # sub-agent groups; main-agent turns are always blue
MAIN = "tab:blue"


def turns(runs: list[Run]) -> Plot | None:
    """Cached and computed input tokens per turn (stacked bars, runs side by side), and TTFT p50."""
    tables = [turn_rows(run.records) for run in runs]
    if max((len(t) for t in tables), default=0) < 2:
        return None  # one turn: the table's one row says it
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True,
                                      gridspec_kw={"height_ratios": (3, 2)})
    w = 0.8 / len(runs)
    for k, (run, rows) in enumerate(zip(runs, tables)):
        x = np.asarray([r["turn_index"] for r in rows], dtype=float) + (k - (len(runs) - 1) / 2) * w
        tag = f" ({run.name})" if len(runs) > 1 else ""
        hatch = (None, "//", "..", "xx")[k % 4]
        cached = [r["cached_tokens"] for r in rows]
        top.bar(x, cached, w, color="tab:green", hatch=hatch, edgecolor="white", label="cached" + tag)
        top.bar(x, [r["computed_tokens"] for r in rows], w, bottom=cached, color="tab:orange", hatch=hatch,
                edgecolor="white", label="computed" + tag)
        ttft = [r["ttft_p50_s"] if r["ttft_p50_s"] is not None else np.nan for r in rows]
        bottom.plot([r["turn_index"] for r in rows], ttft, "o-", color=COLORS[k % len(COLORS)],
                    label=f"TTFT p50{tag}")
    top.set_ylabel("input tokens (sum over sessions)")
    top.legend(fontsize=8, ncol=2)
    top.grid(alpha=0.3, axis="y")
    bottom.set(xlabel="turn (main-agent step; its sub-agent requests included)", ylabel="TTFT p50 (s)")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    return Plot("turns", "Cached vs computed tokens per turn", png(fig),
                "Each bar is a turn's prompt tokens over all sessions: green were served from the prefix "
                "cache, orange were computed; the lower panel is that turn's median TTFT.", wide=True)


def _session_order(run: Run) -> list[str]:
    first: dict[str, float] = {}
    for r in run.records:
        first[r.session_id] = min(first.get(r.session_id, r.start), r.start)
    return sorted(first, key=first.get)


def _timeline_axes(ax: plt.Axes, run: Run, t0: float) -> int:
    """Draw one run's sessions on `ax`: a band a session, the main agent's turns on its top lane,
    each sub-agent group (the sub-agents launched before one turn) in its own colour below.
    Each bar is a request; its pale left part is the wait for the first token."""
    order = _session_order(run)[:MAX_TIMELINE_SESSIONS]
    row = {sid: i for i, sid in enumerate(order)}
    groups: dict[tuple[str, int], int] = {}
    bars: dict[tuple, list[tuple[float, float]]] = {}  # (y, height, colour, alpha) -> x ranges: one call each
    for r in run.records:
        if r.session_id not in row:
            continue
        y = row[r.session_id]
        if r.agent == "main":
            color, lane, h = MAIN, 0, 0.42
        else:
            g = groups.setdefault((r.session_id, r.turn), len(groups))
            color, lane, h = SUB_COLORS[g % len(SUB_COLORS)], 1 + max(r.sub_index, 0) % 4, 0.1
        top = y - 0.45 + (0 if lane == 0 else 0.45 + (lane - 1) * 0.12)
        start, end = r.start - t0, r.end - t0
        wait = (r.ttft if r.ttft is not None else r.e2e or 0.0)
        bars.setdefault((top, h, color, 0.35), []).append((start, max(wait, 1e-3)))
        bars.setdefault((top, h, "tab:red" if not r.ok else color, 1.0), []).append(
            (start + wait, max(end - start - wait, 1e-3)))
    for (top, h, color, alpha), xs in bars.items():
        ax.broken_barh(xs, (top, h), facecolors=color, alpha=alpha)
    ax.set_yticks(range(len(order)), [s[:18] for s in order], fontsize=7)
    ax.set_ylim(len(order) - 0.4, -0.6)
    ax.grid(alpha=0.3, axis="x")
    return len(order)


def timeline(runs: list[Run]) -> Plot | None:
    """Per-session timeline, one panel a run on a shared time axis."""
    with_sessions = [run for run in runs if run.records and len({r.turn for r in run.records}) > 1]
    if not with_sessions:
        return None
    heights = [min(len(_session_order(r)), MAX_TIMELINE_SESSIONS) for r in with_sessions]
    inches = 1.2 + sum(0.42 * h + 0.6 for h in heights)
    fig, axes = plt.subplots(len(with_sessions), 1, sharex=True, squeeze=False, figsize=(9, inches),
                             gridspec_kw={"height_ratios": heights})
    for ax, run in zip(axes[:, 0], with_sessions):
        t0 = min(r.start for r in run.records)
        n = _timeline_axes(ax, run, t0)
        total = len(_session_order(run))
        ax.set_title(f"{run.name}: {n} of {total} sessions" if len(runs) > 1 or n < total else "",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since the run's first request (s)")
    from matplotlib.patches import Patch

    handles = [Patch(color=MAIN, label="main-agent turn"), Patch(color=SUB_COLORS[0], label="sub-agent group"),
               Patch(color=MAIN, alpha=0.35, label="waiting for first token"),
               Patch(color="tab:red", label="failed request")]
    fig.legend(handles=handles, fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0.01, 0.995))
    return Plot("timeline", "Sessions over time", png(fig, top=1 - 0.4 / inches),
                "A row a session (first started on top): thick bars are main-agent requests, thin coloured "
                "ones the sub-agents launched before a turn (a colour a group); gaps are the agent's pauses "
                "(tool calls, user think time).", wide=True)


def ttft_vs_input(runs: list[Run]) -> Plot | None:
    """TTFT against input length (log x), coloured by cached share (one run) or by run."""
    pts = [[r for r in run.records if r.ok and r.ttft is not None and r.input_tokens > 0] for run in runs]
    pts = [rs[::-(-len(rs) // MAX_SCATTER)] for rs in pts]  # every k-th: a long sim run has 10^5
    if sum(len(p) for p in pts) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(runs) == 1:
        rs = pts[0]
        share = [min(r.cached_tokens / r.input_tokens, 1.0) for r in rs]
        sc = ax.scatter([r.input_tokens for r in rs], [r.ttft for r in rs], c=share, cmap="viridis",
                        vmin=0, vmax=1, s=14, marker="o", label="request")
        fig.colorbar(sc, ax=ax, label="cached share of the prompt")
        ax.legend(fontsize=8, loc="upper left")
    else:
        for k, (run, rs) in enumerate(zip(runs, pts)):
            ax.scatter([r.input_tokens for r in rs], [r.ttft for r in rs], s=14, alpha=0.7,
                       color=COLORS[k % len(COLORS)], marker="os^D"[k % 4], label=f"{run.name} (n={len(rs)})")
        ax.legend(fontsize=8, loc="upper left")
    log_x(ax, np.asarray([r.input_tokens for rs in pts for r in rs], dtype=float))
    ax.set(xlabel="input tokens (log scale)", ylabel="time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    return Plot("ttft_vs_input", "TTFT against prompt length", png(fig),
                "A point a request: long prompts that missed the cache (dark) pay the prefill; cached ones "
                "(yellow) stay low however long they are." if len(runs) == 1 else
                "A point a request, a colour a run: the vertical gap between runs at one prompt length is "
                "the TTFT difference for that size.")


def pd_split(runs: list[Run]) -> Plot | None:
    """The TTFT phases of simulated xPyD stages (mean seconds, stacked), when they have them."""
    rows = [(run.name if len(runs) > 1 else "", stage_label(s, i), s["ttft_phases_s"])
            for run in runs for i, s in enumerate(run.stages) if s.get("ttft_phases_s")]
    if not rows:
        return None
    phases = [k for k in rows[0][2] if k != "new_tokens"]
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.45 * len(rows)))
    left = np.zeros(len(rows))
    cmap = plt.get_cmap("tab10").colors

    def mean(r: tuple, ph: str) -> float:
        v = (r[2].get(ph) or {}).get("mean") or 0.0
        # the CPU-restore wait is part of the prefill phase (sim/summary.py): drawn apart, not twice
        return v - ((r[2].get("cpu_restore") or {}).get("mean") or 0.0) if ph == "prefill" else v

    for j, ph in enumerate(phases):
        v = np.asarray([mean(r, ph) for r in rows])
        ax.barh(range(len(rows)), v, left=left, color=cmap[j % 10], label=ph.replace("_", " "))
        left += v
    ax.set_yticks(range(len(rows)), [", ".join(x for x in r[:2] if x) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mean time to first token, by phase (s)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.2))
    ax.grid(alpha=0.3, axis="x")
    return Plot("pd_split", "Where TTFT goes (P/D)", png(fig),
                "Mean TTFT split into its phases: waiting for and running the prefill engine, pulling its KV "
                "to the decode engine, then waiting for the first decode step.", wide=True)


def agent_plots(runs: list[Run]) -> list[Plot]:
    return [p for f in (turns, timeline, ttft_vs_input, pd_split) if (p := f(runs)) is not None]
