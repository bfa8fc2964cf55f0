"""What one simulation is: the deployment, the workload and the model knobs (`agentserve
sim`'s flags, SIM-1), and the topology notation shared with `agentserve up`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from agentserve.sim.constants import VLLM_REQUEST_PATH, Efficiency
from agentserve.sim.specs import HardwareSpec, hardware_spec
from agentserve.sim.memory import BLOCK_SIZE

__all__ = ["CLIENTS", "IDLE_GAP_CAP_S", "LIMITS", "MAX_INSTANCES", "ROUTE_MISS", "SimConfig",
           "check_clients", "check_config", "check_route_miss", "parse_idle_gap_cap",
           "parse_topology", "request_path"]

# `SimConfig.clients`, besides None (the default for the deployment)
CLIENTS = ("agentx", "closed", "schedule")
# AIPerf's per-trace idle-gap cap as some of its docs state it (`--trace-idle-gap-cap-seconds
# 10`), the replay's default. Which rule the reference's AIPerf image applied is not known; with
# this one the synthesized corpus's lanes hold a request in flight as much of the time as the
# reference's and every other published AgentX run at hand (~1, `benchmarks/sim_lane_duty.py`);
# uncapped, 0.67-0.85 of the time (docs/sim/notebook.md, stop 30). The synthesized think times come
# from SPEC's study of production sessions, whose idle tail (p99 11.4 min) the replayed corpus
# does not show.
IDLE_GAP_CAP_S = 10.0
# Share of P/D requests whose prefill rank the picker chooses on load alone, as it does when its
# prefix view holds nothing for the request. The reference captures 96-97% of the reusable
# prefix (SPEC; llm-d's GLM-5.2 write-up: 91.4% prefill hits against a 93.9% ceiling at DEP8
# 1P1D c64, and "GPU memory supplies about 90-92%" on the DEP16 1P1D and 2P1D runs); the
# simulator's picker, with an exact view, captured 99.8%. Why the reference's picker misses is
# not published. 4% reproduces the published capture (0.957-0.960 on the calibration run, GPU
# hits 0.913-0.925 on the four limited DEP16 points; 3 seeds); it was set from that statistic,
# not from a latency (docs/sim/notebook.md, stop 31). With stop 32's sweep (more new input a turn):
# capture 0.949-0.961, those hits 0.897-0.904.
ROUTE_MISS = 0.04
# Bounds of one simulation's flags, far beyond any deployment or stage studied: they keep a typo
# (1e12 s, a million ranks) from becoming an hour-long run or an exhausted memory.
MAX_INSTANCES = 1024  # instances of a role in --topology
LIMITS = {"width": 1024, "gpus": 16_384, "concurrency": 10_000, "duration": 86_400.0,
          "cpu_offload_gib": 10_000.0, "seed": 2**32 - 1, "seeds": 64}


@dataclass(slots=True)
class SimConfig:
    """What `agentserve sim` takes (flags of SIM-1)."""

    model: str = "glm-5.2-fp8"
    gpu: str = "h200"
    prefill: int = 3  # prefill instances (xP)
    decode: int = 1  # decode instances (yD)
    prefill_width: int = 16
    decode_width: int = 16
    concurrency: int = 128
    mtp: bool = True
    cpu_offload_gib: float = 100.0  # per prefill rank
    # When blocks reach the CPU tier, as the engine's --kv-store-on: "fill" (write-through,
    # vLLM's offloading connector: the tier mirrors the device's newest content first) or
    # "evict" (write-back: the tier holds what the device dropped; the capacities add up)
    cpu_store_on: str = "fill"
    workload: str = "sweep-full"
    # The stage, simulated s after the warm-up: the reference's (its aiperf command passes
    # `--benchmark-duration 900`). A shorter window answers fewer of the long outputs (AIPerf
    # counts a request only when it was sent in the window and answered within the grace):
    # 600 s stages read output 3-4% lower at c64-c128 (docs/sim.md, "The calibration run").
    duration: float = 900.0
    seed: int = 0
    # Prefill max_num_batched_tokens per rank: the reference's prefill manifest passes
    # `--max-num-batched-tokens 2048` (llm-d `guides/wide-ep-lws/modelserver/gpu/vllm-glm-5.2/
    # base/prefill.yaml`; vLLM's own `vllm serve` default would be 8,192). It sets how long
    # one DEP step lasts, and so how long a short prompt waits behind a rank chunking a long
    # one (the step is a barrier across the instance; the rank's running prefill takes the
    # whole budget first). Aggregated engines: the engine's max_num_batched_tokens.
    chunk: int = 2_048
    max_seqs: int = 256  # aggregated engines: max_num_seqs
    # Decode max_num_batched_tokens = max_num_seqs per rank, per node the instance spans: the
    # reference's decode manifest sets both to MAX_TOKENS_PER_NODE (32) x nodes (DEP16: 64;
    # DEP8: 32). A verify step takes 1 + drafts tokens of each request, so with MTP (3 drafts)
    # a DEP16 rank decodes at most 16 requests at once, a DEP8 rank 8.
    decode_tokens_per_node: int = 32
    # The decode profile's scorers and weights (None: the reference's, `cluster.DECODE_SCORERS`,
    # requests in flight only). {} scores every rank alike: the max-score picker then draws the
    # rank at random, a counterfactual with no return to a client's previous rank
    # (benchmarks/sim_decode_locality.py).
    decode_scorers: dict[str, float] | None = None
    # How the prefill profile's two prefix scorers see the ranks. "precise": the pools' actual
    # contents (GPU, then GPU or CPU). "approx": llm-d's approx-prefix-cache-producers, which the
    # reference's router overrides configure: the picker's own records of the prompt heads it
    # routed, per rank, blind to evictions (cluster.ApproxRouter over router/approx.py).
    prefix_index: str = "precise"
    # P/D: share of requests the prefill profile routes on load alone (`ROUTE_MISS`; 0: the
    # picker always sees the prefixes).
    route_miss: float = ROUTE_MISS
    # The load generator. "agentx": AIPerf's agentic replay, as the reference ran every published
    # figure (`aiperf profile --scenario inferencex-agentx-mvp`; lanes.py): each of the
    # `concurrency` lanes replays a session tree with its recorded think times, sub-agents in
    # parallel on their parent's lane, joined at a uniform instant of the trace after a warm-up
    # of primers; `duration` s are profiled, plus AIPerf's 30 s grace for requests in flight.
    # "closed": every client sends its next request the moment the last one finishes (no think
    # time; `warmup`, `join_midway`, `replay_run` apply to it only). "schedule": a trace file's
    # requests at their recorded times, open loop (`agentserve bench --mode schedule`;
    # schedule.py; `concurrency` unused). None: "agentx" for xPyD, "closed" for aggregated
    # engines (compared with `agentserve bench`, a closed loop).
    clients: str | None = None
    # schedule: sessions per second, session i starting at i / rate (None: at their recorded
    # starts, a mooncake trace's timestamps), as `agentserve bench --session-rate`
    session_rate: float | None = None
    # agentx: cap on each replayed think time (s); None: as recorded (the scenario forbids a
    # cap; its first versions capped each trace's gaps at 60 s).
    gap_cap_s: float | None = None
    # agentx: AIPerf's per-trace idle-gap cap (s; `lanes.compress_idle_gaps`): the trace's
    # request-start timeline is compressed so consecutive starts are at most this far apart.
    # Default `IDLE_GAP_CAP_S`; None: off, as the scenario versions that load the dated corpora
    # require (60 in its first versions).
    idle_gap_cap_s: float | None = IDLE_GAP_CAP_S
    # Closed clients: simulated seconds before the measured stage; None: WARMUP_S for xPyD on a synthesized
    # workload, else 0. The simulator starts from an empty cluster with every client joining
    # at once, cold: a burst of full-context prefills that no stage of the reference's
    # concurrency ladder saw (its deployment was warm). Requests finishing in
    # (warmup, warmup + duration] are measured, as AIPerf counts a stage's. A trace file is
    # replayed once (all of it counts) and aggregated engines are compared with
    # `agentserve bench`, which starts cold: both default to 0.
    warmup: float | None = None
    block_size: int = BLOCK_SIZE
    # Stationary request mix. Synthesized workloads (xPyD): clients replay runs of turns, each
    # from a request drawn uniformly over the pool's requests (`workload.RunSampler`), so the
    # stage's inputs are the corpus's pooled distribution whatever its length. A trace file:
    # every session is joined at a uniformly random request. False: sessions from their start.
    join_midway: bool = True
    # Turns per replayed run (None: `workload.REPLAY_RUN`, to the session's end, which gives the
    # reference's published reusable-prefix ceiling). Each run is a fresh conversation whose
    # first request is computed cold, so a shorter run starts more cold prefills.
    replay_run: int | None = None
    # Aggregated engines ("both" role, `agentserve up --topology N`): when > 0 the deployment is
    # `aggregated` one-rank engines that prefill and decode in the same step (agg.py); the
    # prefill/decode fields are then unused, `chunk` is the engine's max_num_batched_tokens.
    aggregated: int = 0
    # Aggregated engines: the engine's own KV block size in tokens when it is coarser than
    # `block_size` (a token-scaled trace block): it reuses whole blocks of its size only.
    engine_block_tokens: int | None = None
    kv_tokens: int | None = None  # KV capacity per engine (None: the memory model's)
    # As `agentserve bench`: tokens per trace block (inputs scale by token_scale/block_size;
    # then `block_size` should equal it) and the output cap.
    token_scale: int | None = None
    max_output: int | None = None
    # Client -> router -> engine and back, per request, outside engine steps (HTTP, routing,
    # tokenization, stream setup); None: the cpu-local profile's `request_overhead_s` (our
    # engine), else vLLM's request path (`constants.VLLM_REQUEST_PATH`) once per API server the
    # prompt passes (two in P/D, one aggregated). Aggregated engines pay it before routing; P/D
    # routes first and pays half at the prefill rank's API server, half at the decode rank's.
    request_overhead_s: float | None = None
    # ... and per prompt token, cached or not (JSON, chat template, tokenizing, block hashing,
    # prefix lookup); None: as above.
    request_overhead_per_token_s: float | None = None
    # CPU -> GPU restore time per GB of a rank's CPU tier; None: the hardware spec's (H200:
    # SPEC's ~26 ms per GB). A deployment whose tier is slower to reach under load (pageable
    # memory, eight ranks sharing a host) sets its own (docs/sim/notebook.md, stop 42).
    cpu_restore_s_per_gb: float | None = None
    # cpu-local's calibration profile (`specs.cpu_profile_path`: None, the environment's or the
    # checkout's committed one).
    cpu_profile: str | None = None
    # Overrides of the step model's global factors (`constants.Efficiency`), e.g. {"hbm": 0.5}:
    # what-if runs, such as kernels that stream weights at what PyTorch's FP8 GEMMs reached on
    # an H200 (`benchmarks/sim_gpu_rank.py`; docs/sim.md, "Checked on an H200"). None: the
    # defaults. Not with cpu-local, whose profile measured its own rates.
    efficiency: dict[str, float] | None = None

    def hardware(self) -> HardwareSpec:
        """The deployment's hardware: `gpu`'s spec with this stage's restore rate and profile."""
        return hardware_spec(self.gpu, self.cpu_restore_s_per_gb, self.cpu_profile)


