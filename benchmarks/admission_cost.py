"""Engine-core time to admit one long prompt: hashing on the core thread vs before it.

Every agent turn re-sends a 100K-800K-token context. Before the scheduler can match it
against the prefix cache, each 16-token block needs its chained hash. Work on the core
thread delays every running stream's next token, so prompts of at least
``HASH_OFF_CORE_TOKENS`` are hashed on a worker thread in ``AsyncEngine.generate``. This
script times what the core thread does at admission (``update_hashes`` +
``get_computed_blocks``) for a prompt that arrives unhashed (before) and pre-hashed (now),
and the hashing itself. Median of ``--rounds``; vLLM's hash (sha256_cbor), block size 16.

    .venv/bin/python benchmarks/admission_cost.py --tokens 60000,200000,800000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.core.request import SamplingParams
from agentserve.engine.core.sequence import Sequence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="60000,200000,800000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench-out/admission_cost.json")
    a = ap.parse_args()
    eng = AsyncEngine.from_args(kv_cache_tokens=4096, block_size=16)  # tiny model, not started
    kv, rng = eng.core.kv, random.Random(0)
    rows = []
    for n in (int(x) for x in a.tokens.split(",")):
        prompt = [rng.randrange(16, 4000) for _ in range(n)]
        before, now, hashing = [], [], []
        for r in range(a.rounds):
            seq = Sequence(f"b{r}", list(prompt), SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            kv.update_hashes(seq)
            kv.get_computed_blocks(seq)
            before.append(time.perf_counter() - t0)
            seq = Sequence(f"n{r}", list(prompt), SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            kv.update_hashes(seq)  # what generate() now runs on a worker thread
            t1 = time.perf_counter()
            kv.update_hashes(seq)
            kv.get_computed_blocks(seq)
            now.append(time.perf_counter() - t1)
            hashing.append(t1 - t0)
        rows.append({"tokens": n, "core_before_ms": 1e3 * statistics.median(before),
                     "core_now_ms": 1e3 * statistics.median(now),
                     "hashing_ms": 1e3 * statistics.median(hashing)})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rounds": a.rounds, "rows": rows}, indent=2))
    t = Table("prompt tokens", "core thread, unhashed (ms)", "core thread, pre-hashed (ms)",
              "hashing off the core (ms)")
    for r in rows:
        t.add_row(f"{r['tokens']:,}", f"{r['core_before_ms']:.1f}", f"{r['core_now_ms']:.2f}",
                  f"{r['hashing_ms']:.1f}")
    Console().print(t)


if __name__ == "__main__":
    main()
