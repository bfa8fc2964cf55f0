"""The engine core: a step loop on its own thread (the forward blocks; asyncio must not).

`step()` = schedule -> run the model -> append tokens, check stops, cache full
blocks, free finished sequences -> publish KV events. The async front talks to it
through a thread-safe inbox and receives `RequestOutput` lists through a callback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agentserve.engine.request import RequestOutput, RequestStatus
from agentserve.engine.runner import ModelRunner
from agentserve.engine.scheduler import Scheduler
from agentserve.engine.sequence import Sequence
from agentserve.engine.steptrace import StepTrace, request_trace
from agentserve.kv.events import KVEventQueue
from agentserve.kv.zmq_events import KVEventPublisher

log = logging.getLogger("agentserve.engine")


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Tick:
    """Wakes the loop (a pull finished or pins were released on another thread)."""


class EngineCore:
    """Owns scheduler, KV manager and runner. Everything here runs on one thread."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, eos_token_ids: list[int],
                 max_model_len: int, events: KVEventQueue | None = None,
                 publisher: KVEventPublisher | None = None, check_invariants: bool = False) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.runner = runner
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.events = events
        self.publisher = publisher
        self.check_invariants = check_invariants
        self.tiers = scheduler.tiers
        self.remote = scheduler.remote
        if self.remote is not None:
            self.remote.notify = lambda: self.inbox.put(_Tick())
        self.seqs: dict[str, Sequence] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.inbox: queue.Queue[Sequence | _Abort | _Tick | None] = queue.Queue()
        self.dead: BaseException | None = None  # why the core thread ended, if it did
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.trace = StepTrace.from_env()  # opt-in per-step timings (steptrace.py)
        self.rtrace = request_trace() if self.trace is not None else None  # and request paths

    # ---- thread-safe entry points -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        self.inbox.put(seq)

    def abort(self, request_id: str) -> None:
        self.inbox.put(_Abort(request_id))

    def start(self, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
        self._thread = threading.Thread(target=self._loop, args=(on_outputs,), name="engine-core",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self.tiers is not None:  # release device blocks held by stores in flight
            self.scheduler._finish_loads(self.tiers.drain(timeout))
            core_done = self._thread is None or not self._thread.is_alive()
            if self.tiers.writeback is not None and core_done:  # what the device holds, to disk
                self.tiers.writeback.flush(timeout)
            self.tiers.worker.close(timeout)
        if self.remote is not None:
            self.remote.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.trace is not None:
            self.trace.close()

    # ---- the loop ----------------------------------------------------------------
    def _loop(self, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
        try:
            while not self._stop.is_set():
                outputs = self._drain_inbox(block=not self.scheduler.has_work())
                if self.remote is not None:
                    self.remote.service()  # pins pulled, released or expired
                if self.scheduler.has_work():
                    failed: list[RequestOutput] = []
                    try:
                        outputs.extend(self.step(failed))
                    except Exception as exc:  # noqa: BLE001 - a failed step must not kill the server
                        log.exception("engine step failed")
                        outputs.extend(self._fail_running(f"engine step failed: {exc!r}"))
                    outputs.extend(failed)  # requests that could not be scheduled, even then
                if outputs:
                    on_outputs(outputs)
        except BaseException as exc:  # the thread is ending: nobody may wait on it forever
            log.exception("engine core stopped")
            self.dead = exc
            on_outputs([self._output(seq, [], "error", error=f"engine core stopped: {exc!r}")
                        for seq in self.seqs.values()])
            self.seqs.clear()

    def _drain_inbox(self, block: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if isinstance(item, Sequence):
                    out = self._admit(item)
                    if out is not None:
                        outputs.append(out)
                elif isinstance(item, _Abort):
                    out = self._finish_abort(item.request_id)
                    if out is not None:
                        outputs.append(out)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass
        return outputs

    def _admit(self, seq: Sequence) -> RequestOutput | None:
        """Queue a new request; one that cannot be queued fails alone (an error output)."""
        self.seqs[seq.request_id] = seq
        if self.rtrace is not None:
            seq.timing = {"adm": time.perf_counter()}
        try:
            self.scheduler.add(seq)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the others
            log.exception("could not queue request %s", seq.request_id)
            self.seqs.pop(seq.request_id, None)
            return self._output(seq, [], "error", error=f"could not queue the request: {exc!r}")
        return None

    def _finish_abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            # Finished already. A prefill leg whose client left before taking its params
            # pinned KV that nobody will pull: free it now, not at --kv-transfer-timeout.
            if self.remote is not None:
                self.remote.release(request_id)
            return None
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        return self._output(seq, [], "abort")

    def _fail_running(self, message: str) -> list[RequestOutput]:
        """A step failed as a whole (the forward pass): every request in it ends with an error."""
        return [self._fail_one(seq, message) for seq in list(self.scheduler.running)]

    def _fail_one(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error output; its blocks go back to the pool."""
        self.seqs.pop(seq.request_id, None)
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        return self._output(seq, [], "error", error=message)

    # ---- one step -----------------------------------------------------------------
    def step(self, failed: list[RequestOutput]) -> list[RequestOutput]:
        """Schedule and run one batch; returns its outputs. Requests that could not be
        scheduled end with an error in ``failed`` (delivered even if the batch then fails)."""
        t_sched = time.perf_counter()
        sched = self.scheduler.schedule()
        failed.extend(self._fail_one(seq, msg) for seq, msg in sched.failed)
        if sched.empty:  # only restores, stores or pulls in flight: wait for one
            copies = self.tiers is not None and self.tiers.busy
            pulls = self.remote is not None and bool(self.scheduler.pulling)
            # Each wait returns as soon as its own job ends; with both kinds in flight, in
            # short turns, so that a pull that ends is not left waiting behind a store.
            wait = 0.002 if copies and pulls else 0.01
            if self.tiers is not None:
                self.scheduler._finish_loads(self.tiers.poll(wait if copies else None))
                self._publish_events()
            if pulls:
                self.scheduler._finish_pulls(self.remote.poll(wait))
            return []
        if self.rtrace is not None:
            for s in sched.scheduled:
                if s.seq.timing is not None and "sched" not in s.seq.timing:
                    s.seq.timing["sched"] = t_sched
        t0 = time.perf_counter()
        tokens = self.runner.execute(sched, self.kv)
        t_exec = time.perf_counter()
        if self.tiers is not None:
            prefill = sum(s.num_tokens for s in sched.scheduled if s.num_tokens > 1)
            if prefill >= self.kv.block_size:  # decode-only steps say little about prefill
                self.tiers.est.observe_prefill(sched.num_tokens, time.perf_counter() - t0)
        outputs: list[RequestOutput] = []
        firsts: list[Sequence] = []  # sampled their first token in this step (request trace)
        it = iter(tokens)
        for s in sched.scheduled:
            seq = s.seq
            done_prompt = s.completes_prompt
            seq.num_computed_tokens += s.num_tokens
            self.kv.cache_blocks(seq)
            if self.tiers is not None:
                self.tiers.offer(seq, self.kv.req_blocks.get(seq.request_id, []))
            if not done_prompt:
                continue
            token = next(it)
            if isinstance(token, Exception):  # this request's own sampling failed: it alone ends
                outputs.append(self._fail_one(seq, f"sampling failed: {token!r}"))
                continue
            if seq.params.constraint is not None:
                try:
                    seq.params.constraint.accept(token)
                except Exception as exc:  # noqa: BLE001 - its grammar broke: it alone ends
                    outputs.append(self._fail_one(seq, f"constraint failed: {exc!r}"))
                    continue
            if seq.num_output_tokens == 0:  # first token: the prompt is prefilled
                self.prompt_tokens += seq.num_prompt_tokens
                if seq.timing is not None:
                    firsts.append(seq)
            seq.token_ids.append(token)
            self.generation_tokens += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.seqs.pop(seq.request_id, None)
                if (self.remote is not None and seq.kv_transfer
                        and seq.kv_transfer.get("do_remote_decode")):  # prefill leg: hold its KV
                    seq.kv_transfer_out = self.remote.pin(seq, self.kv.req_blocks.get(seq.request_id, []))
                self.scheduler.finish(seq, RequestStatus.FINISHED_STOPPED if reason == "stop"
                                      else RequestStatus.FINISHED_LENGTH)
            outputs.append(self._output(seq, seq.token_ids[seq.num_prompt_tokens + seq.emitted:], reason))
        self._publish_events()
        if self.check_invariants:
            self.kv.pool.check_invariants()
        if self.trace is not None:
            t1 = time.perf_counter()
            if self.rtrace is not None:
                for seq in firsts:  # (`sub`: the Sequence's creation, right before its submit)
                    self.rtrace.record(dict(core=seq.request_id, n=seq.num_prompt_tokens,
                                            hit=max(seq.num_cached_tokens, 0), sub=seq.arrival,
                                            **(seq.timing or {}), tok=t1))
            self.trace.record(t_sched, t0 - t_sched, t_exec - t0, t1 - t_exec,
                              [s.seq.num_computed_tokens for s in sched.scheduled if s.num_tokens == 1],
                              [(s.num_tokens, s.seq.num_computed_tokens - s.num_tokens)
                               for s in sched.scheduled if s.num_tokens > 1])
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.constraint is not None and p.constraint.done():
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new: list[int], reason: str | None,
                error: str | None = None) -> RequestOutput:
        lps = seq.logprobs[seq.emitted:seq.emitted + len(new)] \
            if seq.params.logprobs is not None else None
        # the prompt's logprobs go out once, with the first token
        prompt_lps = None
        if seq.params.prompt_logprobs is not None and seq.emitted == 0 and new:
            prompt_lps = seq.prompt_logprobs or [None] * seq.num_prompt_tokens  # (1-token prompt)
        seq.emitted += len(new)
        return RequestOutput(seq.request_id, new, reason is not None, reason, seq.num_prompt_tokens,
                             max(seq.num_cached_tokens, 0), error,
                             seq.cached_by_tier if self.tiers is not None else None,
                             seq.kv_transfer_out, lps, prompt_lps)

    def _publish_events(self) -> None:
        tier_events = self.tiers.take_events() if self.tiers is not None else []
        if self.events is None:
            return
        events = self.events.take() + tier_events
        if events and self.publisher is not None:
            self.publisher.publish(events)
