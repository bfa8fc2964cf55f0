"""Trace loaders and writers: the Weka session format and AIPerf's `mooncake_trace` JSONL.

Weka (one JSON object per session, see SPEC.md "Trace formats") loads into `Session`s;
mooncake records (one request per line) load into `MooncakeRecord`s and convert both ways.
Both readers accept JSONL or a folder of `.json`/`.jsonl` files, gzip (`.gz`) or plain.

Speed: the 471-session sample is ~300 MB of JSON, nearly all of it `hash_ids`. Each request
is decoded with msgspec into raw fields; the `hash_ids` text of a request that extends the
previous one (the common case) is parsed only past the shared prefix, and the new list
reuses the previous list's int objects, so load time and memory scale with *new* blocks.
"""

from __future__ import annotations

import gc
import gzip
import math
from contextlib import contextmanager
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from agentserve.workload.schema import Session, Subagent, TraceRequest

__all__ = [
    "LoadResult", "MooncakeRecord", "TraceFormatError", "load_sessions", "load_mooncake",
    "load_any", "write_sessions", "write_mooncake", "mooncake_to_sessions",
    "sessions_to_mooncake", "reblock", "iter_lines",
]


class TraceFormatError(ValueError):
    """A trace line that cannot be read: says which file, which line and why."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}:{line}: {reason}")

    def __reduce__(self):  # rebuilt from its fields: it crosses process pools (`plan`'s workers)
        return (type(self), (self.path, self.line, self.reason))


@dataclass(slots=True)
class LoadResult:
    sessions: list[Session]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)


class MooncakeRecord(msgspec.Struct, omit_defaults=True):
    """One AIPerf `mooncake_trace` line. `timestamp` and `delay` are milliseconds."""

    input_length: int
    output_length: int
    hash_ids: list[int] = []
    timestamp: float | None = None
    session_id: str | None = None
    delay: float | None = None


# -- reading files ---------------------------------------------------------------------

_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def trace_files(path: str | Path) -> list[Path]:
    """The trace files at `path`: the file itself, or a folder's .json/.jsonl(.gz) files."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.name.endswith(_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"{p}: folder holds no .json/.jsonl(.gz) trace files")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such trace file or folder")
    return [p]


