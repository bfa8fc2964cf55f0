"""KV transfer throughput over loopback vs a raw socket copy of the same bytes.

Serves N device blocks of a KV cache from a `RemoteKV`-style source through the real
`TcpBackend` (gather -> framed zero-copy send -> recv_into -> size/sum check) and
compares with the same number of bytes through a bare socket (sendall/recv_into of one
preallocated buffer). Target: >= 70% of the raw copy. Writes JSON and prints a table.

    .venv/bin/python benchmarks/pd_transfer.py --out benchmarks/results/pd_transfer.json
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import torch

from agentserve.engine.transfer_wire import PullSpec, TcpBackend
from agentserve.kv.transfer import gather_blocks


class Source:
    """All blocks pinned under one request id; hashes are the block index."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def checkout(self, rid, idx, hashes):
        return list(idx)

    def checkin(self, rid, release):
        pass

    def release(self, rid):
        pass

    def gather(self, ids):
        return gather_blocks(self.k, self.v, ids)


def raw_copy(nbytes: int, reps: int) -> float:
    """GB/s of sendall/recv_into of one buffer over loopback (best of reps)."""
    lst = socket.create_server(("127.0.0.1", 0))
    src = bytearray(nbytes)

    def serve() -> None:
        conn, _ = lst.accept()
        with conn:
            for _ in range(reps):
                conn.recv(1)
                conn.sendall(src)
    threading.Thread(target=serve, daemon=True).start()
    c = socket.create_connection(lst.getsockname())
    dst = memoryview(bytearray(nbytes))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        c.sendall(b"x")
        got = 0
        while got < nbytes:
            got += c.recv_into(dst[got:])
        best = min(best, time.perf_counter() - t0)
    c.close()
    lst.close()
    return nbytes / best / 1e9


def kv_pull(k: torch.Tensor, v: torch.Tensor, blocks: int, reps: int) -> tuple[float, int]:
    be = TcpBackend("tok")
    port = be.serve(Source(k, v), "127.0.0.1", 0)
    cli = TcpBackend("tok")
    spec = PullSpec("127.0.0.1", port, "r", list(range(blocks)), [b""] * blocks, release=False)
    best, nbytes = float("inf"), 0
    for _ in range(reps):
        t0 = time.perf_counter()
        data = cli.pull(spec)
        best = min(best, time.perf_counter() - t0)
        nbytes = data.numel() * data.element_size()
    cli.close()
    be.close()
    return nbytes / best / 1e9, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/pd_transfer.json")
    a = ap.parse_args()
    sizes = [int(x) for x in a.blocks.split(",")]
    shape = (a.layers, max(sizes), a.block_size, a.heads, a.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    rows = []
    for n in sizes:
        kv_gbps, nbytes = kv_pull(k, v, n, a.reps)
        raw = raw_copy(nbytes, a.reps)
        rows.append({"blocks": n, "bytes": nbytes, "kv_pull_gbps": round(kv_gbps, 3),
                     "raw_socket_gbps": round(raw, 3), "ratio": round(kv_gbps / raw, 3)})
    print(f"{'blocks':>7} {'MiB':>8} {'kv pull GB/s':>13} {'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['bytes'] / 2**20:>8.1f} {r['kv_pull_gbps']:>13.2f} "
              f"{r['raw_socket_gbps']:>9.2f} {r['ratio']:>6.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"shape": list(shape), "results": rows,
                                       "target_ratio": 0.7}, indent=2))


if __name__ == "__main__":
    main()
