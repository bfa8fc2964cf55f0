"""The one metrics record of a request, shared by the replay client, the simulator and the report.

Times are seconds. `start` is on the producer's clock (the replay client uses
`time.perf_counter() - t0` of its run, the simulator its simulated clock); every other
time is relative to `start`, so records from both producers feed the same report.

ITL, two definitions (both kept because both are quoted in this field):
- `itl_mean` is AIPerf's `inter_token_latency`: `(e2e - ttft) / (output_tokens - 1)`,
  one value per request. The summary's `itl_ms` uses it, so our numbers compare with the
  reference runs, which were measured with AIPerf.
- `itl_samples` is the token-weighted chunk gap: a chunk of n tokens arriving g seconds
  after the previous chunk contributes n samples of g/n. With speculative decoding an
  engine streams several tokens per chunk, and counting one gap per chunk would inflate
  ITL by the acceptance length; the CDF plot uses these samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; `error` is None exactly when it succeeded."""

    request_id: str
    session_id: str
    turn: int  # main-agent turn index the request belongs to (sub-agents: the turn they precede)
    agent: str = "main"  # "main" or "sub"
    sub_index: int = -1  # position of the sub-agent in its group; -1 for the main agent
    stage: int = 0
    start: float = 0.0  # seconds on the producer's clock
    ttft: float | None = None  # seconds after start
    chunk_times: list[float] = field(default_factory=list)  # seconds after start, one per chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each chunk
    e2e: float | None = None
    input_tokens: int = 0  # tokens sent (after token scaling); replaced by usage when reported
    requested_input_tokens: int = 0  # what the workload asked (after token scaling); 0 = unknown
    output_tokens: int = 0  # usage.completion_tokens, else the sum of chunk_tokens
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    reusable_tokens: int = 0  # what an infinite prefix cache could have served for this input
    max_tokens: int = 0
    error: str | None = None
    status: int | None = None  # HTTP status; None when no response arrived

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end(self) -> float:
        """Producer-clock time the request finished (or gave up)."""
        return self.start + (self.e2e or 0.0)

    def itl_mean(self) -> float | None:
        """AIPerf's ITL: decode time over the tokens after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itl_samples(self) -> list[float]:
        """Token-weighted inter-chunk gaps (n samples of g/n for a chunk of n tokens after g)."""
        out: list[float] = []
        times, toks = self.chunk_times, self.chunk_tokens
        for i in range(1, len(times)):
            n = toks[i] if i < len(toks) else 1
            if n <= 0:
                continue  # an empty chunk (e.g. the usage chunk) carries no token
            out.extend([(times[i] - times[i - 1]) / n] * n)
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(slots=True)
class SessionRecord:
    """An agent program as the user sees it: how long the whole task took, against the trace."""

    session_id: str
    start: float  # first turn start, producer clock
    end: float  # last turn end, sub-agents included
    recorded_duration: float  # trace: last request t + api_time - first t, sub-agents included
    requests: int = 0
    failed: int = 0
    complete: bool = True  # False when cut short by --duration or Ctrl-C

    @property
    def makespan(self) -> float:
        return self.end - self.start

    @property
    def slowdown(self) -> float | None:
        """Replayed makespan over the recorded duration (>1: the user waited longer)."""
        if self.recorded_duration <= 0:
            return None
        return self.makespan / self.recorded_duration

    def to_dict(self) -> dict:
        d = asdict(self)
        d["makespan"] = self.makespan
        d["slowdown"] = self.slowdown
        return d


def itl_token_samples(records: list[RequestRecord]) -> np.ndarray:
    """Every record's `RequestRecord.itl_samples()`, concatenated, computed with numpy (the
    summary and the ITL plot read it): a simulated stage streams ~10^6 chunks, which the
    per-record Python loop took seconds over."""
    parts = []
    for r in records:
        t = r.chunk_times
        if len(t) < 2:
            continue
        n = np.ones(len(t) - 1, dtype=np.int64)  # chunk i >= 1 carries toks[i] (1 if unknown)
        k = min(len(r.chunk_tokens), len(t)) - 1
        if k > 0:
            n[:k] = r.chunk_tokens[1:k + 1]
        keep = n > 0  # an empty chunk (e.g. the usage chunk) carries no token
        n = n[keep]
        parts.append(np.repeat(np.diff(np.asarray(t, dtype=float))[keep] / n, n))
    return np.concatenate(parts) if parts else np.empty(0)
