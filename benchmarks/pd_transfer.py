"""KV transfer throughput over loopback vs a raw socket copy of the same bytes.

Both sides are measured the way an engine uses them, with the same reuse policy and the
same process layout: every sender (the prefill side's transfer servers and the raw socket
server) runs in a child process, every receiver in this one, as two engines would.

* ``kv pull``: the real `TcpBackend` end to end - request, per-chunk sums, the prefill
  side's pinned cache blocks -> socket -> the decode side's destination cache blocks
  (``pull_into``; the caches are allocated once and reused, like an engine's KV cache).
  The prefill side's per-block sums are computed once when its blocks are pinned, as
  `RemoteKV.pin` does on its kv-pin-sum thread (timed separately: ``pin_sum_gbps``); the
  decode side sums every byte it receives. ``zero-copy`` is the CPU path; ``staged``
  forces the device path (gather into a reused staging buffer on a helper thread,
  pipelined with the send; receive into reused buffers, scatter pipelined with the next
  receive). For reference: ``sums at pull`` (a pull that arrives before its pin's sums
  are ready: the sender sums as it sends) and ``no-checksum``.
* ``raw socket``: the same number of bytes per round over one persistent loopback
  connection, a 8-byte request then ``sendall`` of one preallocated buffer into
  ``recv_into(..., MSG_WAITALL)`` of another preallocated buffer (both reused across
  rounds; the same receive call the KV pull uses).

Destinations are measured contiguous (a fresh decode engine's free list) and fragmented
(every block elsewhere, 64 KiB pieces in the default shape: the worst case).

Each size gets warm-up rounds (connections, page faults of every buffer), then N rounds;
each round runs raw and every variant once, in a shuffled order. Reported per variant:
the median round time as GB/s, ``ratio`` = raw median time / variant median time, the
median of the per-round ratios (``paired_ratio``: each against the raw copy of its own
round, robust to load that drifts between rounds), ``best_ratio`` (fastest round of each:
what the path can do when other processes leave it alone), and CPU seconds per GB on
each side (receiver: this process; sender: the child), which depends less on how busy
the machine is. Target: ratio >= 0.7. Writes JSON and prints a table.

    .venv/bin/python benchmarks/pd_transfer.py --out benchmarks/results/pd_transfer.json
    python3 benchmarks/pd_transfer.py --device cuda   # the staged path on a GPU (scripts/gpu_checks.sh)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agentserve.kv.remote.backend import PullSpec
from agentserve.kv.remote.frames import block_sums
from agentserve.kv.remote.wire import TcpBackend
from agentserve.kv.offload.copy import gather_blocks


class Source:
    """All blocks pinned under one request id (the transfer server's view of a prefill).

    ``presum``: the per-block sums are computed once, as `RemoteKV.pin` does."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, presum: bool) -> None:
        self.k, self.v = k, v
        self.sums = block_sums(k, v, list(range(k.shape[1]))) if presum else None

    def checkout(self, rid, idx, hashes):
        return list(idx)

    def checkin(self, rid, release):
        pass

    def release(self, rid):
        pass

    def pinned_sums(self, rid, idx):
        return None if self.sums is None else [self.sums[i] for i in idx]


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


def sender(conn, shape: tuple[int, ...], max_bytes: int, device: str) -> None:
    """The child process: raw server + KV transfer servers; answers CPU-time queries.

    The staged server sends from a copy of the cache on ``device`` (the path a GPU
    engine's pins take); the zero-copy servers send from host memory."""
    torch.set_num_threads(1)
    k, v = make_cache(shape)
    t0 = time.perf_counter()
    pinned = Source(k, v, presum=True)
    pin_sum_s = time.perf_counter() - t0
    staged = pinned if device == "cpu" else Source(k.to(device), v.to(device), presum=True)
    lst = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_server, args=(lst, max_bytes), daemon=True).start()
    ports: dict = {"raw": lst.getsockname()[1], "pin_sum_s": pin_sum_s}
    servers = {"zero-copy": (TcpBackend("tok", staged=False), pinned),
               "staged": (TcpBackend("tok", staged=True), staged),
               "zero-copy live": (TcpBackend("tok", staged=False), Source(k, v, presum=False))}
    for name, (be, src) in servers.items():
        ports[name] = be.serve(src, "127.0.0.1", 0)
    conn.send(ports)
    while conn.recv() == "cpu":
        conn.send(time.process_time())
    for be, _ in servers.values():
        be.close()
    os._exit(0)  # skip interpreter teardown under live server threads


