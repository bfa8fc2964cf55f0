"""Workload statistics of agentic traces, defined exactly as SPEC.md's table.

Definitions (binding; chosen so numbers compare with other tools):
- main-agent request: a top-level request (type `n`/`s`, not `subagent`); input/output are
  its `in`/`out`. Sub-agent requests are only counted (`subagent_requests`) and grouped.
- growth: `in[i] - in[i-1]` between consecutive main-agent requests of one session
  (never across sessions; negative after a reset or compaction).
- gap: idle time `t[i] - t[i-1] - api_time[i-1]`, floored at 0, within one session;
  a missing `api_time` counts as 0.
- turns: main-agent requests per session.
- reuse of main request i >= 1: the longest common prefix of its `hash_ids` with any of
  the previous 8 main requests, times `block_size`, over `in[i]`, capped at 1 (1 when
  `in[i]` is 0). A prefix reset is reuse < 0.5; a compaction is `in[i-1] > 500,000` and
  `in[i] < 30,000`. The shares (`share_turns_reuse_ge_90pct`, `prefix_reset_share`,
  `compaction_share`) and `median_reuse` are over main requests with i >= 1, i.e. turns
  that have a predecessor in their session.
- sub-agent group: all sub-agent requests whose entries sit between the same two
  consecutive main requests (a run of sub-agent entries in `items`; a run before the first
  or after the last main request is a group too); groups without requests are ignored.
  Group-size percentiles are over groups.
- percentiles: numpy's default (linear) method; shares are fractions in 0..1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentserve.workload.schema import Session, Subagent, TraceRequest

WINDOW = 8  # reuse looks back this many main-agent requests
RESET_BELOW = 0.5
COMPACT_FROM, COMPACT_TO = 500_000, 30_000


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists.

    List slice comparison runs in C (identity first, so shared int objects are cheap);
    the full-prefix case, by far the most common, costs one comparison, and a mismatch
    is located by bisection over slices (O(n) element compares in total).
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def reuse_fractions(mains: list[TraceRequest], block_size: int) -> list[float]:
    """Reuse of each main request i >= 1 against the previous `WINDOW` main requests."""
    ids = [r.hash_ids for r in mains]
    out = []
    for i in range(1, len(ids)):
        cur, best = ids[i], 0
        for j in range(i - 1, max(-1, i - 1 - WINDOW), -1):
            if min(len(cur), len(ids[j])) <= best:
                continue  # cannot beat the best match found so far
            best = max(best, common_prefix_len(cur, ids[j]))
            if best == len(cur):
                break
        n_in = mains[i].input_tokens
        out.append(1.0 if n_in <= 0 else min(1.0, best * block_size / n_in))
    return out


def group_sizes(session: Session) -> list[int]:
    """Sub-agent requests per group (runs of sub-agent entries between main requests)."""
    sizes, run = [], 0
    for it in session.items:
        if isinstance(it, Subagent):
            run += len(it.requests)
        else:
            if run:
                sizes.append(run)
            run = 0
    if run:
        sizes.append(run)
    return sizes


def _pct(values: Sequence[float] | np.ndarray, qs: Sequence[float]) -> list[float] | None:
    a = np.asarray(values, dtype=np.float64)
    return None if a.size == 0 else [float(x) for x in np.percentile(a, qs)]


def _share(mask: np.ndarray) -> float | None:
    return None if mask.size == 0 else float(mask.mean())


def _session_arrays(s: Session, acc: dict[str, list]) -> None:
    mains = s.main_requests
    n_in = np.array([r.input_tokens for r in mains], dtype=np.float64)
    t = np.array([r.t for r in mains], dtype=np.float64)
    api = np.array([r.api_time or 0.0 for r in mains], dtype=np.float64)
    acc["input"].append(n_in)
    acc["output"].append(np.array([r.output_tokens for r in mains], dtype=np.float64))
    acc["growth"].append(np.diff(n_in))
    acc["gap"].append(np.maximum(t[1:] - t[:-1] - api[:-1], 0.0))
    acc["compact"].append((n_in[:-1] > COMPACT_FROM) & (n_in[1:] < COMPACT_TO))
    acc["reuse"].append(np.array(reuse_fractions(mains, s.block_size), dtype=np.float64))
    acc["turns"].append(len(mains))
    acc["groups"] += group_sizes(s)
    acc["sub"].append(sum(len(a.requests) for a in s.subagents))


def compute_stats(sessions: Sequence[Session]) -> dict:
    """SPEC-table statistics of `sessions` (keys as in `agentserve trace stats --json`)."""
    acc: dict[str, list] = {k: [] for k in ("input", "output", "growth", "gap", "compact",
                                            "reuse", "turns", "groups", "sub")}
    for s in sessions:
        _session_arrays(s, acc)
    cat = {k: np.concatenate(acc[k]) if acc[k] else np.zeros(0)
           for k in ("input", "output", "growth", "gap", "compact", "reuse")}
    reuse = cat["reuse"]
    q3, q2 = (50, 90, 99), (50, 90)
    return {
        "traces": len(sessions),
        "main_requests": int(cat["input"].size),
        "subagent_requests": int(sum(acc["sub"])),
        "input_p50_p90_p99": _pct(cat["input"], q3),
        "output_p50_p90_p99": _pct(cat["output"], q3),
        "growth_p50_p90_p99": _pct(cat["growth"], q3),
        "gap_s_p50_p90_p99": _pct(cat["gap"], q3),
        "turns_p50_p90_p99": _pct(acc["turns"], q3),
        "share_turns_reuse_ge_90pct": _share(reuse >= 0.9),
        "median_reuse": None if reuse.size == 0 else float(np.median(reuse)),
        "prefix_reset_share": _share(reuse < RESET_BELOW),
        "compaction_share": _share(cat["compact"].astype(bool)),
        "subagent_groups": len(acc["groups"]),
        "subagent_group_size_p50_p90": _pct(acc["groups"], q2),
    }
