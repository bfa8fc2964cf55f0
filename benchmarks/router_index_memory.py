"""Prefix index memory per block for N indexed blocks fed as synthetic KV events.

Events are applied through `EventApplier` exactly as from ZMQ: BlockStored batches of
64-bit hashes spread over `--holders` (endpoint, rank) pairs, with ~20% of blocks held by
two holders. Reports RSS growth per block and the index's own estimate.

    .venv/bin/python benchmarks/router_index_memory.py --blocks 10000000
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

from agentserve.kv.events import BlockStored, KVEventBatch
from agentserve.router.events import EventApplier
from agentserve.router.index import PrefixIndex


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10_000_000)
    ap.add_argument("--holders", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--out", default="bench-out/router_index_memory.json")
    a = ap.parse_args()
    rng = random.Random(0)
    idx = PrefixIndex()
    appliers = [EventApplier(idx, f"http://e{i}") for i in range(a.holders)]
    seqs = [0] * a.holders
    gc.collect()
    base = rss_bytes()
    t0 = time.perf_counter()
    done = 0
    while done < a.blocks:
        hashes = [rng.getrandbits(64) for _ in range(a.batch)]
        h = done // a.batch % a.holders
        ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                         block_size=16, lora_id=None, medium="GPU", lora_name=None)
        appliers[h].on_batch(0, seqs[h], KVEventBatch(ts=time.time(), events=[ev]))
        seqs[h] += 1
        if rng.random() < 0.2:  # the same blocks also on a second holder
            h2 = (h + 1) % a.holders
            appliers[h2].on_batch(0, seqs[h2], KVEventBatch(ts=time.time(), events=[ev]))
            seqs[h2] += 1
        done += a.batch
    secs = time.perf_counter() - t0
    gc.collect()
    grown = rss_bytes() - base
    n = len(idx)
    res = {"blocks": n, "holders": a.holders, "rss_bytes": grown,
           "bytes_per_block_rss": grown / n, "apply_blocks_per_s": done / secs}
    if n <= 2_000_000:
        res["bytes_per_block_estimate"] = idx.memory_bytes() / n
    print(json.dumps(res))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
