"""A run as the report reads it: loaded from a run folder (summary.json, requests.jsonl,
sessions.jsonl) or handed over in memory by bench and the simulator, and the tables the page
shows (per-turn, errors, deltas between runs).

The per-turn view groups requests by `RequestRecord.turn`: a main-agent turn and the
sub-agent requests that precede it (record.py) count as one turn, so a turn's tokens are what
the user's agent sent for that step of its task.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentserve.workload.record import RequestRecord, SessionRecord

MAX_TURN_ROWS = 40  # turns past this are summed into one row ("41+"), the table stays readable


@dataclass(slots=True)
class Plot:
    """A rendered plot (plots.py, report_plots.py) and the line the page shows under it."""

    name: str  # file stem: ttft_cdf, itl_cdf, ...
    title: str
    png: bytes
    caption: str  # what it shows and how to read it
    wide: bool = False  # a row of its own on the page (timelines, per-turn bars)


@dataclass(slots=True)
class Run:
    """One bench or sim run: its stage summaries, request records and session records."""

    name: str
    stages: list[dict]
    records: list[RequestRecord]
    sessions: list[dict] = field(default_factory=list)  # sessions.jsonl rows (SessionRecord.to_dict)

    @property
    def info(self) -> dict:
        """The `run` block of the first stage (report_meta.run_info), or {} for older runs."""
        return (self.stages[0].get("run") or {}) if self.stages else {}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    return out


def load_run(folder: str | Path, name: str | None = None) -> Run:
    """The run in `folder`; ValueError with the reason when it is not a run folder."""
    d = Path(folder)
    if not d.is_dir():
        raise ValueError(f"{d}: no such folder")
    summary = d / "summary.json"
    if not summary.exists():
        hint = " (a --num-profile-runs folder: pass profile_runs/run_NNNN)" if (d / "profile_runs").is_dir() else ""
        raise ValueError(f"{d}: no summary.json, not a bench or sim output folder{hint}")
    try:
        stages = json.loads(summary.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{summary}: not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(stages, dict):
        stages = [stages]
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
        raise ValueError(f"{summary}: expected a list of stage objects")
    records = [RequestRecord.from_dict(r) for r in _jsonl(d / "requests.jsonl")]
    return Run(name or d.resolve().name, stages, records, _jsonl(d / "sessions.jsonl"))


def run_from_memory(name: str, stages: list[dict], records: list[RequestRecord],
                    sessions: list[SessionRecord] | None) -> Run:
    return Run(name, stages, records, [s.to_dict() for s in sessions or []])


def run_names(folders: list[Path]) -> list[str]:
    """Folder names; where two are the same, their parent is prefixed (a/out, b/out)."""
    names = [f.resolve().name for f in folders]
    dup = {n for n, c in Counter(names).items() if c > 1}
    return [f"{f.resolve().parent.name}/{n}" if n in dup else n for f, n in zip(folders, names)]


def stage_label(s: dict, i: int = 0) -> str:
    """What a stage is: its concurrency, sessions at once, session rate, or schedule."""
    if s.get("concurrency") is not None:
        return f"concurrency {s['concurrency']}"
    if s.get("sessions") is not None:
        return f"{s['sessions']} sessions at once"
    if s.get("session_rate") is not None:
        return f"{s['session_rate']:g} sessions/s"
    if s.get("mode") == "schedule":
        return "schedule"
    return f"stage {s.get('stage', i)}"


def _p50(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def turn_rows(records: list[RequestRecord]) -> list[dict]:
    """One row a turn index: requests (main + sub), failed, input/cached/computed tokens (sums
    over answered requests), TTFT p50 (s) and ITL p50 (ms, per request)."""
    groups: dict[int, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(min(r.turn, MAX_TURN_ROWS), []).append(r)
    rows = []
    for t in sorted(groups):
        rs = groups[t]
        ok = [r for r in rs if r.ok]
        itl = [x * 1e3 for r in ok if (x := r.itl_mean()) is not None]
        n_in = sum(r.input_tokens for r in ok)
        cached = sum(min(r.cached_tokens, r.input_tokens) for r in ok)
        rows.append({"turn": f"{t}+" if t == MAX_TURN_ROWS else str(t), "turn_index": t,
                     "requests": len(rs), "sub_requests": sum(r.agent != "main" for r in rs),
                     "failed": len(rs) - len(ok), "input_tokens": n_in, "cached_tokens": cached,
                     "computed_tokens": n_in - cached,
                     "ttft_p50_s": _p50([r.ttft for r in ok if r.ttft is not None]),
                     "itl_p50_ms": _p50(itl)})
    return rows


def error_rows(records: list[RequestRecord]) -> list[dict]:
    """Failed requests grouped by error text: count, HTTP status, first time seen, an example id."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.error is not None:
            groups.setdefault(r.error, []).append(r)
    rows = []
    for err, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        first = min(rs, key=lambda r: r.start)
        statuses = sorted({str(r.status) for r in rs if r.status is not None})
        rows.append({"error": err, "count": len(rs), "status": ", ".join(statuses) or "no response",
                     "first_at_s": first.start, "example": first.request_id})
    return rows


# (label, path into a stage summary, unit, higher is better)
DELTA_METRICS: tuple[tuple[str, tuple[str, ...], str, bool], ...] = (
    ("TTFT p50", ("ttft_s", "p50"), "s", False),
    ("TTFT p90", ("ttft_s", "p90"), "s", False),
    ("ITL p50 (per request)", ("itl_ms", "p50"), "ms", False),
    ("ITL p90 (per request)", ("itl_ms", "p90"), "ms", False),
    ("ITL p50 (token-weighted)", ("itl_token_ms", "p50"), "ms", False),
    ("E2E p50", ("e2e_s", "p50"), "s", False),
    ("output tok/s", ("output_tok_s",), "tok/s", True),
    ("input tok/s", ("input_tok_s",), "tok/s", True),
    ("cached / input", ("cached_token_ratio",), "ratio", True),
    ("requests ok", ("requests_ok",), "requests", True),
    ("requests failed", ("requests_failed",), "requests", False),
)


def _get(s: dict, path: tuple[str, ...]) -> float | int | None:
    v: object = s
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v  # counts stay ints (58, not 58.000)


def delta_rows(stages: list[dict]) -> list[dict]:
    """One row a metric: each run's value for the stage, and each later run's change against
    the first (absolute and %), with whether the change is better or worse."""
    rows = []
    for label, path, unit, higher in DELTA_METRICS:
        vals = [_get(s, path) for s in stages]
        base = vals[0]
        deltas = []
        for v in vals[1:]:
            if base is None or v is None:
                deltas.append((None, None, ""))
                continue
            d = v - base
            pct = d / base * 100 if base else None
            verdict = "" if abs(d) < 1e-12 else ("better" if (d > 0) == higher else "worse")
            deltas.append((d, pct, verdict))
        rows.append({"metric": label, "unit": unit, "values": vals, "deltas": deltas})
    return rows
