"""Weka sessions <-> mooncake records, and hash ids from one block size to another.

Mapping (both directions):
- a mooncake `session_id` is a session; records without one are one-request sessions;
- mooncake `timestamp` (ms, absolute) is kept per session as `extra["start_ms"]` plus
  per-request `t` (s, from the session start); `delay` (ms) is the idle gap after the
  previous turn of the same session: `t[i] - t[i-1] - api_time[i-1]`, floored at 0;
- a Weka sub-agent becomes its own mooncake session `"<session>:<agent>"` (mooncake has no
  nesting), so converting back yields it as a separate session;
- Weka sessions have no absolute start, so each starts at `extra.get("start_ms", 0)`.

Re-blocking keeps prefix structure exact: block j of the new size gets an id interned from
(id of block j-1, the old ids it covers, its offset in the first of them), so two inputs share a
new-size prefix exactly when they shared the underlying old-size prefix. Local-scope ids
are made distinct per session because mooncake ids are global to the file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import msgspec

from agentserve.workload.schema import Session, Subagent, TraceRequest
from agentserve.workload.stats import common_prefix_len
from agentserve.workload.traces import MooncakeRecord, _open_out


class _Reblocker:
    """Maps one context's id lists (src-size blocks) to dst-size ids, memoising the
    shared prefix with the previous request so only new blocks are computed."""

    def __init__(self, src: int, dst: int, table: dict, root: object) -> None:
        self.src, self.dst, self.table, self.root = src, dst, table, root
        self.prev_ids: list[int] = []
        self.prev_out: list[int] = []
        self.prev_len = 0

    def __call__(self, ids: list[int], n_tokens: int) -> list[int]:
        src, dst, table = self.src, self.dst, self.table
        length = min(n_tokens, len(ids) * src)
        shared = min(common_prefix_len(ids, self.prev_ids) * src, self.prev_len, length)
        keep = min(shared // dst, len(self.prev_out))
        out = self.prev_out[:keep]
        parent = out[-1] if keep else self.root
        for j in range(keep, math.ceil(length / dst)):
            lo, hi = j * dst, min((j + 1) * dst, length)
            a, b = lo // src, (hi - 1) // src
            key = (parent, tuple(ids[a:b + 1]), lo - a * src)
            parent = table.setdefault(key, len(table))
            out.append(parent)
        self.prev_ids, self.prev_out, self.prev_len = ids, out, length
        return out


def reblock(hash_ids: list[int], input_tokens: int, src: int, dst: int,
            table: dict | None = None) -> list[int]:
    """Hash ids of one input at block size `dst`, from its ids at block size `src`."""
    return _Reblocker(src, dst, {} if table is None else table, None)(hash_ids, input_tokens)


def _ms(x: float) -> float | int:
    x = round(x, 3)
    return int(x) if x.is_integer() else x


def mooncake_to_sessions(records: Iterable[MooncakeRecord], block_size: int = 512) -> list[Session]:
    """Group records into sessions (by `session_id`, in order of first appearance)."""
    groups: dict[str, list[MooncakeRecord]] = {}
    single: set[str] = set()
    for i, r in enumerate(records):
        sid = r.session_id
        if sid is None:
            sid = f"mc-{i:06d}"
            single.add(sid)
        groups.setdefault(sid, []).append(r)
    return [_mc_session(sid, recs, block_size, sid in single) for sid, recs in groups.items()]


def _mc_session(sid: str, recs: list[MooncakeRecord], block_size: int, single: bool) -> Session:
    start = recs[0].timestamp if recs[0].timestamp is not None else 0.0
    items: list[TraceRequest | Subagent] = []
    t = 0.0
    for r in recs:
        if r.timestamp is not None:
            t = (r.timestamp - start) / 1000.0
        elif r.delay is not None and items:
            t += r.delay / 1000.0  # the gap after the previous turn; its duration is unknown
        items.append(TraceRequest(t=t, input_tokens=r.input_length, output_tokens=r.output_length,
                                  hash_ids=list(r.hash_ids),
                                  think_time=None if r.delay is None else r.delay / 1000.0))
    extra: dict = {"start_ms": _ms(start)}
    if single:
        extra["mooncake_no_session"] = True
    return Session(id=sid, block_size=block_size, items=items, hash_id_scope="global", extra=extra)


def _records(reqs: list[TraceRequest], sid: str | None, t0_ms: float,
             rb: _Reblocker) -> list[MooncakeRecord]:
    out = []
    for i, r in enumerate(reqs):
        delay = None
        if i and sid is not None:
            p = reqs[i - 1]
            delay = _ms(max(0.0, (r.t - p.t - (p.api_time or 0.0)) * 1000.0))
        out.append(MooncakeRecord(input_length=r.input_tokens, output_length=r.output_tokens,
                                  hash_ids=rb(r.hash_ids, r.input_tokens),
                                  timestamp=_ms(t0_ms + r.t * 1000.0), session_id=sid, delay=delay))
    return out


def sessions_to_mooncake(sessions: Iterable[Session], block_size: int = 512) -> list[MooncakeRecord]:
    """Flatten sessions to mooncake records at `block_size`, sorted by timestamp."""
    table: dict = {}
    out: list[MooncakeRecord] = []
    for n, s in enumerate(sessions):
        root = n if s.hash_id_scope == "local" else None  # local ids: distinct per session
        start = float(s.extra.get("start_ms", 0.0))
        sid = None if s.extra.get("mooncake_no_session") else s.id
        out += _records(s.main_requests, sid, start,
                        _Reblocker(s.block_size, block_size, table, root))
        for k, sub in enumerate(s.subagents):
            name = f"{s.id}:{sub.agent_id or k}"
            out += _records(sub.requests, name, start + sub.t * 1000.0,
                            _Reblocker(s.block_size, block_size, table, root))
    out.sort(key=lambda r: r.timestamp or 0.0)  # stable: a session's turns keep their order
    return out


def write_mooncake(data: Iterable[MooncakeRecord] | Iterable[Session], path: str | Path,
                   block_size: int = 512) -> None:
    """Write mooncake JSONL (gzip if `.gz`); sessions are converted at `block_size` first."""
    data = list(data)
    if data and isinstance(data[0], Session):
        data = sessions_to_mooncake(data, block_size)
    enc = msgspec.json.Encoder()
    with _open_out(path) as f:
        for r in data:
            f.write(enc.encode(r) + b"\n")
