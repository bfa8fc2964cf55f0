"""Prefill/decode disaggregation inside one engine: pinned blocks out, pulled blocks in.

Prefill side (``kv_transfer_params.do_remote_decode``): when the prefill-only request
finishes, ``pin`` takes an extra reference on its blocks and returns vLLM-style
``kv_transfer_params`` for the decode side; the kv-pin-sum thread then checksums the full
blocks once (``block_sums``: they are immutable while pinned), so that the transfer
server only sends during a pull. The transfer server (``TransferBackend``) reads pinned
blocks on its own threads; the pins are dropped on the core thread when the decode side
has pulled them, asked to release them, or after ``timeout`` seconds.

Decode side (``do_remote_prefill``): the scheduler asks ``plan`` which full prompt blocks
are missing locally (prefix-aware: blocks after the local device hit, checked by chained
block hash against the prefill side's), allocates device blocks, and ``start_pull`` copies
them in on the ``kv-pull`` thread while the request waits in WAITING_FOR_KV (straight into
those blocks: see ``transfer_wire``; on failure they are freed uncached). The last
partial block and the final prompt token are always computed locally, so the decode
engine samples the first token itself: outputs equal the aggregated path's by
construction, and any failure simply recomputes.

Only the core thread touches the block pool; other threads exchange request ids.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agentserve.kv.remote.backend import PullSpec, TransferBackend
from agentserve.kv.remote.frames import TransferError, block_sums
from agentserve.kv.pool import Block, BlockPool

log = logging.getLogger("agentserve.transfer")

MEASURED_PULL_BYTES = 1 << 20  # pulls this large update the throughput estimate


@dataclass(slots=True)
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    pull_seconds: float = 0.0
    pulls: int = 0
    blocks_pulled: int = 0
    blocks_local: int = 0  # decode-side prompt blocks already on the device (not pulled)
    blocks_joined: int = 0  # not pulled again: another decode leg's pull in flight had them
    pull_failures: int = 0
    pins_expired: int = 0
    pins_released: int = 0


@dataclass(slots=True)
class _Pin:
    blocks: list[Block]
    hashes: list[bytes]
    deadline: float
    busy: int = 0
    released: bool = False
    sums: list[int] | None = None  # block_sums of the full blocks, once computed


@dataclass(slots=True)
class PullDone:
    request_id: str
    ok: bool
    num_blocks: int


@dataclass(slots=True)
class RemoteConfig:
    host: str = "127.0.0.1"  # advertised to decode engines in remote_host
    bind: str | None = None  # listen address (default: host)
    port: int = 0  # 0: any free port
    timeout: float = 120.0  # seconds a pin waits for its pull
    max_pulls: int = 4
    presum: bool = True  # checksum pinned blocks once, off the pull path (kv-pin-sum thread)


class RemoteKV:
    """Pins (prefill side), pulls (decode side) and the transfer server of one engine."""

    def __init__(self, cfg: RemoteConfig, backend: TransferBackend, pool: BlockPool,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        self.cfg, self.backend, self.pool, self.k, self.v = cfg, backend, pool, k, v
        self.bs = pool.block_size
        self.engine_id = f"agentserve-{uuid.uuid4().hex[:12]}"
        self.stats = TransferStats()
        self.pins: dict[str, _Pin] = {}
        self._lock = threading.Lock()
        self._done: queue.Queue[PullDone] = queue.Queue()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._sum_jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.pending = 0
        # Measured pull throughput (bytes/s, a moving average over pulls of at least
        # MEASURED_PULL_BYTES; smaller ones are latency-bound): None until one is measured.
        self.pull_bw: float | None = None
        self.block_bytes = 2 * k.shape[0] * k[0, 0].numel() * k.element_size()
        # Decode side, core thread: block hash -> the request pulling it now, and each
        # pull's hashes (a decode leg sharing that prefix waits for it: ``joins``).
        self._pulling: dict[bytes, str] = {}
        self._pull_hashes: dict[str, list[bytes]] = {}
        self.notify: Callable[[], None] = lambda: None  # wakes the core loop
        backend.on_sent = self._on_sent  # type: ignore[attr-defined]
        self.port = backend.serve(self, cfg.bind or cfg.host, cfg.port)
        self._thread = threading.Thread(target=self._run, args=(self._jobs,), name="kv-pull",
                                        daemon=True)
        self._thread.start()
        self._sum_thread = threading.Thread(target=self._run, args=(self._sum_jobs,),
                                            name="kv-pin-sum", daemon=True)
        self._sum_thread.start()

    # ---- prefill side: pins (core thread) ------------------------------------------------
    def pin(self, seq: Any, blocks: list[Block]) -> dict[str, Any]:
        """Hold the finished prefill's blocks for a decode engine; returns its params."""
        n_full = min(seq.num_computed_tokens // self.bs, len(seq.block_hashes), len(blocks))
        self.pool.touch(blocks)
        with self._lock:
            self.pins[seq.request_id] = _Pin(list(blocks), list(seq.block_hashes[:n_full]),
                                             time.monotonic() + self.cfg.timeout)
        if self.cfg.presum and n_full:
            event = None
            if self.k.is_cuda:  # the sums must see the prefill's writes on the compute stream
                event = torch.cuda.Event()
                event.record()
            rid = seq.request_id
            self._sum_jobs.put(lambda: self._sum_pinned(rid, event))
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_request_id": seq.request_id,
                "remote_block_ids": [b.block_id for b in blocks],
                "remote_host": self.cfg.host, "remote_port": self.port,
                "remote_num_tokens": seq.num_computed_tokens, "remote_block_size": self.bs,
                "remote_block_hashes": [h.hex() for h in seq.block_hashes[:n_full]],
                "tp_size": 1, "transfer_mode": "pull", "transfer_backend": self.backend.name}

    def service(self, now: float | None = None) -> None:
        """Core thread: free pins that were pulled, released or timed out."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [rid for rid, p in self.pins.items()
                    if p.busy == 0 and (p.released or now > p.deadline)]
            pins = [(rid, self.pins.pop(rid)) for rid in dead]
        for rid, p in pins:
            if p.released:
                self.stats.pins_released += 1
            else:
                self.stats.pins_expired += 1
                log.info("kv pin for %s expired after %.0fs unpulled", rid, self.cfg.timeout)
            self.pool.free(list(reversed(p.blocks)))

    @property
    def num_pinned(self) -> int:
        return len(self.pins)

    # ---- prefill side: BlockSource for the server threads ----------------------------------
    def checkout(self, rid: str, idx: list[int], hashes: list[bytes]) -> list[int]:
        with self._lock:
            p = self.pins.get(rid)
            if p is None or p.released:
                raise TransferError(f"no pinned KV for request {rid!r} (expired or released)")
            if any(i < 0 or i >= len(p.hashes) for i in idx):
                raise TransferError(f"block index out of range (have {len(p.hashes)} full blocks)")
            if [p.hashes[i] for i in idx] != list(hashes):
                raise TransferError("block hash mismatch: the decode prompt differs from the prefill")
            p.busy += 1
            return [p.blocks[i].block_id for i in idx]

    def checkin(self, rid: str, release: bool) -> None:
        with self._lock:
            p = self.pins.get(rid)
            if p is not None:
                p.busy -= 1
                p.released = p.released or release
        if release:
            self.notify()

    def release(self, rid: str) -> None:
        with self._lock:
            p = self.pins.get(rid)
            if p is not None:
                p.released = True
        self.notify()

    def pinned_sums(self, rid: str, idx: list[int]) -> list[int] | None:
        with self._lock:
            p = self.pins.get(rid)
            if p is None or p.sums is None or any(i < 0 or i >= len(p.sums) for i in idx):
                return None
            return [p.sums[i] for i in idx]

    def _sum_pinned(self, rid: str, event: Any) -> None:
        """kv-pin-sum thread: checksum a pin's full blocks once (they are immutable while
        pinned; ``busy`` keeps them from being freed meanwhile). Pulls that come first sum
        the bytes as they send them."""
        with self._lock:
            p = self.pins.get(rid)
            if p is None or p.released or p.sums is not None:
                return
            p.busy += 1
            ids = [b.block_id for b in p.blocks[:len(p.hashes)]]
        sums = None
        try:
            if event is not None:
                event.synchronize()
            sums = block_sums(self.k, self.v, ids)
        except Exception:
            log.exception("checksumming pinned KV of %s failed", rid)
        finally:
            with self._lock:
                p.busy -= 1
                if sums is not None:
                    p.sums = sums
                released = p.released
        if released:
            self.notify()

    def _on_sent(self, n: int) -> None:
        self.stats.bytes_sent += n

    # ---- decode side (core thread) ----------------------------------------------------------
    def plan(self, seq: Any, device_hit: int) -> PullSpec | None:
        """Blocks to pull for a ``do_remote_prefill`` request; None: nothing (released)."""
        p = seq.kv_transfer
        hashes, peer = _hashes(p), _peer(p)
        if hashes is None or peer is None:  # malformed: compute locally, contact nobody
            log.warning("request %s: kv_transfer_params name no valid remote prefill (%s); "
                        "computing its prompt locally", seq.request_id,
                        "remote_block_hashes" if hashes is None else "remote_host/port/request_id")
            seq.kv_transfer = None  # nothing to pull, nothing to release
            self.stats.blocks_local += device_hit
            return None
        max_blocks = min((seq.num_tokens - 1) // self.bs, len(hashes), len(seq.block_hashes))
        usable = next((i for i in range(max_blocks) if hashes[i] != seq.block_hashes[i]), max_blocks)
        if usable <= device_hit:
            self.stats.blocks_local += device_hit
            self.release_remote(seq)  # nothing worth pulling: the local hit covers it
            return None
        host, port, rid = peer
        return PullSpec(host, port, rid, list(range(device_hit, usable)), hashes[device_hit:usable])

    def joins(self, seq: Any, device_hit: int) -> tuple[str, int] | None:
        """(request id, blocks) when the prompt blocks right past ``device_hit`` are being
        pulled for another decode leg: chained hashes, so that pull brings this prompt's
        prefix too, and once it ends they are device blocks this request hits. Concurrent
        sub-agents of one group share a prefix; without this each would pull it."""
        if not self._pulling:
            return None
        rid, n = None, 0
        for h in seq.block_hashes[device_hit:(seq.num_tokens - 1) // self.bs]:
            owner = self._pulling.get(h)
            if owner is None or owner == seq.request_id or rid not in (None, owner):
                break
            rid, n = owner, n + 1
        return (rid, n) if rid is not None else None

    def pull_s(self, tokens: int) -> float:
        """Estimated seconds to pull ``tokens`` tokens of KV at the measured throughput;
        infinite before any pull was measured (a decode leg then restores what its own
        tiers hold, which also spares the network)."""
        if not self.pull_bw:
            return float("inf")
        return tokens / self.bs * self.block_bytes / self.pull_bw

    def start_pull(self, seq: Any, spec: PullSpec, block_ids: list[int]) -> None:
        rid = seq.request_id
        self._jobs.put(lambda: self._pull_job(rid, spec, block_ids))
        # bookkeeping once the job is queued: nothing is left behind if queueing raised
        seq.kv_transfer = None  # the pull releases the remote pins: nothing left to release
        self.stats.blocks_local += spec.idx[0]
        self._pull_hashes[rid] = list(spec.hashes)
        for h in spec.hashes:
            self._pulling.setdefault(h, rid)
        self.pending += 1

    def release_remote(self, seq: Any) -> None:
        """Drop the prefill side's pins for a decode request that will not pull them."""
        p, seq.kv_transfer = seq.kv_transfer, None
        peer = _peer(p) if p else None
        if peer is None:  # no (valid) prefill engine named: nothing to release
            return
        host, port, rid = peer
        self._jobs.put(lambda: self.backend.release(host, port, rid))

    def poll(self, timeout: float | None = None) -> list[PullDone]:
        out: list[PullDone] = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.pending -= len(out)
        for d in out:
            for h in self._pull_hashes.pop(d.request_id, ()):
                if self._pulling.get(h) == d.request_id:
                    del self._pulling[h]
        return out

    # ---- kv-pull thread ----------------------------------------------------------------------
    def _pull_job(self, rid: str, spec: PullSpec, block_ids: list[int]) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            nbytes = self.backend.pull_into(spec, self.k, self.v, block_ids)
            dt = time.perf_counter() - t0
            self.stats.pull_seconds += dt
            self.stats.bytes_received += nbytes
            if nbytes >= MEASURED_PULL_BYTES and dt > 0:  # (one float store: thread-safe)
                bw = nbytes / dt
                self.pull_bw = bw if self.pull_bw is None else self.pull_bw + 0.3 * (bw - self.pull_bw)
            self.stats.pulls += 1
            self.stats.blocks_pulled += len(block_ids)
            ok = True
        except Exception as e:  # noqa: BLE001 - any failure means: recompute locally
            self.stats.pull_failures += 1
            log.warning("KV pull for %s from %s:%s failed, recomputing: %r", rid, spec.host,
                        spec.port, e)
        finally:  # always answered: without it the request would wait in `pulling` for ever
            self._done.put(PullDone(rid, ok, len(block_ids)))
            self.notify()

    @staticmethod
    def _run(jobs: queue.Queue[Callable[[], None] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("kv-pull job failed")

    def close(self) -> None:
        self._jobs.put(None)
        self._sum_jobs.put(None)
        self._thread.join(5)
        self._sum_thread.join(5)
        self.backend.close()

    def snapshot(self) -> dict[str, Any]:
        s = {f: getattr(self.stats, f) for f in self.stats.__slots__}
        s["pinned_requests"] = self.num_pinned
        s["pulls_in_flight"] = self.pending
        s["pull_bw_estimate"] = self.pull_bw or 0.0
        return s


def _peer(p: Any) -> tuple[str, int, str] | None:
    """(host, port, request id) of the prefill engine ``kv_transfer_params`` name, or None
    when they name none or not in this format. The API edge rejects malformed params with a
    400; this check keeps one that slips through (an internal caller) from raising inside the
    engine step, where it would fail every request of the batch."""
    if not isinstance(p, dict):
        return None
    host, port, rid = p.get("remote_host"), p.get("remote_port"), p.get("remote_request_id")
    if not isinstance(host, str) or not host or not isinstance(rid, str) or not rid:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return host, port, rid


def _hashes(p: Any) -> list[bytes] | None:
    """``remote_block_hashes`` as bytes (absent: none), or None when malformed."""
    raw = p.get("remote_block_hashes") if isinstance(p, dict) else None
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(h, str) for h in raw):
        return None
    try:
        return [bytes.fromhex(h) for h in raw]
    except ValueError:
        return None
