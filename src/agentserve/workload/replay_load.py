"""Trace file → what the replay modes consume (sessions, or timed jobs for schedule mode).

The format is detected from the first object's keys: a Weka session has `requests`,
a mooncake record has `timestamp`/`input_length`. Parsing and the mooncake → sessions
grouping belong to `workload.traces` (imported lazily: not needed for a preloaded
workload); schedule mode keeps mooncake records as timed jobs.
"""

from __future__ import annotations

import gzip
import json
from typing import TYPE_CHECKING, Any

from agentserve.workload.replay_plan import Job, schedule_jobs
from agentserve.workload.schema import Session, TraceRequest

if TYPE_CHECKING:
    from agentserve.workload.replay import BenchConfig

MOONCAKE_BLOCK = 512


def detect_format(path: str) -> str:
    """"weka" or "mooncake", from the first JSON object of the (optionally gzipped) file,
    or of a folder's first trace file."""
    from agentserve.workload.traces import TraceFormatError, trace_files

    file = trace_files(path)[0]
    opener = gzip.open if file.name.endswith(".gz") else open
    with opener(file, "rt") as f:
        for no, line in enumerate(f, 1):
            if line.strip():
                try:
                    first = json.loads(line)
                except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8 text
                    raise TraceFormatError(file, no, f"not a JSON object: {e}") from None
                break
        else:
            raise ValueError(f"{file}: empty trace")
    if isinstance(first, dict) and "requests" in first:
        return "weka"
    if isinstance(first, dict) and ("input_length" in first or "timestamp" in first):
        return "mooncake"
    keys = sorted(first)[:8] if isinstance(first, dict) else type(first).__name__
    raise ValueError(f"{path}: neither a Weka session (needs 'requests') nor a mooncake record "
                     f"(needs 'timestamp', 'input_length'); first object has {keys}")


def _get(rec: Any, name: str, default: Any = None) -> Any:
    return rec.get(name, default) if isinstance(rec, dict) else getattr(rec, name, default)


def _times(records: list[Any]) -> list[float]:
    """Seconds per record: its `timestamp` (ms), else its session's last time plus `delay` (ms)."""
    last: dict[Any, float] = {}
    out = []
    for r in records:
        ts, sid = _get(r, "timestamp"), _get(r, "session_id")
        if ts is not None:
            t = float(ts) / 1000.0
        else:
            t = last.get(sid, 0.0) + float(_get(r, "delay") or 0.0) / 1000.0
        last[sid] = t
        out.append(t)
    return out


def mooncake_jobs(records: list[Any], block_size: int = MOONCAKE_BLOCK) -> list[Job]:
    """One job per record at its time (relative to the first); hash ids are global."""
    if not records:
        return []
    times = _times(records)
    t_first = min(times)
    jobs = []
    for i, (r, t) in enumerate(zip(records, times)):
        req = TraceRequest(t=t - t_first, input_tokens=int(_get(r, "input_length")),
                           output_tokens=int(_get(r, "output_length")), hash_ids=list(_get(r, "hash_ids")))
        sid = _get(r, "session_id")
        jobs.append(Job(str(sid) if sid is not None else f"m{i}", "", block_size, req, 0, at=t - t_first))
    jobs.sort(key=lambda j: j.at)
    return jobs


def load_workload(c: "BenchConfig") -> tuple[list[Session], list[Job]]:
    """Sessions (sessions/concurrency modes) and jobs (schedule mode) for a config."""
    spacing = 1.0 / c.session_rate if c.session_rate else 0.0
    if c.trace_jobs is not None:
        return list(c.trace_sessions or []), c.trace_jobs
    if c.trace_sessions is not None:
        sessions = c.trace_sessions
        return sessions, schedule_jobs(sessions, spacing) if c.mode == "schedule" else []
    if not c.trace:
        raise ValueError("no workload: pass --trace FILE")
    from agentserve.workload import traces

    if detect_format(c.trace) == "weka":
        sessions = traces.load_sessions(c.trace, skip_bad=True).sessions
        return sessions, schedule_jobs(sessions, spacing) if c.mode == "schedule" else []
    records = traces.load_mooncake(c.trace, block_size=MOONCAKE_BLOCK)
    if c.mode == "schedule":
        return [], mooncake_jobs(records)
    return traces.mooncake_to_sessions(records, block_size=MOONCAKE_BLOCK), []