def request_path(cfg: SimConfig, hw: HardwareSpec) -> tuple[float, float]:
    """Per-request time outside engine steps, (fixed s, s per prompt token). cpu-local is our
    engine: what its profile measured (0 without one). Other hardware runs the reference's
    vLLM: `VLLM_REQUEST_PATH` once per vLLM API server the prompt passes, two in P/D (llm-d's
    sidecar sends it to a prefill and then a decode server, each parsing, rendering,
    tokenizing and hashing all of it), one for aggregated engines."""
    if hw.name == "cpu-local":
        m = hw.measured or {}
        return (float(m.get("request_overhead_s", 0.0)),
                float(m.get("request_overhead_per_token_s", 0.0)))
    legs = 1 if cfg.aggregated else 2
    return legs * VLLM_REQUEST_PATH[0], legs * VLLM_REQUEST_PATH[1]


def busy_path(hw: HardwareSpec) -> tuple[float, float]:
    """What a request takes extra when it reaches one of our engines while it steps (fixed s,
    s per prompt token): our API server shares the engine core thread's process and GIL. The
    cpu-local profile measures both (`request_overhead_busy_s`, and since stop 49
    `request_overhead_busy_per_token_s`: a cached long prompt's busy probes beside 16-token
    ones); 0 for a profile without them and for other hardware (vLLM's API servers are their
    own processes)."""
    m = hw.measured or {}
    return (float(m.get("request_overhead_busy_s", 0.0)),
            float(m.get("request_overhead_busy_per_token_s", 0.0)))


