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

from agentserve.engine.core.request import RequestOutput, RequestStatus
from agentserve.engine.model.runner import ModelRunner
from agentserve.engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from agentserve.engine.core.sequence import Sequence
from agentserve.engine.core.steptrace import StepTrace, request_trace
from agentserve.kv.events import KVEventQueue
from agentserve.kv.zmq_events import KVEventPublisher

log = logging.getLogger("agentserve.engine")


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Tick:
    """Wakes the loop (a pull finished or pins were released on another thread)."""


# Steps in a row that may fail with no request to blame (the scheduler's own bookkeeping,
# a tier's poll) before every admitted request ends with the error: a transient fault costs
# nobody their request, a lasting one answers them all instead of leaving them waiting.
MAX_UNATTRIBUTED_FAILURES = 3
FAILED_STEP_PAUSE_S = 0.05  # between failing steps: bounds a broken loop's log and CPU


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
        self.pending: set[str] = set()  # submitted, not yet admitted (``lost``)
        self._batch: list[Sequence] | None = None  # the step's batch once it is scheduled
        self._unattributed = 0  # consecutive failed steps that had no batch to blame
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.trace = StepTrace.from_env()  # opt-in per-step timings (steptrace.py)
        self.rtrace = request_trace() if self.trace is not None else None  # and request paths

    # ---- thread-safe entry points -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        self.pending.add(seq.request_id)
        self.inbox.put(seq)

    @property
    def stopping(self) -> bool:
        """``stop`` was called: the loop answers nothing more (thread-safe)."""
        return self._stop.is_set()

    def lost(self, seq: Sequence) -> bool:
        """True when the core holds ``seq`` nowhere (not queued, not admitted). Its caller
        then has its final output already, or one is in flight to it (thread-safe)."""
        return seq.request_id not in self.pending and self.seqs.get(seq.request_id) is not seq

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
            self.scheduler.kv_waits.finish_loads(self.tiers.drain(timeout))
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
                    try:
                        self.remote.service()  # pins pulled, released or expired
                    except Exception:  # noqa: BLE001 - pins are freed on a later pass
                        log.exception("releasing KV transfer pins failed")
                if self.scheduler.has_work():
                    self._guarded_step(outputs)
                if outputs:
                    on_outputs(outputs)
        except BaseException as exc:  # the thread is ending: nobody may wait on it forever
            log.exception("engine core stopped")
            self.dead = exc
            on_outputs([self._output(seq, [], "error", error=f"engine core stopped: {exc!r}")
                        for seq in self.seqs.values()])
            self.seqs.clear()

    def _guarded_step(self, outputs: list[RequestOutput]) -> None:
        """One step; if it raises, only the requests of its batch end (with the error)."""
        ended: list[RequestOutput] = []  # final outputs, delivered even if the step fails
        self._batch = None
        try:
            outputs.extend(self.step(ended))
            self._unattributed = 0
        except Exception as exc:  # noqa: BLE001 - a failed step must not kill the server
            log.exception("engine step failed")
            message = f"engine step failed: {exc!r}"
            batch = [seq for seq in self._batch or () if self.seqs.get(seq.request_id) is seq]
            if not batch:  # nothing to blame (it failed in the scheduler's own work)
                self._unattributed += 1
                if self._unattributed >= MAX_UNATTRIBUTED_FAILURES:
                    batch = list(self.seqs.values())
                    self._unattributed = 0
            ended.extend(self._fail_one(seq, message) for seq in batch)
            self._stop.wait(FAILED_STEP_PAUSE_S)
        finally:
            self._batch = None
            outputs.extend(ended)

    def _drain_inbox(self, block: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if isinstance(item, Sequence):
                    out = self._admit(item)
                elif isinstance(item, _Abort):
                    out = self._finish_abort(item.request_id)
                else:
                    out = None
                if out is not None:
                    outputs.append(out)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass
        return outputs

    def _admit(self, seq: Sequence) -> RequestOutput | None:
        """Queue a new request; one that cannot be queued fails alone (an error output)."""
        self.seqs[seq.request_id] = seq
        self.pending.discard(seq.request_id)  # (after it is in ``seqs``: ``lost`` reads both)
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
        self._retire(seq, RequestStatus.FINISHED_ABORTED)
        return self._output(seq, [], "abort")

    def _fail_one(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error output; its blocks go back to the pool."""
        self._retire(seq, RequestStatus.FINISHED_ABORTED)
        return self._output(seq, [], "error", error=message)

    def _retire(self, seq: Sequence, status: RequestStatus) -> None:
        """``seq`` leaves the core for good; the caller then makes its one final output.
        Never raises: a request whose cleanup breaks must still get that output."""
        self.seqs.pop(seq.request_id, None)
        try:
            self.scheduler.finish(seq, status)
        except Exception:  # noqa: BLE001 - log it, still take it out of every queue
            log.exception("finishing request %s failed; dropping it", seq.request_id)
            self.scheduler.drop(seq)

    # ---- one step -----------------------------------------------------------------
    def step(self, ended: list[RequestOutput]) -> list[RequestOutput]:
        """Schedule and run one batch; returns the outputs of its requests that go on.
        Final outputs (requests that could not be scheduled, failed or finished) go to
        ``ended`` as each request ends, so they are delivered even if the step then fails."""
        t_sched = time.perf_counter()
        sched = self.scheduler.schedule()
        ended.extend(self._fail_one(seq, msg) for seq, msg in sched.failed)
        if sched.empty:  # only restores, stores or pulls in flight: wait for one
            self._wait_for_kv()
            return []
        self._batch = [s.seq for s in sched.scheduled]  # what a failure below may end
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
            done_prompt = s.completes_prompt  # (before _advance moves num_computed_tokens)
            token = next(it, None) if done_prompt else None
            try:
                out = self._advance(s, done_prompt, token, firsts)
            except Exception as exc:  # noqa: BLE001 - its own bookkeeping broke: it alone ends
                log.exception("request %s: finishing its step failed", s.seq.request_id)
                out = self._fail_one(s.seq, f"could not finish the step for the request: {exc!r}") \
                    if self.seqs.get(s.seq.request_id) is s.seq else None
            if out is not None:
                (ended if out.finished else outputs).append(out)
        self._publish_events()
        if self.check_invariants:
            self.kv.pool.check_invariants()
        if self.trace is not None:
            self._record_trace(sched, firsts, t_sched, t0, t_exec)
        return outputs

    def _wait_for_kv(self) -> None:
        """Nothing to compute: wait (briefly) for a restore, store or pull to end."""
        copies = self.tiers is not None and self.tiers.busy
        pulls = self.remote is not None and bool(self.scheduler.pulling)
        # Each wait returns as soon as its own job ends; with both kinds in flight, in
        # short turns, so that a pull that ends is not left waiting behind a store.
        wait = 0.002 if copies and pulls else 0.01
        if self.tiers is not None:
            self.scheduler.kv_waits.finish_loads(self.tiers.poll(wait if copies else None))
            self._publish_events()
        if pulls:
            self.scheduler.kv_waits.finish_pulls(self.remote.poll(wait))

    def _advance(self, s: ScheduledSeq, done_prompt: bool, token: int | Exception | None,
                 firsts: list[Sequence]) -> RequestOutput | None:
        """Book one entry of the batch: its computed tokens and full blocks, and, when it
        completed its prompt, its sampled ``token``. Returns its output (None mid-prompt)."""
        seq = s.seq
        seq.num_computed_tokens += s.num_tokens
        self.kv.cache_blocks(seq)
        if self.tiers is not None:
            self.tiers.offer(seq, self.kv.req_blocks.get(seq.request_id, []))
        if not done_prompt:
            return None
        if token is None or isinstance(token, Exception):  # its own sampling failed: it alone ends
            return self._fail_one(seq, f"sampling failed: {token!r}")
        if seq.params.constraint is not None:
            try:
                seq.params.constraint.accept(token)
            except Exception as exc:  # noqa: BLE001 - its grammar broke: it alone ends
                return self._fail_one(seq, f"constraint failed: {exc!r}")
        if seq.num_output_tokens == 0:  # first token: the prompt is prefilled
            self.prompt_tokens += seq.num_prompt_tokens
            if seq.timing is not None:
                firsts.append(seq)
        seq.token_ids.append(token)
        self.generation_tokens += 1
        reason = self._stop_reason(seq, token)
        if reason is not None:
            if (self.remote is not None and seq.kv_transfer
                    and seq.kv_transfer.get("do_remote_decode")):  # prefill leg: hold its KV
                seq.kv_transfer_out = self.remote.pin(seq, self.kv.req_blocks.get(seq.request_id, []))
            self._retire(seq, RequestStatus.FINISHED_STOPPED if reason == "stop"
                         else RequestStatus.FINISHED_LENGTH)
        return self._output(seq, seq.token_ids[seq.num_prompt_tokens + seq.emitted:], reason)

    def _record_trace(self, sched: SchedulerOutput, firsts: list[Sequence], t_sched: float,
                      t0: float, t_exec: float) -> None:
        """The step's timings (and its first tokens' request paths) to the step trace."""
        assert self.trace is not None
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