def _read(p: Path) -> bytes:
    with (gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")) as f:
        return f.read()


def iter_lines(path: str | Path) -> Iterator[tuple[Path, int, bytes]]:
    """Yield (file, line number, JSON text) for every object: a line of a .jsonl file,
    or the whole of a .json file (which may be pretty-printed)."""
    for p in trace_files(path):
        data = _read(p)
        if p.name.endswith((".json", ".json.gz")):
            if data.strip():
                yield p, 1, data
            continue
        for no, line in enumerate(data.split(b"\n"), 1):
            if line.strip():
                yield p, no, line


def _reason(e: Exception) -> str:
    return str(e) or type(e).__name__


# -- Weka ------------------------------------------------------------------------------

_OBJ = msgspec.json.Decoder(dict[str, msgspec.Raw])
_INTS = msgspec.json.Decoder(list[int])
_ANY = msgspec.json.Decoder()


class _ReqWire(msgspec.Struct):
    t: float
    type: str = "n"
    model: str | None = None
    in_: int = msgspec.field(name="in", default=-1)
    out: int = -1
    hash_ids: msgspec.Raw = msgspec.Raw(b"[]")
    api_time: float | None = None
    think_time: float | None = None
    stop: str | None = None
    ttft: float | None = None
    agent_id: str | None = None
    subagent_type: str | None = None
    duration_ms: float | None = None
    status: str | None = None
    requests: list[msgspec.Raw] = []


class _SessWire(msgspec.Struct):
    id: str
    block_size: int
    requests: list[msgspec.Raw]
    hash_id_scope: str = "local"


_REQ = msgspec.json.Decoder(_ReqWire)
_SESS = msgspec.json.Decoder(_SessWire)
_REQ_KEYS = frozenset({"t", "type", "model", "in", "out", "hash_ids", "api_time", "think_time",
                       "stop", "ttft"})
_SUB_KEYS = frozenset({"t", "type", "agent_id", "subagent_type", "duration_ms", "status",
                       "requests"})
_SESS_KEYS = frozenset({"id", "block_size", "requests", "hash_id_scope"})


class _Ids:
    """Parses hash_ids text, reusing the previous request's list when this one extends it."""

    __slots__ = ("body", "ids")

    def __init__(self) -> None:
        self.body, self.ids = b"", []

    def parse(self, raw: bytes) -> list[int]:
        body = raw.rstrip()[:-1]
        ids = self._extend(body, self.body, len(self.ids))
        if ids is None:  # the previous request's partial last block is usually rewritten
            cut = self.body.rfind(b",")
            ids = self._extend(body, self.body[:cut], len(self.ids) - 1) if cut > 0 else None
        if ids is None:
            ids = _INTS.decode(raw)
        self.body, self.ids = body, ids
        return ids

    def _extend(self, body: bytes, prefix: bytes, keep: int) -> list[int] | None:
        n = len(prefix)
        if not n or not body.startswith(prefix) or body[n:n + 1] not in (b",", b""):
            return None
        rest = body[n + 1:]
        head = self.ids[:keep] if keep < len(self.ids) else list(self.ids)
        return head + _INTS.decode(b"[" + rest + b"]") if rest.strip() else head


def _extra(raw: msgspec.Raw, known: frozenset[str]) -> dict:
    fields = _OBJ.decode(raw)
    return {k: _ANY.decode(v) for k, v in fields.items() if k not in known}


def _request(raw: msgspec.Raw, ids: _Ids, where: str) -> TraceRequest | Subagent:
    try:
        w = _REQ.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"{where}: {e}") from None
    if w.type == "subagent":
        sub_ids = _Ids()  # a sub-agent's context is its own
        reqs = [_request(r, sub_ids, f"{where}.requests[{j}]") for j, r in enumerate(w.requests)]
        if any(isinstance(r, Subagent) for r in reqs):
            raise ValueError(f"{where}: nested sub-agent inside a sub-agent is not supported")
        return Subagent(t=w.t, requests=reqs, agent_id=w.agent_id, subagent_type=w.subagent_type,
                        duration_ms=w.duration_ms, status=w.status, extra=_extra(raw, _SUB_KEYS))
    if w.in_ < 0 or w.out < 0:
        raise ValueError(f"{where}: request needs non-negative 'in' and 'out' token counts")
    try:
        hash_ids = ids.parse(bytes(w.hash_ids))
    except msgspec.DecodeError as e:
        raise ValueError(f"{where}.hash_ids: {e}") from None
    return TraceRequest(t=w.t, input_tokens=w.in_, output_tokens=w.out, hash_ids=hash_ids,
                        api_time=w.api_time, think_time=w.think_time, kind=w.type, model=w.model,
                        stop=w.stop, ttft=w.ttft, extra=_extra(raw, _REQ_KEYS))


def decode_session(text: bytes) -> Session:
    """Decode one Weka session object; raises ValueError with the JSON path on bad input."""
    try:
        w = _SESS.decode(text)
    except msgspec.DecodeError as e:
        raise ValueError(str(e)) from None
    if w.block_size <= 0:
        raise ValueError(f"block_size must be positive, got {w.block_size}")
    ids = _Ids()
    items = [_request(r, ids, f"requests[{i}]") for i, r in enumerate(w.requests)]
    return Session(id=w.id, block_size=w.block_size, items=items, hash_id_scope=w.hash_id_scope,
                   extra=_extra(msgspec.Raw(text), _SESS_KEYS))


@contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC while decoding: loading allocates millions of lists that form
    no cycles, and collections triggered by them cost ~30% of load time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_sessions(path: str | Path, skip_bad: bool = False) -> LoadResult:
    """Load Weka sessions from a JSONL file or a folder of JSON(L) files, gzip or plain.

    A malformed object raises `TraceFormatError` (file, line, reason); with `skip_bad`
    it is counted in `skipped` and its message kept in `errors` instead.
    """
    out = LoadResult(sessions=[])
    with _no_gc():
        for p, no, text in iter_lines(path):
            try:
                out.sessions.append(decode_session(text))
            except ValueError as e:
                err = TraceFormatError(p, no, _reason(e))
                if not skip_bad:
                    raise err from None
                out.skipped += 1
                out.errors.append(str(err))
    return out


