"""An xPyD deployment driven by the reference's load generator, summarized as `agentserve bench`.

xPyD stages (`SimConfig.clients` "agentx", the default) run AIPerf's agentic replay as llm-d's
GLM-5.2 guide ran it (lanes.py): each lane replays a session tree with its recorded think
times, sub-agents in parallel, joined at a uniform instant after a warm-up of primers; the
requests sent in the `duration` s profiling window and answered within AIPerf's 30 s grace
count. Closed clients ("closed", aggregated engines' default, as `agentserve bench`) send a
session's next request the moment the last one finishes; synthesized sweep workloads replay
from a request drawn uniformly over the corpus's requests to the session's end (REPLAY_RUN),
in their own namespace (cold first request); a trace file's sessions are joined at a random
turn; "schedule" sends a trace file's requests at their recorded times (schedule.py).
Synthesized sweep outputs are scaled to the reference's mean (REFERENCE_OUTPUT_MEAN). The load
generators themselves, with the stage's window and drain, are in stages.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from agentserve.kv.manager import cdiv
from agentserve.sim.cluster import ApproxRouter, Clock, Rank, Router, SimRequest, _bisect_prefix
from agentserve.sim.config import SimConfig, check_config, efficiency, parse_topology, request_path
from agentserve.sim.decode import DecodeInstance
from agentserve.sim.memory import Topology, plan_memory
from agentserve.sim.perf import PerfModel
from agentserve.sim.policy_router import PolicyRouter
from agentserve.sim.pools import PrefillInstance
from agentserve.sim.stages import GRACE_S, SCHEDULE_DRAIN_S, run_stage
from agentserve.sim.specs import GiB, model_spec
from agentserve.sim.summary import REJECTED, counted_records, stage_summary
from agentserve.workload.prompts import scaled_length
from agentserve.workload.record import RequestRecord
from agentserve.sim.sessions import (GLOBAL_NS, REFERENCE_OUTPUT_MEAN, REPLAY_RUN, SYNTH, WARMUP_S,
                                     RunSampler, bench_order, flatten, load_workload, output_scale,
                                     session_stream)
from agentserve.workload.schema import Session, TraceRequest

__all__ = ["REFERENCE_OUTPUT_MEAN", "REPLAY_RUN", "SYNTH", "WARMUP_S", "SimConfig", "Simulation",
           "flatten", "load_workload", "output_scale", "parse_topology", "session_stream",
           "simulate"]


class Simulation:
    """The deployment, its router and the load generator."""

    def __init__(self, cfg: SimConfig, sessions: Iterable[Session]) -> None:
        check_config(cfg)
        self.cfg, self.clock, self.rng = cfg, Clock(), np.random.default_rng(cfg.seed)
        self.miss_rng = np.random.default_rng([cfg.seed, 1])  # own stream: 0 changes no other draw
        m, hw = model_spec(cfg.model), cfg.hardware()
        self.router: Router | None = None  # the P/D picker (`_route_prefill`); aggregated: `policy`
        self.aggs: list = []
        self.prefills, self.decodes, self.p_ranks, self.d_ranks = [], [], [], []
        fixed, per_token = request_path(cfg, hw)
        self.overhead = fixed if cfg.request_overhead_s is None else cfg.request_overhead_s
        self.overhead_per_token = (per_token if cfg.request_overhead_per_token_s is None
                                   else cfg.request_overhead_per_token_s)
        self.source = sessions
        # closed clients' sessions and run sampler; the replay reads `source` (`stages.run_agentx`)
        self.sessions: Iterator[tuple[int, Session]] = iter(enumerate(sessions))
        self.runs: RunSampler | None = None
        self._t0: float | None = None  # agentx: when the profiling phase began
        self._c0 = self._c1 = None  # pool counters at the stage start and end (`pool_counters`)
        # stages that count what they sent, drained (`counted`): AIPerf's replay; since stop 39
        # the aggregated engines' closed clients too, as `agentserve bench` (in its order)
        self._send_until = float("inf")
        self.drains = self.agentx or bool(cfg.aggregated) or cfg.clients == "schedule"
        self.grace = SCHEDULE_DRAIN_S if cfg.clients == "schedule" else GRACE_S
        self.window_full = True  # False: a fixed schedule ended before the window (`_span`)
        self.records: list[RequestRecord] = []
        self.phases: list[tuple[float, ...]] = []  # per finished request, see PHASES
        # the queues' lengths over the stage window (`queues.sample_queues`)
        self.queue_samples: list[tuple[int, ...]] = []
        self.seen: dict[int, set[int]] = {}
        self.requests_sent = 0  # warm-up and grace included; also names each request
        if cfg.aggregated:
            self._build_aggregated(m, hw)
            return
        pt = Topology("dep", cfg.prefill_width, "prefill")
        dt = Topology("dep", cfg.decode_width, "decode", mtp=cfg.mtp)
        pm = plan_memory(m, hw, pt, block_size=cfg.block_size)
        dm = plan_memory(m, hw, dt, block_size=cfg.block_size)
        cpu_blocks = int(cfg.cpu_offload_gib * GiB / m.state_bytes_per_token()) // cfg.block_size
        self.p_ranks = [Rank(i, pm.kv_blocks, cpu_blocks, cfg.block_size)
                        for i in range(cfg.prefill * cfg.prefill_width)]
        self.router = (ApproxRouter(cfg.seed, self.p_ranks, cfg.block_size, cfg.decode_scorers)
                       if cfg.prefix_index == "approx"  # the reference picker's own records
                       else Router(cfg.seed, cfg.decode_scorers))
        self.d_ranks = [Rank(i, dm.kv_blocks, 0, cfg.block_size)
                        for i in range(cfg.decode * cfg.decode_width)]
        self.pperf, self.dperf = (PerfModel(m, hw, t, efficiency(cfg.efficiency)) for t in (pt, dt))
        w = cfg.prefill_width
        self.prefills = [PrefillInstance(self.clock, self.pperf, self.p_ranks[i * w:(i + 1) * w],
                                         cfg.chunk, self._handoff, cfg.cpu_store_on == "evict")
                         for i in range(cfg.prefill)]
        w = cfg.decode_width
        budget = cfg.decode_tokens_per_node * -(-w // hw.gpus_per_node)
        self.decodes = [DecodeInstance(self.clock, self.dperf, self.d_ranks[i * w:(i + 1) * w],
                                       budget, self.rng) for i in range(cfg.decode)]

    def _build_aggregated(self, m, hw) -> None:
        from agentserve.sim.agg import AggInstance

        cfg = self.cfg
        topo = Topology("dep", 1, "decode")
        kv = cfg.kv_tokens or plan_memory(m, hw, topo, block_size=cfg.block_size).kv_blocks * cfg.block_size
        self.p_ranks = [Rank(i, kv // cfg.block_size, 0, cfg.block_size) for i in range(cfg.aggregated)]
        self.pperf = self.dperf = PerfModel(m, hw, topo, efficiency(cfg.efficiency))
        self.aggs = [AggInstance(self.clock, self.pperf, r, cfg.chunk, cfg.max_seqs,
                                 cfg.engine_block_tokens) for r in self.p_ranks]
        # our router's own policy, as `agentserve up` runs it (sim/policy_router.py)
        self.policy = PolicyRouter(self.p_ranks, cfg.seed)
        self._path_free = 0.0  # when the request path is next free (`_send`)
        for a in self.aggs:
            a.on_first = lambda q: self.policy.first_byte(q, self.clock.now)

    def _owner(self, ranks: list[Rank], instances: list, r: Rank):
        return instances[ranks.index(r) // len(instances[0].ranks)]

    # -- client side -------------------------------------------------------------------------
    @property
    def agentx(self) -> bool:
        """AIPerf's agentic replay drives the stage (`SimConfig.clients`)."""
        c = self.cfg.clients
        return c == "agentx" or (c is None and not self.cfg.aggregated)

    def _client(self, queue: list | None = None, si: int = -1, sid: str = "") -> None:
        """A closed-loop client (`SimConfig.clients` "closed"): its next request, at once."""
        if self.clock.now >= self._send_until:  # the stage is over: drain, send nothing new
            return
        if not queue:
            if self.runs is not None:
                nxt = self.runs.next()
                if nxt is None:
                    return
                si, sid, queue = nxt
                queue = list(queue)
            else:
                nxt = next(self.sessions, None)
                if nxt is None:
                    return
                si, s = nxt
                si = GLOBAL_NS if s.hash_id_scope == "global" else si  # ids shared by sessions
                flat = (bench_order if self.drains else flatten)(s)  # as the bench, or by time
                queue, sid = [(*x, s.block_size) for x in flat], s.id
                if self.cfg.join_midway and len(queue) > 1:  # stationary inputs (see SimConfig)
                    del queue[: int(self.rng.integers(len(queue)))]
        turn, agent, tr, sbs = queue.pop(0)
        self._send(si, sid, turn, agent, tr, sbs, lambda ok: self._client(queue, si, sid))

    def _send(self, ns: int, sid: str, turn: int, agent: str, tr: TraceRequest, sbs: int,
              then: Callable[[bool], None], max_out: int | None = None) -> None:
        """Send one request of session `sid` (hash namespace `ns`) now; `then(ok)` runs once
        it is recorded (ok False: rejected as longer than a rank's KV)."""
        self.requests_sent += 1
        cfg = self.cfg
        n_in = (scaled_length(tr.input_tokens, sbs, min(cfg.token_scale, sbs)) if cfg.token_scale
                else tr.input_tokens)
        n_out = max(1, tr.output_tokens)
        for cap in (cfg.max_output, max_out):
            if cap is not None:
                n_out = min(n_out, cap)
        rec = RequestRecord(f"sim-{self.requests_sent}", sid, turn, agent, start=self.clock.now,
                            input_tokens=n_in, max_tokens=n_out)
        if self._too_long(n_in, n_out):  # 400 before scheduling: no KV computed, none reusable
            rec.error, rec.status, rec.e2e = REJECTED, 400, self.overhead

            def rejected() -> None:
                self.records.append(rec)
                then(False)
            # via the clock, not a direct call: a run of rejected turns must not recurse
            self.clock.at(self.clock.now + self.overhead, rejected)
            return
        base = ns << 32
        hashes = [base + h for h in tr.hash_ids]
        seen = self.seen.setdefault(ns, set())
        reuse = _bisect_prefix(seen, hashes, 0, len(hashes))  # ids are prefix-chained
        seen.update(hashes)
        rec.reusable_tokens = min(reuse * cfg.block_size, n_in)

        def finished(q: SimRequest) -> None:
            self._finished(q)
            then(True)
        req = SimRequest(rec, hashes, n_in, n_out, finished)
        delay = self.overhead + self.overhead_per_token * n_in
        if not cfg.aggregated:
            # llm-d's endpoint picker routes at the gateway, before any vLLM API server sees
            # the prompt; each of the two legs then pays half the path (`_route_prefill`,
            # `_handoff`).
            req.leg = delay / 2
            self._route_prefill(req)
        elif delay > 0:
            # in order: client, router and API server take one request at a time, so those
            # behind wait for its per-token work (JSON, hashing); a lone one pays `delay`
            self._path_free = max(self.clock.now + self.overhead, self._path_free) \
                + self.overhead_per_token * n_in
            self.clock.at(self._path_free, lambda: self._route_agg(req))
        else:
            self._route_agg(req)

    def _too_long(self, n_in: int, n_out: int) -> bool:
        """Can the request never fit one rank's KV, even on an empty rank? vLLM caps
        `max_model_len` at what one rank's KV holds (or refuses to start), and its API server
        answers a prompt + max_tokens above it with HTTP 400 before scheduling. Prefill ranks
        hold the prompt; decode (and aggregated) ranks the prompt, the output and the step's
        MTP lookahead (`DecodeInstance._admit`/`_grow`). Without this check such a request
        would sit at its rank's FIFO queue head for the rest of the stage (DEP8: ~16% of the
        sweep's requests exceed a prefill rank's 183K tokens)."""
        bs = self.cfg.block_size
        if self.aggs:
            return cdiv(n_in + n_out, bs) > self.p_ranks[0].pool.num_blocks
        q = self.decodes[0].q
        return (cdiv(n_in, bs) > self.p_ranks[0].pool.num_blocks
                or cdiv(n_in + n_out + q, bs) > self.d_ranks[0].pool.num_blocks)

    def _route_agg(self, req: SimRequest) -> None:
        r = req.rank = self.policy.route(req, self.clock.now)
        self.aggs[self.p_ranks.index(r)].arrive(req)

    def _finished(self, req: SimRequest) -> None:
        self.records.append(req.rec)
        if self.aggs:
            self.policy.finish(req, self.clock.now)
        elif req.d_rank is not None:
            # llm-d's active-request scorer releases both endpoints when the response completes
            # (`ResponseComplete`), the prefill one included
            req.d_rank.active -= 1
            req.p_rank.active -= 1
        if not self.cfg.aggregated and req.rec.ttft is not None:
            s = req.rec.start
            a1, a2 = (req.api_s + [0.0, 0.0])[:2]  # each leg's API server time, its wait included
            self.phases.append((s, req.rec.end, req.t_route - s + a1 + a2, req.t_admit - req.t_route - a1,
                                max(0.0, req.ready_at - req.t_admit), req.t_pdone - req.t_admit,
                                req.t_arrive - req.t_pdone - a2, req.t_dadmit - req.t_arrive,
                                s + req.rec.ttft - req.t_dadmit, req.n_in - req.cached))

    # -- server side ---------------------------------------------------------------------------
    def _route_prefill(self, req: SimRequest) -> None:
        """Pick the prefill and the decode rank at once, as llm-d's P/D picker runs both
        profiles on arrival (the decode rank's sidecar then drives the prefill leg); the
        prompt reaches the prefill rank's queue after that leg's API server has taken it in."""
        assert self.router is not None  # built with the P/D pools
        miss = self.cfg.route_miss > 0 and self.miss_rng.random() < self.cfg.route_miss
        r = self.router.pick_blind(self.p_ranks, req) if miss else self.router.pick(self.p_ranks, req, False)
        req.rank = req.p_rank = r
        req.t_route = self.clock.now
        r.active += 1
        d = req.d_rank = self.router.pick(self.d_ranks, req, decode=True)
        d.active += 1

        def enqueue() -> None:
            self._owner(self.p_ranks, self.prefills, r).arrive(r, req)
        self._api(r, req, enqueue)

    def _api(self, r: Rank, req: SimRequest, fn: Callable[[], None]) -> None:
        """Run `fn` once rank `r`'s API server has spent `req.leg` on this prompt. The reference runs
        one API server process per rank (vLLM's `--data-parallel-multi-port-external-lb`
        starts each local rank as its own `vllm serve` with `api_server_count=1`), so prompts
        reaching the same rank are taken in one after another."""
        if req.leg <= 0:
            fn()
            return
        r.api_free = max(self.clock.now, r.api_free) + req.leg
        req.api_s.append(r.api_free - self.clock.now)  # waiting for the server included
        self.clock.at(r.api_free, fn)

    def _handoff(self, req: SimRequest) -> None:
        """Prefill done: the sidecar sends the prompt to the decode rank's API server (the
        second leg of the request path); the rank then pulls the KV it lacks, and decodes."""
        req.rec.cached_tokens = req.cached
        src, d = req.rank, req.d_rank
        assert src is not None and d is not None
        inst = self._owner(self.d_ranks, self.decodes, d)

        def pulled() -> None:  # the decode rank has the KV; the prefill copy is released
            req.t_arrive = self.clock.now
            self._owner(self.p_ranks, self.prefills, src).release(req)

        def reach() -> None:
            local = inst.local_prefix(d, req)
            inst.queried_tokens += req.n_in
            inst.local_hit_tokens += local
            pull = req.n_in - local
            inst.receive(req, self.dperf.kv_transfer_time(pull), pulled,
                         self.dperf.kv_post_time(pull, self.cfg.block_size))
        self._api(d, req, reach)

    @property
    def t0(self) -> float:
        """Start of the measured stage on the simulated clock: agentx, when the warm-up's last
        primer was answered; closed clients, `SimConfig.warmup`."""
        cfg = self.cfg
        if self._t0 is not None:
            return self._t0
        if cfg.warmup is not None:
            return max(0.0, cfg.warmup)
        return WARMUP_S if not cfg.aggregated and cfg.workload in SYNTH else 0.0

    def counted(self, start: float, end: float) -> bool:
        """Does a request count in the stage? If it `drains`: sent in the profiling window
        and answered within the grace period after it; else: finished in the window."""
        t0, t1 = self.t0, self.t0 + self.cfg.duration
        if self.drains:
            return t0 <= start < t1 and end <= t1 + self.grace
        return t0 < end <= t1

    def run(self) -> dict:
        """Run the stage with its load generator (`stages.run_stage`) and return `summary()`."""
        return run_stage(self)

    def _closed_clients(self) -> None:
        """For a synthesized reference-sweep xPyD stage (`join_midway`), closed clients
        replay runs drawn by `RunSampler` instead of whole sessions."""
        cfg = self.cfg
        if cfg.join_midway and not cfg.aggregated and cfg.workload in SYNTH:
            self.runs = RunSampler(self.sessions, cfg.concurrency, self.rng,
                                   REPLAY_RUN if cfg.replay_run is None else cfg.replay_run)

    def summary(self) -> dict:
        """The stage's summary record (`summary.stage_summary`)."""
        return stage_summary(self)


def simulate(cfg: SimConfig, sessions: Iterable[Session] | None = None) -> dict:
    """Run one stage and return the summary (bench's keys plus the simulator's)."""
    return simulate_records(cfg, sessions)[0]


def simulate_records(cfg: SimConfig, sessions: Iterable[Session] | None = None
                     ) -> tuple[dict, list[RequestRecord]]:
    """Run one stage; its summary and the requests it counted (bench's `RequestRecord`s, on
    the simulated clock), which `workload.report.write_outputs` writes as bench's run files."""
    if sessions is None:
        sessions = session_stream(cfg.workload, max(8, 2 * cfg.concurrency), cfg.seed,
                                  cfg.token_scale)
    sim = Simulation(cfg, sessions)
    return sim.run(), counted_records(sim)
