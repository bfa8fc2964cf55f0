"""`agentserve bench`: replay agent traces against an OpenAI endpoint and report what users see.

`run_bench(config)` loads the trace (or makes synthetic prompts, --isl/--osl), resolves
the model, sizes chat prompts to the served tokenizer (chatfit.py), sends the warm-up
requests (not measured), runs one stage (sessions, schedule) or one per concurrency
level, scrapes `/metrics` around each stage, and writes DIR/summary.json (a list, one
object per stage), requests.jsonl/.csv, sessions.jsonl, PNG plots and report.html.
Ctrl-C cancels the run; whatever was measured so far is still summarized and written.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from agentserve.workload.chatfit import ChatFit, LocalTokens, ServerTokens, fit_chat
from agentserve.workload.record import RequestRecord, SessionRecord
from agentserve.workload.replay_http import Target
from agentserve.workload.replay_load import load_workload
from agentserve.workload.replay_modes import Driver, run_concurrency, run_schedule, run_sessions
from agentserve.workload.replay_plan import Job, RequestFactory
from agentserve.workload.replay_progress import LiveProgress
from agentserve.workload.replay_synth import synthetic_sessions
from agentserve.workload.report import metric_deltas, summarize, write_outputs
from agentserve.workload.report_meta import run_info
from agentserve.workload.schema import Session

MODES = ("sessions", "concurrency", "schedule")
SYNTHETIC_POOL = 1000  # synthetic prompts when only a duration bounds the run (they cycle)
WARMUP_STAGE = -1  # the warm-up's stage number: salts its prompts apart from stage 0's


@dataclass
class BenchConfig:
    """Every knob of a run; the CLI flags map one to one (see cli_bench.py)."""

    url: str
    trace: str | None = None
    mode: str = "sessions"
    sessions: int = 16  # closed loop: sessions at once
    session_rate: float | None = None  # open loop: sessions started per second (Poisson)
    concurrency: list[int] = field(default_factory=lambda: [16])
    stage_duration: float | None = 60.0  # concurrency mode; None: one pass over the trace
    token_scale: int | None = None  # tokens sent per trace block (None: block_size)
    gap_scale: float = 1.0
    gap_cap: float | None = None
    duration: float | None = None  # sessions / schedule bound
    max_turns: int | None = None
    max_input: int | None = None
    max_output: int | None = None
    output_scale: float = 1.0
    api: str = "completions"
    model: str | None = None
    tokenizer: str | None = None  # chat: HF folder or .gguf to size prompts; None: the server's /tokenize
    api_key: str | None = None
    vocab_size: int = 4000
    request_timeout: float = 600.0
    isl: float | None = None  # synthetic input tokens (mean), instead of a trace
    isl_stddev: float = 0.0
    osl: float = 128.0  # synthetic output tokens (mean)
    osl_stddev: float = 0.0
    request_count: int | None = None  # requests per stage, at most (the trace cycles)
    warmup_requests: int = 0  # sent first, not measured
    gpus: int | None = None  # None: the engines behind a router's URL, else 1
    seed: int = 0
    out: str = "bench-out"
    progress: bool = True  # rich live table on a terminal, else a line every progress_interval s
    progress_interval: float = 10.0
    plots: bool = True
    # Preloaded workload (tests, the simulator, scripts); overrides `trace`.
    trace_sessions: list[Session] | None = None
    trace_jobs: list[Job] | None = None  # schedule mode: jobs with `at` already set
    trace_configs: list | None = None  # aiohttp TraceConfigs (client diagnostics, benchmarks)


class BenchRun:
    """One bench run; `stages`, `records` and `sessions` fill in as it goes."""

    def __init__(self, config: BenchConfig) -> None:
        if config.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {config.mode!r}")
        self.config = config
        self.stages: list[dict] = []
        self.records: list[RequestRecord] = []
        self.sessions: list[SessionRecord] = []
        self.warmup: list[RequestRecord] = []  # --warmup-requests: sent, not measured
        self.gpus, self.gpus_from = 1, "assumed (pass --gpus)"
        self.t0 = time.perf_counter()
        self.info: dict = {}  # the summary's `run` block (report_meta.run_info), set once the model is known

    def _labels(self) -> list[dict]:
        c = self.config
        if c.mode == "concurrency":
            return [{"mode": "concurrency", "stage": i, "concurrency": k} for i, k in enumerate(c.concurrency)]
        if c.mode == "sessions":
            return [{"mode": "sessions", "stage": 0, "sessions": None if c.session_rate else c.sessions,
                     "session_rate": c.session_rate}]
        return [{"mode": "schedule", "stage": 0}]

    def _workload(self) -> tuple[list[Session], list[Job]]:
        """The trace's sessions/jobs, or synthetic one-request sessions (--isl/--osl)."""
        c = self.config
        if c.isl is None:
            return load_workload(c)
        if c.mode == "schedule":
            raise ValueError("--mode schedule replays a trace's timestamps; synthetic requests "
                             "(--isl) run in concurrency or sessions mode")
        n = c.request_count or SYNTHETIC_POOL
        return synthetic_sessions(n, c.isl, c.osl, c.isl_stddev, c.osl_stddev, c.seed), []

    async def _warmup(self, target: Target, factory: RequestFactory, sessions: list[Session],
                      jobs: list[Job], progress: LiveProgress) -> None:
        """--warmup-requests: that many requests first, at the first stage's concurrency, on
        prompts salted apart from the measured ones (they warm the server, not its prefix
        cache); their records are dropped."""
        c = self.config
        n = c.warmup_requests
        if not n:
            return
        pool = sessions or [Session(j.session_id, j.block_size, [j.req],
                                    "local" if j.scope else "global") for j in jobs]
        k = (c.concurrency[0] if c.mode == "concurrency" else c.sessions if c.mode == "sessions"
             else 1)
        skipped = factory.skipped
        d = Driver(target, factory, self.t0, WARMUP_STAGE, None, max_turns=c.max_turns, limit=n)
        progress.stage({"mode": "warmup", "warmup": n})
        await run_concurrency(d, pool, min(k, n), cycle=True)
        factory.skipped = skipped  # the warm-up's skips are not the run's
        self.warmup = d.records

    def _gpus(self, engines: int | None) -> tuple[int, str]:
        """GPUs for tok/s per GPU: --gpus when given, else the engines a router lists, else 1."""
        if self.config.gpus is not None:
            return self.config.gpus, "--gpus"
        if engines:
            return engines, f"router /health lists {engines} engine(s)"
        return 1, "assumed (pass --gpus)"

    def _connector_limit(self) -> int:
        # Concurrency mode knows its peak; sessions (sub-agent bursts) and schedules do not,
        # and a limit there would queue requests inside the client and inflate TTFT.
        return max(self.config.concurrency) if self.config.mode == "concurrency" else 0

    async def run(self) -> list[dict]:
        c = self.config
        sessions, jobs = self._workload()
        progress = LiveProgress(enabled=c.progress, interval=c.progress_interval)
        try:
            async with Target(c.url, c.api, c.api_key, c.model, c.request_timeout,
                              self._connector_limit(), c.trace_configs) as target:
                engines = await target.engines()  # the first contact: unreachable raises here
                self.gpus, self.gpus_from = self._gpus(engines)
                model = await target.resolve_model()
                self.info = run_info({"producer": "bench", "url": c.url, "model": model, "api": c.api,
                                      "mode": c.mode, "trace": c.trace or "(preloaded)"})
                fit = await self._chat_fit(target, model) if c.api == "chat" else None
                factory = RequestFactory(model, c.api, c.vocab_size, c.seed, c.token_scale, c.max_input,
                                         c.max_output, c.output_scale, fit)
                async with progress:
                    await self._warmup(target, factory, sessions, jobs, progress)
                    for label in self._labels():
                        await self._stage(target, factory, label, sessions, jobs, progress)
                        write_outputs(c.out, self.stages, self.records, self.sessions, plots=False)
        finally:
            # no request sent (e.g. the URL refused us): nothing to plot, and the cause must show
            write_outputs(c.out, self.stages, self.records, self.sessions,
                          plots=c.plots and bool(self.records))
        return self.stages

    async def _chat_fit(self, target: Target, model: str) -> ChatFit:
        """One-token words and template overhead of the served tokenizer (chatfit.py)."""
        c = self.config
        assert target.session is not None
        src = (LocalTokens(c.tokenizer) if c.tokenizer
               else ServerTokens(target.session, target.base, model, target.headers))
        return await fit_chat(src, c.seed)

    async def _stage(self, target: Target, factory: RequestFactory, label: dict,
                     sessions: list[Session], jobs: list[Job], progress: LiveProgress) -> None:
        """Run one stage; its summary is appended even when cancelled."""
        c = self.config
        before = await target.scrape_metrics()
        duration = c.stage_duration if c.mode == "concurrency" else c.duration
        d = Driver(target, factory, self.t0, label["stage"], duration, c.gap_scale, c.gap_cap,
                   c.max_turns, progress.add, c.request_count)
        skipped0 = factory.skipped
        progress.stage(label)
        interrupted = False
        try:
            if c.mode == "sessions":
                await run_sessions(d, sessions, c.sessions, c.session_rate, c.seed)
            elif c.mode == "concurrency":
                cycle = duration is not None or c.request_count is not None
                await run_concurrency(d, sessions, label["concurrency"], cycle=cycle)
            else:
                await run_schedule(d, jobs)
        except asyncio.CancelledError:
            interrupted = True  # Ctrl-C: summarize what was measured, then let it propagate
            raise
        finally:
            wall = time.perf_counter() - d.begin
            try:
                after = await asyncio.wait_for(target.scrape_metrics(), 3.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                after = {}
            self.records += d.records
            self.sessions += d.sessions
            self.stages.append(summarize(d.records, wall, dict(label, interrupted=interrupted, run=self.info,
                                                                     gpus_from=self.gpus_from),
                                         d.sessions if c.mode == "sessions" else None, self.gpus,
                                         factory.skipped - skipped0, metric_deltas(before, after)))


def run_client(coro):
    """Run the client's event loop on uvloop: a cheaper loop is less added latency per stream."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_bench(config: BenchConfig) -> list[dict]:
    """Run a bench to completion (or Ctrl-C) and return the per-stage summaries."""
    run = BenchRun(config)
    try:
        run_client(run.run())
    except KeyboardInterrupt:
        pass  # asyncio.run cancelled the run; its finally blocks wrote the partial results
    return run.stages
