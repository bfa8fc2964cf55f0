"""PNG plots of a run: TTFT and ITL CDFs per stage, throughput per stage, the user/GPU frontier."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from agentserve.workload.record import RequestRecord, itl_token_samples  # noqa: E402

MAX_POINTS = 20_000  # a CDF needs no more; keeps plotting fast on long runs


def _stage_label(s: dict) -> str:
    for k in ("concurrency", "sessions", "session_rate"):
        if s.get(k) is not None:
            return f"{k}={s[k]}"
    return f"stage {s.get('stage', 0)}"


def _x(s: dict, i: int) -> float:
    return float(s.get("concurrency") or s.get("sessions") or i)


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    a = np.sort(np.asarray(values, dtype=float))
    if a.size > MAX_POINTS:
        a = a[np.linspace(0, a.size - 1, MAX_POINTS).astype(int)]
    if a.size:
        ax.plot(a, np.linspace(0, 1, a.size), label=label)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_plots(out: Path, stages: list[dict], records: list[RequestRecord]) -> list[Path]:
    """ttft_cdf.png, itl_cdf.png, throughput.png, frontier.png; returns their paths."""
    by_stage: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.ok:
            by_stage.setdefault(r.stage, []).append(r)
    paths = []
    for name, xlabel, get in (
            ("ttft_cdf", "TTFT (s)", lambda rs: [r.ttft for r in rs if r.ttft is not None]),
            ("itl_cdf", "ITL, token-weighted (ms)", lambda rs: itl_token_samples(rs) * 1e3)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, s in enumerate(stages):
            _cdf(ax, get(by_stage.get(s.get("stage", i), [])), _stage_label(s))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if name == "ttft_cdf" else "fraction of tokens")
        ax.grid(alpha=0.3)
        if stages:
            ax.legend(fontsize=8)
        paths.append(_save(fig, out / f"{name}.png"))
    xs = [_x(s, i) for i, s in enumerate(stages)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [s["output_tok_s"] for s in stages], "o-", label="output tok/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [s["input_tok_s"] for s in stages], "s--", color="tab:orange", label="input tok/s")
    ax.set_xlabel("concurrency" if stages and "concurrency" in stages[0] else "sessions / stage")
    ax.set_ylabel("output tok/s")
    ax2.set_ylabel("input tok/s")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "throughput.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    gx = [s["output_tok_s_per_gpu"] for s in stages]
    uy = [s["output_tok_s_per_user"]["mean"] or 0.0 for s in stages]
    ax.plot(gx, uy, "o-")
    for s, x, y in zip(stages, gx, uy):
        ax.annotate(_stage_label(s), (x, y), fontsize=8)
    ax.set_xlabel(f"output tok/s per GPU ({stages[0]['gpus'] if stages else 1} GPU)")
    ax.set_ylabel("output tok/s per user")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "frontier.png"))
    return paths
