"""Byte movers for the offload tiers: device <-> host copies and disk I/O on worker threads.

Two daemon threads, so a slow disk write never delays a restore: ``kv-store`` (device
-> CPU copies, CPU -> disk writes, segment deletes) and ``kv-load`` (CPU/disk -> device).
Jobs are plain closures; each result lands in ``done`` for the engine-core thread,
which alone mutates tier metadata. On CUDA the copies run on a side stream, ordered
after the compute stream by an event recorded when the job was submitted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

Job = Callable[[], Any]


# Offload blocks below this size are restored through the staging buffer on CPU too (one
# copy per chunk instead of ~10 tensor ops per block: 3x faster for the tiny model's 64 KiB
# blocks) and stored as one indexed copy (2x); at 256 KiB the ways are about even, and
# larger blocks copy faster directly.
SMALL_BLOCK_BYTES = 256 << 10


class TransferWorker:
    """Runs store and load jobs off the engine-core thread; results go to ``done``.

    ``batched`` (default: on CUDA) moves many blocks per copy: on a GPU every small copy is
    a launch, and one restore of 16K tokens of the tiny model as 1,024 per-block copies ran
    at 0.3 GB/s. Batched, loads go through a reused device staging buffer (at most
    ``stage_bytes``) and stores write whole slots, both as asynchronous copies from and to
    the CPU tier's pinned memory. On CPU, small offload blocks (``SMALL_BLOCK_BYTES``) load
    the same way and store as one indexed copy; larger ones copy block by block.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, batched: bool | None = None,
                 stage_bytes: int = 64 << 20) -> None:
        self.k, self.v = k, v  # device KV: [num_layers, num_blocks, block_size, Hkv, D]
        self.cuda = k.is_cuda
        self.batched = self.cuda if batched is None else batched
        self.stage_bytes = stage_bytes
        self._stage = torch.empty(0, dtype=k.dtype, device=k.device)  # grown as needed (load lane)
        self.done: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self._queues = {"store": queue.Queue(), "load": queue.Queue()}
        self._threads = [threading.Thread(target=self._run, args=(name,), name=f"kv-{name}",
                                          daemon=True) for name in self._queues]
        self.pending = 0
        for t in self._threads:
            t.start()

    def submit(self, lane: str, tag: str, ctx: Any, job: Job) -> None:
        """Run ``job`` on ``lane``; ``(tag, ctx, result or exception)`` lands in ``done``."""
        event = None
        if self.cuda:  # the copy must see every kernel queued so far on the compute stream
            event = torch.cuda.Event()
            event.record()
        self.pending += 1
        self._queues[lane].put((tag, ctx, job, event))

    def poll(self, timeout: float | None = None) -> list[tuple[str, Any, Any]]:
        """Completed jobs; waits up to ``timeout`` for the first one when given."""
        out = []
        try:
            out.append(self.done.get(timeout=timeout) if timeout else self.done.get_nowait())
            while True:
                out.append(self.done.get_nowait())
        except queue.Empty:
            pass
        self.pending -= len(out)
        return out

    def close(self, timeout: float = 10.0) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout)

    def _run(self, lane: str) -> None:
        stream = torch.cuda.Stream() if self.cuda else None
        q = self._queues[lane]
        while True:
            item = q.get()
            if item is None:
                return
            tag, ctx, job, event = item
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        stream.wait_event(event)
                        result = job()
                        stream.synchronize()
                else:
                    result = job()
            except Exception as exc:  # noqa: BLE001 - reported to the core as a failed job
                result = exc
            self.done.put((tag, ctx, result))

    # ---- copies (run on worker threads) -----------------------------------------------
    @torch.inference_mode()
    def device_to_host(self, dst: torch.Tensor, slots: list[int], block_ids: list[list[int]]) -> None:
        """dst[slot] = [k, v] of the device blocks of each group. dst: [S, 2, L, T, H, D]."""
        groups, per = len(block_ids), len(block_ids[0])
        idx = torch.tensor([b for g in block_ids for b in g], device=self.k.device)
        kv = []
        for src in (self.k, self.v):
            g = src.index_select(1, idx)  # [L, G*per, bs, H, D]
            L, _, bs, H, D = g.shape
            kv.append(g.view(L, groups, per * bs, H, D).transpose(0, 1))  # [G, L, T, H, D]
        if self.batched:  # whole slots, one async copy per run of consecutive slots
            both = torch.stack(kv, dim=1)  # [G, 2, L, T, H, D], contiguous
            at = 0
            for first, length in _runs(slots):
                dst[first:first + length].copy_(both[at:at + length], non_blocking=self.cuda)
                at += length
            return
        if dst[0].nbytes < SMALL_BLOCK_BYTES:  # CPU, small blocks: one indexed copy each of
            # K and V instead of two copies a slot (416 scattered 64 KiB blocks: 33 -> 15 ms)
            at_slots = torch.tensor(slots)
            for kv_i, g in enumerate(kv):
                dst.select(1, kv_i).index_copy_(0, at_slots, g)
            return
        for kv_i, g in enumerate(kv):
            for j, slot in enumerate(slots):
                dst[slot, kv_i].copy_(g[j], non_blocking=self.cuda)

    @torch.inference_mode()
    def host_to_device(self, sources: list[torch.Tensor], first: int, block_ids: list[int]) -> None:
        """Offload blocks ``sources`` (each [2, L, T, H, D] on the host) -> device blocks
        ``block_ids``: the first source from its sub-block ``first`` on, the others whole."""
        if not self.batched and sources[0].nbytes >= SMALL_BLOCK_BYTES:
            at = 0
            for i, src in enumerate(sources):
                skip = first if i == 0 else 0
                n = src.shape[2] // self.k.shape[2] - skip
                self._scatter(src.unsqueeze(0), skip, block_ids[at:at + n])
                at += n
            return
        per_chunk = max(1, self.stage_bytes // sources[0].nbytes)
        at = 0
        for c in range(0, len(sources), per_chunk):
            chunk = sources[c:c + per_chunk]
            stage = self._staging(len(chunk), sources[0])
            for i, src in enumerate(chunk):  # pinned CPU slots: asynchronous copies
                stage[i].copy_(src, non_blocking=self.cuda)
            skip = first if c == 0 else 0
            n = len(chunk) * (sources[0].shape[2] // self.k.shape[2]) - skip
            self._scatter(stage, skip, block_ids[at:at + n])
            at += n

    def _staging(self, m: int, like: torch.Tensor) -> torch.Tensor:
        """[m, *like.shape] on the cache's device, reused by every load (one load lane)."""
        n = m * like.numel()
        if self._stage.numel() < n:
            self._stage = torch.empty(n, dtype=self.k.dtype, device=self.k.device)
        return self._stage[:n].view(m, *like.shape)

    def _scatter(self, blocks: torch.Tensor, skip: int, block_ids: list[int]) -> None:
        """blocks [m, 2, L, T, H, D] -> device blocks ``block_ids``, from sub-block ``skip``."""
        m, _, L, T, H, D = blocks.shape
        bs = self.k.shape[2]
        first, n = block_ids[0], len(block_ids)
        # consecutive destinations (a fresh pool's free list): one strided copy per K and V,
        # without building an index tensor (most of a small block's cost on CPU)
        idx = None if block_ids == list(range(first, first + n)) else torch.tensor(
            block_ids, device=self.k.device)
        for kv_i, dst in enumerate((self.k, self.v)):
            part = blocks[:, kv_i].reshape(m, L, T // bs, bs, H, D).transpose(0, 1)
            part = part.reshape(L, m * (T // bs), bs, H, D)[:, skip:skip + n]
            if idx is None:
                dst[:, first:first + n].copy_(part, non_blocking=self.cuda)
            else:
                dst.index_copy_(1, idx, part.to(dst.device, non_blocking=self.cuda))


# ---- whole-request block movement (P/D transfer; shared shapes with the tiers above) --------

@torch.inference_mode()
def gather_blocks(k: torch.Tensor, v: torch.Tensor, block_ids: list[int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Device blocks -> one contiguous host tensor [2, L, n*bs, H, D] (the offload layout).

    k, v: [L, num_blocks, bs, H, D]. Contiguous so the network layer can send it as one
    memoryview with no further copy.
    """
    L, _, bs, H, D = k.shape
    n = len(block_ids)
    if out is None:
        out = torch.empty((2, L, n * bs, H, D), dtype=k.dtype, pin_memory=k.is_cuda)
    at = 0
    for start, length in _runs(block_ids):  # slices, not index_select: one copy, no temporary
        for kv_i, src in enumerate((k, v)):
            out[kv_i, :, at * bs:(at + length) * bs].copy_(
                src[:, start:start + length].reshape(L, length * bs, H, D))
        at += length
    return out


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as (first, length) runs; allocation makes long runs common."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


@torch.inference_mode()
def scatter_blocks(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor,
                   block_ids: list[int]) -> None:
    """Host [2, L, n*bs, H, D] -> device blocks ``block_ids`` (inverse of ``gather_blocks``)."""
    n, bs = len(block_ids), k.shape[2]
    idx = torch.tensor(block_ids, device=k.device)
    for kv_i, dst in enumerate((k, v)):
        L, _, H, D = src[kv_i].shape
        part = src[kv_i].reshape(L, n, bs, H, D).to(dst.device, non_blocking=k.is_cuda)
        dst.index_copy_(1, idx, part)
    if k.is_cuda:
        torch.cuda.current_stream().synchronize()


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Public alias of the run splitter: consecutive ids as (first, length)."""
    return _runs(block_ids)


def block_views(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> list[torch.Tensor]:
    """Contiguous views of the cache covering ``block_ids`` in ``gather_blocks`` order.

    ``[k, v] x layers x runs of consecutive ids``: concatenated, they are exactly the bytes
    of ``gather_blocks(k, v, block_ids)``. Views share the cache's memory (no copy), so a
    CPU cache can be sent from / received into directly.
    """
    L = k.shape[0]
    runs = _runs(block_ids)
    return [src[layer, start:start + length] for src in (k, v) for layer in range(L)
            for start, length in runs]


class StagingBuffer:
    """A host byte buffer reused across transfers, grown (never shrunk) as needed.

    Fresh ``torch.empty`` buffers per transfer page-fault on first touch (the kernel zeroes
    every page), which costs as much as the copy itself; reusing one per connection or
    worker pays that once. ``pin`` allocates page-locked memory for CUDA copies.
    """

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self._buf[:nbytes].view(dtype).view(shape)
