"""KV transfer throughput over loopback vs a raw socket copy of the same bytes.

Both sides are measured the way an engine uses them, with the same reuse policy and the
same process layout: every sender (the prefill side's transfer servers and the raw socket
server) runs in a child process, every receiver in this one, as two engines would.

* ``kv pull``: the real `TcpBackend` end to end - request, per-chunk sums, the prefill
  side's pinned cache blocks -> socket -> the decode side's destination cache blocks
  (``pull_into``; the caches are allocated once and reused, like an engine's KV cache).
  ``zero-copy`` is the CPU path (``no-checksum``: without the per-chunk sums, for
  reference; the engine default keeps them); ``staged`` forces the device path (gather into a reused
  staging buffer on a helper thread, pipelined with the send; receive into reused
  buffers, scatter pipelined with the next receive).
* ``raw socket``: the same number of bytes per round over one persistent loopback
  connection, a 1-byte request then ``sendall`` of one preallocated buffer into
  ``recv_into`` of another preallocated buffer (both reused across rounds).

Destinations are measured contiguous (a fresh decode engine's free list) and fragmented
(every block elsewhere, 64 KiB pieces in the default shape: the worst case).

Each size gets warm-up rounds (connections, page faults of every buffer), then N rounds
with the variants interleaved; the median round time is reported. Target: kv pull >= 70%
of the raw copy. Writes JSON and prints a table.

    .venv/bin/python benchmarks/pd_transfer.py --out benchmarks/results/pd_transfer.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agentserve.engine.transfer_wire import PullSpec, TcpBackend
from agentserve.kv.transfer import gather_blocks


class Source:
    """All blocks pinned under one request id (the transfer server's view of a prefill)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def checkout(self, rid, idx, hashes):
        return list(idx)

    def checkin(self, rid, release):
        pass

    def release(self, rid):
        pass


def raw_server(lst: socket.socket, max_bytes: int) -> None:
    """Child side of the raw baseline: one preallocated source buffer, reused every round."""
    src = memoryview(bytearray(os.urandom(1024)) * (max_bytes // 1024 + 1))
    conn, _ = lst.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            head = conn.recv(8)
            if len(head) < 8:
                return
            conn.sendall(src[:int.from_bytes(head, "big")])


def make_cache(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def sender(conn, shape: tuple[int, ...], max_bytes: int) -> None:
    """The child process: raw server + zero-copy and staged KV transfer servers."""
    torch.set_num_threads(1)
    k, v = make_cache(shape)
    lst = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_server, args=(lst, max_bytes), daemon=True).start()
    ports = {"raw": lst.getsockname()[1]}
    servers = {name: TcpBackend("tok", staged=staged) for name, staged in (("zero-copy", False),
                                                                          ("staged", True))}
    for name, be in servers.items():
        ports[name] = be.serve(Source(k, v), "127.0.0.1", 0)
    conn.send(ports)
    conn.recv()  # stop
    for be in servers.values():
        be.close()
    os._exit(0)  # skip interpreter teardown under live server threads


class RawPair:
    """The receiving end of the raw baseline: one preallocated buffer, reused every round."""

    def __init__(self, port: int, max_bytes: int) -> None:
        self.dst = memoryview(bytearray(max_bytes))
        self.c = socket.create_connection(("127.0.0.1", port))
        self.c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.c.sendall(nbytes.to_bytes(8, "big"))
        got = 0
        while got < nbytes:
            n = self.c.recv_into(self.dst[got:nbytes])
            if n == 0:
                raise RuntimeError("raw peer closed")
            got += n
        return time.perf_counter() - t0

    def close(self) -> None:
        self.c.close()


def dst_ids(blocks: int, layout: str) -> list[int]:
    ids = list(range(blocks))
    return ids if layout == "contiguous" else ids[::-1]  # reversed: runs of one block


class KvPair:
    """The decode side: a client backend pulling into its own (reused) cache."""

    def __init__(self, port: int, shape: tuple[int, ...], staged: bool, chunk: int, layout: str,
                 checksum: bool = True) -> None:
        self.port, self.layout = port, layout
        self.cli = TcpBackend("tok", staged=staged, chunk_blocks=chunk, checksum=checksum)
        self.dk, self.dv = torch.zeros(shape), torch.zeros(shape)  # the decode side's cache

    def round(self, blocks: int) -> tuple[float, int]:
        ids = list(range(blocks))
        spec = PullSpec("127.0.0.1", self.port, "r", ids, [b""] * blocks, release=False)
        t0 = time.perf_counter()
        n = self.cli.pull_into(spec, self.dk, self.dv, dst_ids(blocks, self.layout))
        return time.perf_counter() - t0, n

    def check(self, k: torch.Tensor, v: torch.Tensor, blocks: int) -> bool:
        return torch.equal(gather_blocks(self.dk, self.dv, dst_ids(blocks, self.layout)),
                           gather_blocks(k, v, list(range(blocks))))

    def close(self) -> None:
        self.cli.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", default="16,64,256")
    ap.add_argument("--chunk-blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/pd_transfer.json")
    a = ap.parse_args()
    sizes = [int(x) for x in a.blocks.split(",")]
    shape = (a.layers, max(sizes), a.block_size, a.heads, a.head_dim)
    torch.set_num_threads(1)
    block_bytes = 2 * a.layers * a.block_size * a.heads * a.head_dim * 4
    max_bytes = max(sizes) * block_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender, args=(child, shape, max_bytes), daemon=True)
    proc.start()
    ports = parent.recv()
    raw = RawPair(ports["raw"], max_bytes)
    kvs = {f"{name} {layout}": KvPair(ports[name], shape, name == "staged", a.chunk_blocks, layout)
           for name in ("zero-copy", "staged") for layout in ("contiguous", "fragmented")}
    kvs["zero-copy contiguous no-checksum"] = KvPair(ports["zero-copy"], shape, False, a.chunk_blocks,
                                                     "contiguous", checksum=False)
    k, v = make_cache(shape)  # the child's cache, to check what arrived
    rows = []
    try:
        for n in sizes:
            nbytes = n * block_bytes
            times: dict[str, list[float]] = {"raw": [], **{name: [] for name in kvs}}
            for r in range(a.warmup + a.rounds):
                t_raw = raw.round(nbytes)
                got = {name: p.round(n) for name, p in kvs.items()}
                assert all(b == nbytes for _, b in got.values())
                if r >= a.warmup:
                    times["raw"].append(t_raw)
                    for name, (t, _) in got.items():
                        times[name].append(t)
            assert all(p.check(k, v, n) for p in kvs.values()), "pulled bytes differ from the source"
            med = {name: statistics.median(ts) for name, ts in times.items()}
            gbps = {name: nbytes / t / 1e9 for name, t in med.items()}
            rows.append({"blocks": n, "bytes": nbytes, "raw_socket_gbps": round(gbps["raw"], 3),
                         "kv_pull_gbps": {name: round(gbps[name], 3) for name in kvs},
                         "ratio": {name: round(gbps[name] / gbps["raw"], 3) for name in kvs},
                         "median_s": {name: round(t, 5) for name, t in med.items()}})
    finally:
        raw.close()
        for p in kvs.values():
            p.close()
        parent.send("stop")
        proc.join(10)
    table = Table(title=f"KV pull vs raw loopback socket (median of {a.rounds}, {a.warmup} warm-up, "
                        f"chunk {a.chunk_blocks} blocks, block {block_bytes / 2**20:.2f} MiB)")
    for col in ("blocks", "MiB", "raw GB/s", *[f"{name} GB/s (ratio)" for name in kvs]):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["blocks"]), f"{r['bytes'] / 2**20:.1f}", f"{r['raw_socket_gbps']:.2f}",
                      *[f"{r['kv_pull_gbps'][name]:.2f} ({r['ratio'][name]:.2f})" for name in kvs])
    Console().print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "shape": list(shape), "block_bytes": block_bytes, "chunk_blocks": a.chunk_blocks,
        "rounds": a.rounds, "warmup": a.warmup, "statistic": "median", "target_ratio": 0.7,
        "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "results": rows}, indent=2))


if __name__ == "__main__":
    main()