def _json_num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _encode_request(r: TraceRequest) -> dict:
    d: dict = {"t": _json_num(r.t), "type": r.kind}
    if r.model is not None:
        d["model"] = r.model
    d.update({"in": r.input_tokens, "out": r.output_tokens, "hash_ids": r.hash_ids})
    for k in ("api_time", "think_time", "stop", "ttft"):
        if (v := getattr(r, k)) is not None:
            d[k] = v
    d.update(r.extra)
    return d


def _encode_item(it: TraceRequest | Subagent) -> dict:
    if isinstance(it, TraceRequest):
        return _encode_request(it)
    d: dict = {"t": _json_num(it.t), "type": "subagent"}
    for k in ("agent_id", "subagent_type", "duration_ms", "status"):
        if (v := getattr(it, k)) is not None:
            d[k] = v
    d.update(it.extra)
    d["requests"] = [_encode_request(r) for r in it.requests]
    return d


def encode_session(s: Session) -> dict:
    """The Weka JSON object of a session (known fields first, then its `extra`)."""
    d = {"id": s.id, "block_size": s.block_size, "hash_id_scope": s.hash_id_scope, **s.extra}
    d["requests"] = [_encode_item(it) for it in s.items]
    return d


def _open_out(path: str | Path):
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # compresslevel 1: traces are ~90% integers; higher levels cost 5x time for ~10% size.
    return gzip.open(p, "wb", compresslevel=1) if p.name.endswith(".gz") else open(p, "wb")


def write_sessions(sessions: Iterable[Session], path: str | Path) -> None:
    """Write Weka JSONL, one session per line; gzip when the name ends in `.gz`."""
    enc = msgspec.json.Encoder()
    with _open_out(path) as f:
        for s in sessions:
            f.write(enc.encode(encode_session(s)) + b"\n")


# -- mooncake --------------------------------------------------------------------------

_MC = msgspec.json.Decoder(MooncakeRecord)


def _check_record(r: MooncakeRecord, block_size: int) -> None:
    if r.input_length < 0 or r.output_length < 0:
        raise ValueError("input_length and output_length must be non-negative")
    if len(r.hash_ids) > math.ceil(r.input_length / block_size):
        raise ValueError(f"{len(r.hash_ids)} hash_ids for input_length {r.input_length} is more "
                         f"than one per {block_size}-token block: wrong --block-size?")


def load_mooncake(path: str | Path, block_size: int = 512,
                  skip_bad: bool = False) -> list[MooncakeRecord]:
    """Load AIPerf `mooncake_trace` JSONL whose `hash_ids` are per `block_size` tokens.

    Bad lines raise `TraceFormatError`; with `skip_bad` they are dropped (use
    `load_any` to also get the count and messages).
    """
    return _load_mooncake(path, block_size, skip_bad)[0]


def _load_mooncake(path, block_size, skip_bad) -> tuple[list[MooncakeRecord], LoadResult]:
    recs: list[MooncakeRecord] = []
    res = LoadResult(sessions=[])
    for p, no, text in iter_lines(path):
        try:
            r = _MC.decode(text)
            _check_record(r, block_size)
            recs.append(r)
        except (ValueError, msgspec.DecodeError) as e:
            err = TraceFormatError(p, no, _reason(e))
            if not skip_bad:
                raise err from None
            res.skipped += 1
            res.errors.append(str(err))
    return recs, res


def is_mooncake(path: str | Path) -> bool:
    """Sniff the format from the first object: mooncake lines carry `input_length`."""
    for _, _, text in iter_lines(path):
        return b'"input_length"' in text[:4096] and b'"requests"' not in text[:4096]
    return False


def load_any(path: str | Path, block_size: int = 512, skip_bad: bool = False) -> LoadResult:
    """Load Weka or mooncake (detected) as sessions; `block_size` is mooncake's."""
    if not is_mooncake(path):
        return load_sessions(path, skip_bad)
    recs, res = _load_mooncake(path, block_size, skip_bad)
    res.sessions = mooncake_to_sessions(recs, block_size)
    return res


from agentserve.workload.traces_convert import (  # noqa: E402  (re-exported API)
    mooncake_to_sessions, reblock, sessions_to_mooncake, write_mooncake,
)