class RawPair:
    """The receiving end of the raw baseline: one preallocated buffer, reused every round."""

    def __init__(self, port: int, max_bytes: int) -> None:
        self.dst = memoryview(bytearray(max_bytes))
        self.c = socket.create_connection(("127.0.0.1", port))
        self.c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round(self, blocks: int, nbytes: int) -> int:
        self.c.sendall(nbytes.to_bytes(8, "big"))
        got = 0
        while got < nbytes:
            # MSG_WAITALL: one syscall per round when the kernel allows, as the KV pull's
            # receiver does; the baseline must not be handicapped by a slower loop.
            n = self.c.recv_into(self.dst[got:nbytes], 0, socket.MSG_WAITALL)
            if n == 0:
                raise RuntimeError("raw peer closed")
            got += n
        return got

    def close(self) -> None:
        self.c.close()


def dst_ids(blocks: int, layout: str) -> list[int]:
    ids = list(range(blocks))
    return ids if layout == "contiguous" else ids[::-1]  # reversed: runs of one block


class KvPair:
    """The decode side: a client backend pulling into its own (reused) cache."""

    def __init__(self, port: int, shape: tuple[int, ...], staged: bool, chunk: int, layout: str,
                 checksum: bool = True, device: str = "cpu") -> None:
        self.port, self.layout = port, layout
        self.cli = TcpBackend("tok", staged=staged, chunk_blocks=chunk, checksum=checksum)
        # the decode side's cache
        self.dk, self.dv = torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def round(self, blocks: int, nbytes: int) -> int:
        ids = list(range(blocks))
        spec = PullSpec("127.0.0.1", self.port, "r", ids, [b""] * blocks, release=False)
        return self.cli.pull_into(spec, self.dk, self.dv, dst_ids(blocks, self.layout))

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
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="order of the variants in each round")
    ap.add_argument("--device", default="cpu",
                    help="where the staged variants' caches live (cuda: the GPU path, both sides)")
    ap.add_argument("--out", default="benchmarks/results/pd_transfer.json")
    a = ap.parse_args()
    sizes = [int(x) for x in a.blocks.split(",")]
    if not sizes or min(sizes) < 1 or a.rounds < 1 or a.warmup < 0 or a.chunk_blocks < 1:
        ap.error("--blocks, --rounds and --chunk-blocks must be positive")
    shape = (a.layers, max(sizes), a.block_size, a.heads, a.head_dim)
    torch.set_num_threads(1)
    block_bytes = 2 * a.layers * a.block_size * a.heads * a.head_dim * 4
    max_bytes = max(sizes) * block_bytes
    load_start = os.getloadavg()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender, args=(child, shape, max_bytes, a.device), daemon=True)
    proc.start()
    ports = parent.recv()
    pairs: dict = {"raw": RawPair(ports["raw"], max_bytes)}
    for name in ("zero-copy", "staged"):
        for layout in ("contiguous", "fragmented"):
            staged = name == "staged"
            pairs[f"{name} {layout}"] = KvPair(ports[name], shape, staged, a.chunk_blocks, layout,
                                               device=a.device if staged else "cpu")
    pairs["zero-copy contiguous, sums at pull"] = KvPair(ports["zero-copy live"], shape, False,
                                                         a.chunk_blocks, "contiguous")
    pairs["zero-copy contiguous, no checksum"] = KvPair(ports["zero-copy"], shape, False,
                                                        a.chunk_blocks, "contiguous", checksum=False)
    kvs = [name for name in pairs if name != "raw"]
    k, v = make_cache(shape)  # the child's cache, to check what arrived
    rng = random.Random(a.seed)

    def sender_cpu() -> float:
        parent.send("cpu")
        return parent.recv()

    rows = []
    try:
        for n in sizes:
            nbytes = n * block_bytes
            times: dict[str, list[float]] = {name: [] for name in pairs}
            cpu = {name: [0.0, 0.0] for name in pairs}  # receiver, sender seconds
            for r in range(a.warmup + a.rounds):
                order = list(pairs)
                rng.shuffle(order)
                for name in order:
                    s0, c0 = sender_cpu(), time.process_time()
                    t0 = time.perf_counter()
                    got = pairs[name].round(n, nbytes)
                    t = time.perf_counter() - t0
                    c1, s1 = time.process_time(), sender_cpu()
                    assert got == nbytes, (name, got, nbytes)
                    if r >= a.warmup:
                        times[name].append(t)
                        cpu[name][0] += c1 - c0
                        cpu[name][1] += s1 - s0
            assert all(pairs[name].check(k, v, n) for name in kvs), "pulled bytes differ from the source"
            med = {name: statistics.median(ts) for name, ts in times.items()}
            gb = nbytes * a.rounds / 1e9
            rows.append({
                "blocks": n, "bytes": nbytes, "raw_socket_gbps": round(nbytes / med["raw"] / 1e9, 3),
                "kv_pull_gbps": {name: round(nbytes / med[name] / 1e9, 3) for name in kvs},
                "ratio": {name: round(med["raw"] / med[name], 3) for name in kvs},
                "best_ratio": {name: round(min(times["raw"]) / min(times[name]), 3) for name in kvs},
                "paired_ratio": {name: round(statistics.median(
                    tr / tk for tr, tk in zip(times["raw"], times[name])), 3) for name in kvs},
                "cpu_s_per_gb": {name: {"receiver": round(c[0] / gb, 4), "sender": round(c[1] / gb, 4)}
                                 for name, c in cpu.items()},
                "median_s": {name: round(t, 5) for name, t in med.items()},
                "loadavg_1m": round(os.getloadavg()[0], 2)})
    finally:
        for p in pairs.values():
            p.close()
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    short = {"zero-copy contiguous": "zc contig", "zero-copy fragmented": "zc frag",
             "staged contiguous": "staged contig", "staged fragmented": "staged frag",
             "zero-copy contiguous, sums at pull": "zc sums@pull",
             "zero-copy contiguous, no checksum": "zc no-sum"}
    console = Console(width=200)
    title = (f"KV pull vs raw loopback socket (median of {a.rounds}, {a.warmup} warm-up, chunk "
             f"{a.chunk_blocks} blocks, block {block_bytes / 2**20:.2f} MiB): GB/s, ratio to raw "
             f"(medians), paired ratio (median per round), best ratio (fastest rounds)")
    table = Table(title=title)
    for col in ("blocks", "MiB", "load", "raw", *[short[x] for x in kvs]):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["blocks"]), f"{r['bytes'] / 2**20:.0f}", f"{r['loadavg_1m']:.1f}",
                      f"{r['raw_socket_gbps']:.2f}",
                      *[f"{r['kv_pull_gbps'][x]:.2f} {r['ratio'][x]:.2f} {r['paired_ratio'][x]:.2f} "
                        f"{r['best_ratio'][x]:.2f}" for x in kvs])
    console.print(table)
    cpu_table = Table(title="CPU seconds per GB, receiver + sender (less sensitive to load)")
    for col in ("blocks", "raw", *[short[x] for x in kvs]):
        cpu_table.add_column(col, justify="right")
    for r in rows:
        c = r["cpu_s_per_gb"]
        cpu_table.add_row(str(r["blocks"]), *[f"{c[x]['receiver']:.3f}+{c[x]['sender']:.3f}"
                                              for x in ("raw", *kvs)])
    console.print(cpu_table)
    pin_gbps = max_bytes / ports["pin_sum_s"] / 1e9
    print(f"pin-time block sums (kv-pin-sum thread, off the pull path): {pin_gbps:.2f} GB/s "
          f"({max_bytes / 2**20:.0f} MiB cold)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "shape": list(shape), "device": a.device, "block_bytes": block_bytes, "chunk_blocks": a.chunk_blocks,
        "rounds": a.rounds, "warmup": a.warmup, "statistic": "median", "target_ratio": 0.7,
        "cpu_count": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "pin_sum_gbps": round(pin_gbps, 3),
        "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
