"""`AsyncEngine`: the asyncio face of the engine core, used by the HTTP server.

`generate()` is an async generator of `RequestOutput` deltas. Closing it early
(client disconnect, task cancelled) aborts the request in the core, which frees
its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch

from agentserve.engine.core.loop import EngineCore
from agentserve.engine.core.request import RequestOutput, SamplingParams
from agentserve.engine.model.sampler import make_generator
from agentserve.engine.core.sequence import Sequence
from agentserve.prompt.tokenizer import Tokenizer

log = logging.getLogger("agentserve.engine")


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters and current gauges, read by /metrics at scrape time."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    prefix_joined_tokens: int = 0  # not computed: another request in flight computed them
    attn_read_in_place_tokens: int = 0  # cached context attention read in place (per step)
    attn_read_gathered_tokens: int = 0  # ... and gathered into a copy first
    attn_read_shared_tokens: int = 0  # ... and not read again: a prefix decodes share
    tiers: dict | None = None  # offload-tier counters (kv.tiers.TierStats fields); None: off
    transfer: dict | None = None  # P/D transfer counters (engine.transfer.TransferStats); None: off


_DEAD_CHECK_S = 5.0  # how often a waiting request checks that the core thread still runs
# A request the core no longer holds, with no final output, at this many checks in a row
# is answered with an error: a bug that drops a request must not leave its caller waiting
# (one check is not enough: the core ends a request a moment before its output arrives).
_LOST_CHECKS = 2


class EngineDraining(RuntimeError):
    """Raised by generate() once shutdown has begun."""


# Put in each unfinished request's queue when shutdown's drain deadline passes.
_CUT = RequestOutput("", [], True, "abort", 0, 0, error="shut down")


# Prompts at least this long are hashed (chained block hashes, for the prefix cache) on a
# worker thread before they reach the core: a 200K-token prompt takes ~28 ms to hash on
# these machines, and on the core thread that delays every running stream's next token
# (vLLM hashes in its input thread for the same reason). Shorter prompts cost under 1 ms.
HASH_OFF_CORE_TOKENS = 4096


class AsyncEngine:
    """Bridges asyncio request streams and the engine core thread."""

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, model_name: str, model_dir: Path,
                 max_model_len: int, device: torch.device) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_names = [model_name]  # every name it answers to, the reported one first
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.block_size = core.kv.block_size
        self.prefix_caching = core.kv.enable_caching  # what usage reports as written to the cache
        self.num_gpu_blocks = core.kv.pool.num_blocks
        self.device = device
        self.draining = False
        self._cut_reason = ""  # why requests cut at the drain deadline end (shutdown)
        self.max_tokens_limit = 0  # the most tokens one request generates (0: context limit)
        self.role = "both"  # both | prefill | decode (set by the builder; reported in /v1/models)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_args(cls, **kwargs) -> "AsyncEngine":
        """Build a ready-to-start engine; see `agentserve.engine.builder.EngineArgs`."""
        from agentserve.engine.builder import EngineArgs, build_engine

        return build_engine(EngineArgs(**kwargs))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start(self._on_outputs_threadsafe)

    def _on_outputs_threadsafe(self, outputs: list[RequestOutput]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, session_id: str | None = None,
                       kv_transfer: dict | None = None) -> AsyncIterator[RequestOutput]:
        self._check_admissible(request_id)
        seq = Sequence(request_id, list(prompt_token_ids), params, session_id=session_id,
                       kv_transfer=self._transfer_params(kv_transfer))
        if not params.greedy and params.seed is not None:  # (unseeded draws share one RNG)
            seq.generator = make_generator(params.seed, self.device)  # on the logits' device
        if len(seq.token_ids) >= HASH_OFF_CORE_TOKENS:
            await asyncio.to_thread(self.core.kv.update_hashes, seq)
            self._check_admissible(request_id)  # the world may have moved meanwhile
        # registered only once nothing above can fail, so a refused request leaves no queue
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        self.core.submit(seq)
        finished = False
        try:
            while not finished:
                out = q.get_nowait() if not q.empty() else await self._next(q, seq)
                if out is _CUT:  # shutdown's drain deadline passed
                    raise EngineDraining(self._cut_reason)
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.core.abort(request_id)

    def _check_admissible(self, request_id: str) -> None:
        if self.draining:
            raise EngineDraining("server is shutting down; retry on another replica")
        self._check_core()
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")

    async def _next(self, q: asyncio.Queue[RequestOutput], seq: Sequence) -> RequestOutput:
        """The request's next output; fails (rather than waits forever) if the core thread
        has stopped or no longer holds the request, which it checks every few seconds
        while nothing arrives."""
        lost = 0
        while True:
            try:
                return await asyncio.wait_for(q.get(), _DEAD_CHECK_S)
            except TimeoutError:
                self._check_core()
                lost = lost + 1 if self.core.lost(seq) else 0
                if lost >= _LOST_CHECKS:
                    log.error("request %s left the engine core without a final output",
                              seq.request_id)
                    return self._final_error(seq.request_id, "the engine lost the request "
                                             "(an engine bug, logged); retry it")

    def _check_core(self) -> None:
        if self.core.dead is not None:
            raise EngineDraining(f"engine core stopped ({self.core.dead!r}); restart the server")
        if self.core.stopping:
            raise EngineDraining("server is shutting down; retry on another replica")

    @staticmethod
    def _final_error(request_id: str, message: str) -> RequestOutput:
        """A final error output made here, for a request the core will not answer."""
        return RequestOutput(request_id, [], True, "error", 0, 0, error=message)

    def _transfer_params(self, p: dict | None) -> dict | None:
        """P/D params this engine acts on; None when transfer is off or they ask nothing."""
        if not p or not isinstance(p, dict) or self.core.remote is None:
            return None
        if p.get("do_remote_decode") or p.get("do_remote_prefill"):
            return dict(p)
        return None

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def release_transfer(self, request_id: str) -> bool:
        """Free a finished prefill leg's pinned KV (thread-safe; an unknown or already
        pulled id is a no-op). False when this engine has no KV transfer (--role both)."""
        if self.core.remote is None:
            return False
        self.core.remote.release(request_id)
        return True

    def stats(self) -> EngineStats:
        sch = self.core.scheduler
        return EngineStats(
            num_running=len(sch.running), num_waiting=sch.num_waiting, kv_usage=self.core.kv.usage,
            prefix_queries_tokens=sch.stats.prefix_queries_tokens,
            prefix_hits_tokens=sch.stats.prefix_hits_tokens, num_preemptions=sch.stats.num_preemptions,
            prompt_tokens=self.core.prompt_tokens, generation_tokens=self.core.generation_tokens,
            prefix_joined_tokens=sch.stats.prefix_joined_tokens,
            attn_read_in_place_tokens=self.core.runner.read_in_place_tokens,
            attn_read_gathered_tokens=self.core.runner.read_gathered_tokens,
            attn_read_shared_tokens=self.core.runner.read_shared_tokens,
            tiers=self._tier_stats(),
            transfer=self.core.remote.snapshot() if self.core.remote is not None else None)

    def _tier_stats(self) -> dict | None:
        """A snapshot of the tier counters (scrape thread; plain ints, torn reads harmless)."""
        t = self.core.tiers
        if t is None:
            return None
        s = t.stats
        out = {f: getattr(s, f) for f in s.__slots__}
        out = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
               for k, v in out.items()}
        out["hit_tokens"]["gpu"] = self.core.scheduler.stats.device_hits_tokens
        out["usage"] = {"cpu": t.mgr.cpu.usage}
        out["loads_in_flight"] = len(t.loads)
        out["prefill_tokens_per_s"] = t.est.prefill_tps or 0.0
        return out

    @property
    def num_inflight(self) -> int:
        return len(self._queues)

    async def shutdown(self, drain_timeout: float = 30.0, stop_timeout: float = 10.0) -> None:
        """Stop admitting; let in-flight requests finish for at most ``drain_timeout``; then
        abort those left and answer each at once (``EngineDraining``: a 503, or an error
        event in a stream), wherever it is stuck; then stop the core, waiting at most
        ``stop_timeout`` for it (a core that hangs is left to the process exit)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while self._queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._queues:
            log.warning("drain timeout (%.0f s): aborting %d unfinished requests",
                        drain_timeout, len(self._queues))
        self._cut_reason = (f"server shut down before the request finished (drain timeout "
                            f"{drain_timeout:g} s); retry it on another replica")
        for rid, q in list(self._queues.items()):
            self.core.abort(rid)
            q.put_nowait(_CUT)  # its generate() raises EngineDraining, even if the core is stuck
        try:
            await asyncio.wait_for(asyncio.to_thread(self.core.stop), stop_timeout)
        except TimeoutError:
            log.error("engine core did not stop within %.0f s; exiting without it", stop_timeout)

