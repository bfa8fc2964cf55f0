"""Synthetic requests without a trace, as AIPerf's `--synthetic-input-tokens-mean/-stddev` and
`--output-tokens-mean/-stddev`: independent one-request sessions (no shared prefix), input and
output lengths drawn from normal distributions (rounded, at least 1), seeded."""

from __future__ import annotations

import numpy as np

from agentserve.workload.schema import Session, TraceRequest

BLOCK = 64  # hash-id granularity of a synthetic prompt; each session's ids are its own


def lengths(rng: np.random.Generator, n: int, mean: float, stddev: float) -> list[int]:
    """`n` lengths ~ N(mean, stddev), rounded, floored at 1 (stddev 0: all `mean`)."""
    draws = rng.normal(mean, stddev, n) if stddev > 0 else np.full(n, float(mean))
    return [max(1, int(round(x))) for x in draws]


def synthetic_sessions(count: int, isl: float, osl: float, isl_stddev: float = 0.0,
                       osl_stddev: float = 0.0, seed: int = 0) -> list[Session]:
    """`count` one-request sessions; session-local hash ids keep every prompt distinct."""
    rng = np.random.default_rng(seed)
    ins = lengths(rng, count, isl, isl_stddev)
    outs = lengths(rng, count, osl, osl_stddev)
    return [Session(f"syn{i}", BLOCK, [TraceRequest(t=0.0, input_tokens=n, output_tokens=o,
                                                    hash_ids=list(range(-(-n // BLOCK))))])
            for i, (n, o) in enumerate(zip(ins, outs))]