def arrival_stretch(hw: HardwareSpec) -> tuple[float, float]:
    """How much longer one of our engines' step in flight runs for each request that reaches
    the engine during it (fixed s, s per prompt token): the request's handling on the API
    thread (JSON, hashing, hand-over) takes the GIL from the core thread's step. Opt-in: the
    cpu-local profile's `arrival_stretch_s` and `arrival_stretch_per_token_s`, which the server
    calibration measures on the engines' own traces but records only as
    `arrival_stretch_measured_*` (`sim_calibrate_cpu.with_arrival_stretch`; applied, it moved
    the open-loop check out of band, docs/sim/notebook.md, stop 51); 0 for a profile without them and
    for other hardware (vLLM's API servers are their own processes)."""
    m = hw.measured or {}
    return (float(m.get("arrival_stretch_s", 0.0)),
            float(m.get("arrival_stretch_per_token_s", 0.0)))


def check_route_miss(share: float) -> None:
    """Refuse a `--route-miss` share outside [0, 1]."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--route-miss must be a share between 0 and 1, got {share!r}")


def check_clients(clients: str | None) -> None:
    """Refuse a load generator other than those of `CLIENTS` (None: the deployment's default)."""
    if clients is not None and clients not in CLIENTS:
        raise ValueError(f"--clients must be {', '.join(CLIENTS[:-1])} or {CLIENTS[-1]}, "
                         f"got {clients!r}")


def check_config(cfg: SimConfig) -> None:
    """Refuse the knobs a simulation cannot run with, each with its flag's name."""
    check_clients(cfg.clients)
    check_route_miss(cfg.route_miss)
    if cfg.session_rate is not None and (cfg.clients != "schedule" or not cfg.session_rate > 0):
        raise ValueError(f"--session-rate spaces the sessions of --clients schedule and must be "
                         f"> 0, got {cfg.session_rate!r} with --clients {cfg.clients}")
    if cfg.cpu_store_on not in ("fill", "evict"):
        raise ValueError(f"--cpu-store-on must be fill or evict, got {cfg.cpu_store_on!r}")
    if cfg.prefix_index not in ("precise", "approx"):
        raise ValueError(f"--prefix-index must be precise or approx, got {cfg.prefix_index!r}")
    if cfg.prefix_index == "approx" and cfg.aggregated:
        raise ValueError("--prefix-index approx is the P/D prefill picker's; aggregated engines "
                         "route with our router's own policy")
    check_efficiency(cfg.efficiency, cfg.gpu)
    # a hash id stands for one BLOCK_SIZE-token block of a loaded trace, or for token_scale
    # tokens of it when scaled: the pools' blocks must be that long
    block = min(cfg.token_scale, BLOCK_SIZE) if cfg.token_scale else BLOCK_SIZE
    if cfg.block_size != block:
        raise ValueError(f"block_size {cfg.block_size} does not match the workload's blocks "
                         f"({block} tokens a hash id with token_scale {cfg.token_scale})")


def efficiency(overrides: dict[str, float] | None) -> Efficiency:
    """The step model's factors with `overrides` applied; an unknown name or a value the
    model cannot take (a factor or time <= 0, an overlap outside [0, 1]) is refused."""
    known = {f.name for f in fields(Efficiency) if isinstance(f.default, float)}
    for k, v in (overrides or {}).items():
        if k not in known:
            raise ValueError(f"--efficiency: unknown factor {k!r}; choose from "
                             f"{', '.join(sorted(known))}")
        if not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise ValueError(f"--efficiency {k}: a number, got {v!r}")
        if (not 0.0 <= v <= 1.0) if k == "prefill_overlap" else v <= 0:
            raise ValueError(f"--efficiency {k}={v}: " + ("a share between 0 and 1"
                             if k == "prefill_overlap" else "must be > 0"))
    return Efficiency(**(overrides or {}))


def check_efficiency(overrides: dict[str, float] | None, gpu: str) -> None:
    """Refuse factor overrides the model cannot take, and any for cpu-local (measured rates)."""
    if overrides and gpu == "cpu-local":
        raise ValueError("--efficiency sets the roofline's factors; cpu-local's profile "
                         "measured its own rates")
    efficiency(overrides)


def parse_efficiency(s: str) -> dict[str, float]:
    """`--efficiency hbm=0.5,flops=0.5`: name=value pairs, each checked by `efficiency`."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in s.split(","))):
        name, eq, val = part.partition("=")
        try:
            if not eq:
                raise ValueError(part)
            out[name.strip()] = float(val)
        except ValueError:
            raise ValueError(f"--efficiency {part!r}: name=number, e.g. hbm=0.5") from None
    if not out:
        raise ValueError(f"--efficiency {s!r}: name=number pairs, e.g. hbm=0.5,flops=0.5")
    efficiency(out)
    return out


def parse_idle_gap_cap(s: str) -> float | None:
    """A `--idle-gap-cap-s` value: seconds (>= 0), or "off" for no cap."""
    if s.strip().lower() == "off":
        return None
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"--idle-gap-cap-s takes seconds or off, got {s!r}") from None
    if not v >= 0:  # also refuses nan
        raise ValueError(f"--idle-gap-cap-s must be >= 0 s or off, got {s!r}")
    return v


def parse_topology(s: str) -> tuple[int, int]:
    """"3P1D" -> (3, 1); "2" (aggregated engines, as `agentserve up`) -> (0, 2)."""
    m = re.fullmatch(r"(\d+)P(\d+)D|(\d+)", s.strip().upper())
    if m is None:
        raise ValueError(f"--topology must look like 3P1D (x prefill, y decode instances) or N "
                         f"(N aggregated engines), got {s!r}")
    p, d = (0, int(m[3])) if m[3] else (int(m[1]), int(m[2]))
    if d < 1 or (m[3] is None and p < 1):
        raise ValueError(f"--topology {s!r}: needs at least one prefill and one decode instance, "
                         "or N >= 1 aggregated engines")
    if max(p, d) > MAX_INSTANCES:
        raise ValueError(f"--topology {s!r}: at most {MAX_INSTANCES} instances of a role")
    return p, d
