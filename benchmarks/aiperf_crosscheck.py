"""USER-1 / WORKLOAD-1 cross-check: `agentserve bench --mode concurrency` against AIPerf, same engine,
same requests.

Starts ONE of our engines (tiny model, CPU), writes a small mooncake_trace (completions: input
256-512 tokens; `--api chat`: 508-572 served tokens, ~540; output 48-80, mean 64; unique hash ids
per request so neither tool gets prefix-cache hits) and runs AIPerf (`aiperf profile`, cached venv
from scripts/ensure_aiperf_venv.sh) and our bench on it with the same concurrency and duration.
Compares the medians over rounds of TTFT p50, ITL p50 and output tok/s; passes when every ratio
(ours / AIPerf) is within ±5% (`--tolerance`).

Design `overlap` (default): both tools run AT THE SAME TIME, each at the given concurrency, over
the same window (see run_overlapped), so whatever else the shared 2-core machine does hits both
alike. Run one after the other (`--design sequential`, ABBA order) the engine's speed swung up to
2.7x between adjacent 25 s runs here, far beyond a 5% check. A metric outside the band whose pooled
per-request bootstrap interval still holds 1.0 is reported as sampling noise (verdict
"inconclusive"): TTFT p50 of ~50 closed-loop requests moves ±20% between identical runs.

`--target stub`: a fixed-timing server (serve_stub: each stream opens with a role-only delta at
once, the first token `--stub-ttft` later, then one per `--stub-itl`) instead of the engine. No
batching, no engine CPU: what is left of a gap is the tools' own clocks.

Where each tool starts and stops the TTFT clock (AIPerf 0.13.0 source; ours in replay_http.py):
- start: AIPerf stamps `start_perf_ns` just before `session.request` (transports/aiohttp_client.py,
  payload already encoded by aiohttp_transport.py); ours just before `session.post`, body encoded.
- first token: AIPerf's TTFT is `content_responses[0].perf_ns - start_perf_ns`
  (metrics/types/ttft_metric.py), a content response being an SSE message with parsed data
  (common/models/record_models.py): chat content, reasoning or tool-call text
  (endpoints/openai_chat.py extract_chat_response_data), so the role-only first delta and the
  usage chunk are skipped; its time is when the network read returned (transports/sse_utils.py).
  Ours: the first chunk `_chunk_tokens` counts, timed at its read. Same rule; ours missed tool-call
  and `reasoning` deltas until USER-1 (tests/workload/test_ttft.py).
- our engine writes the role delta only with the first token (engine/http/chat.py _chat_events),
  as vLLM's serving_chat does on its first output, so it does not start anyone's clock early.
- ITL: AIPerf ends a request at its last content response, ours at the stream's end (usage chunk,
  [DONE]); `itl_p50_ms_last_chunk` in the result sizes the gap (under 0.1% here).
The clocks agree: on the stub TTFT p50 is 311.5 vs 313.8 ms (true 300; results/
aiperf_crosscheck_chat_stub.json), and on the engine `--engine-trace` splits each TTFT into the
engine's part (HTTP handler start to first output) and the client's share, whose p50 is ~30 ms for
both tools. So the finding "bench TTFT 18% below AIPerf's, c8 chat" is in what the ENGINE did for
each tool's requests, and it stays when both run at once (results/aiperf_crosscheck_chat.json).
What differs between the tools' load: ours sends the next request 0.2 ms after one ends, AIPerf
20-37 ms later (its credit goes back through its timing manager), so their requests meet the
engine's steps at other phases, and AIPerf's more often shared a prefill step. `--peer agentserve`
(two copies of our bench, the control) shows how big such phase effects are: TTFT p50 1.16
between identical clients (results/aiperf_crosscheck_chat_control.json), so closed loops sharing
one busy engine cannot check TTFT to ±5%; a fixed schedule for both would (not built yet). Each
run also records the cores its client and the engine used while it measured (CpuSampler): AIPerf
0.12-0.25 cores, ours ~0.01, which on 2 cores run one after the other is the engine's loss too.

Experiment alignment (not number fudging), each checked in AIPerf 0.13.0's source:
- `--use-server-token-count`: AIPerf otherwise re-tokenizes the streamed *text* with the client
  tokenizer; a tiny random model's text does not round-trip (64 generated tokens re-encode to
  ~72), which inflates its output tok/s and deflates its ITL by ~12%. We count usage tokens.
- `--no-fixed-schedule`: a mooncake trace with timestamps otherwise switches AIPerf to
  fixed-schedule replay; we want its closed-loop concurrency mode.
- `--extra-inputs ignore_eos:true` (our bench always sends it); streaming.
- Tokenizer: our tiny model's tokenizer files, laid out as a local HF cache snapshot
  (HF_HUB_OFFLINE=1 makes AIPerf 0.13.0 resolve even a local folder through the HF cache).
- Completions: AIPerf sends text built from hash ids (512-token blocks, as our loader); the server
  re-encodes it to exactly `input_length` tokens (checked: usage prompt_tokens == ISL). Ours sends
  token ids. Chat: AIPerf sizes the message text to `input_length` and the server's template adds
  its own tokens; our bench fits the whole served chat to `input_length` (workload/chatfit.py). So
  AIPerf's trace asks the template's tokens less (chat_overhead); `served_input_mean` checks it.
- Each round uses fresh hash ids and seeds, so no run is served from an earlier run's cache.

    .venv/bin/python benchmarks/aiperf_crosscheck.py --out bench-out/aiperf_crosscheck.json
    .venv/bin/python benchmarks/aiperf_crosscheck.py --api chat --duration 60 \
        --out benchmarks/results/aiperf_crosscheck_chat.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _load import fire, model_id, random_prompts
from agentserve.cluster.procs import agentserve_cmd, start_engine
from agentserve.workload.replay_http import parse_prometheus

REPO = Path(__file__).resolve().parents[1]
METRICS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p50_ms", "ITL p50 (ms)"),
           ("output_tok_s", "output tok/s"))
MOONCAKE_BLOCK = 512  # tokens per mooncake hash id, for both tools
FAKE_COMMIT = "0" * 40  # snapshot name in the local HF cache we build for AIPerf's tokenizer


def aiperf_venv() -> Path:
    return Path(os.environ.get("AGENTSERVE_AIPERF_VENV", Path.home() / ".cache/agentserve/aiperf-venv"))


def ensure_aiperf() -> Path:
    subprocess.run(["bash", str(REPO / "scripts/ensure_aiperf_venv.sh"), str(aiperf_venv())], check=True)
    return aiperf_venv() / "bin" / "aiperf"


def write_trace(path: Path, n: int, isl: tuple[int, int], osl: tuple[int, int], seed: int,
                id_base: int, input_offset: int = 0) -> None:
    """mooncake_trace JSONL: n requests, uniform input and output lengths, unique hash ids.

    `input_offset` is added to every input length after drawing (same seed: same requests
    otherwise): AIPerf's chat trace gets minus the chat template's tokens (see main).

    Output lengths vary (default 48-80, mean 64): with one fixed length a closed loop runs in
    lockstep waves (all C requests start and end together), and two tools running at once would
    keep a fixed phase against each other: one tool's requests would always arrive while the
    other's decode, which skews TTFT and ITL between them with no fault in either measurement.

    Each request has its own hash ids, one per started 512-token block (both tools read
    mooncake hash ids at 512 tokens per block), so neither tool gets prefix-cache hits.
    """
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            n_in, n_out = rng.randint(*isl) + input_offset, rng.randint(*osl)
            blocks = -(-n_in // MOONCAKE_BLOCK)
            ids = [id_base + i * 16 + b for b in range(blocks)]
            f.write(json.dumps({"timestamp": i * 100, "input_length": n_in, "output_length": n_out,
                                "hash_ids": ids}) + "\n")


def hf_cache_with_tokenizer(model_dir: Path, root: Path, repo_id: str = "agentserve/tiny") -> Path:
    """A local HF hub cache holding `repo_id` = our model's tokenizer (AIPerf offline needs one)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / FAKE_COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model_dir / name, snap / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(FAKE_COMMIT)
    return root


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _proc_cpu() -> tuple[dict[int, int], dict[int, float]]:
    """(parent of each live pid, its CPU seconds: user + system, reaped children included)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        parent[int(d)] = int(rest[1])  # fields 4 (ppid), 14-17 (utime stime cutime cstime)
        cpu[int(d)] = sum(int(x) for x in rest[11:15]) / tick
    return parent, cpu


class CpuSampler:
    """CPU seconds of a client's process tree and of the engine, sampled every `every` s.

    The point: on a 2-core machine a client's own CPU is CPU the engine does not get. AIPerf
    runs a dozen processes (workers, record processors, managers over ZMQ); ours is one event
    loop. Run one after the other, the tool that burns more CPU while measuring sees a slower
    engine. `cores(key, t0, t1)` is the average cores used over a wall-clock window.
    """

    def __init__(self, client_pid: int | None, engine_pid: int | None, every: float = 0.5) -> None:
        self.client_pid, self.engine_pid, self.every = client_pid, engine_pid, every
        self.samples: list[tuple[float, float, float]] = []  # (wall, client tree cpu, engine cpu)
        self.own_cpu = 0.0  # this thread's CPU (it counts in our RUSAGE_SELF: subtract it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _sample(self) -> None:
        parent, cpu = _proc_cpu()
        tree = 0.0
        if self.client_pid is not None:
            kids: dict[int, list[int]] = {}
            for pid, pp in parent.items():
                kids.setdefault(pp, []).append(pid)
            todo = [self.client_pid]
            while todo:
                pid = todo.pop()
                tree += cpu.get(pid, 0.0)
                todo += kids.get(pid, [])
        self.samples.append((time.time(), tree, cpu.get(self.engine_pid, 0.0) if self.engine_pid else 0.0))

    def _loop(self) -> None:
        c0 = time.thread_time()
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)
        self._sample()
        self.own_cpu = time.thread_time() - c0

    def cores(self, key: str, t0: float, t1: float) -> float | None:
        """Average cores of `key` ("client" or "engine") over wall-clock [t0, t1]."""
        col = 1 if key == "client" else 2
        inside = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(inside) < 2:
            return None
        # Up to the highest total: once the client has exited, its tree reads 0.
        top = max(inside, key=lambda x: x[col])
        if top[0] <= inside[0][0]:
            return None
        return (top[col] - inside[0][col]) / (top[0] - inside[0][0])


def aiperf_window(out: Path) -> tuple[float, float]:
    """Wall-clock seconds from AIPerf's first request start to its last request end."""
    meta = [json.loads(line)["metadata"] for line in open(out / "profile_export.jsonl")]
    return (min(m["request_start_ns"] for m in meta) / 1e9,
            max(m.get("request_end_ns") or m["request_start_ns"] for m in meta) / 1e9)


def _run(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 600,
         engine_pid: int | None = None) -> tuple[dict, CpuSampler]:
    """Run a client to completion; wall and CPU seconds (its process tree), load average around
    it, and the CPU samples of it and of the engine meanwhile."""
    load0, cpu0, t0 = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            with CpuSampler(p.pid, engine_pid) as sampler:
                rc = p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    info = {"wall_s": time.perf_counter() - t0, "client_cpu_s": _children_cpu() - cpu0,
            "loadavg_1m": [load0, os.getloadavg()[0]]}
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[0]} exited {rc}; log {log}:\n{tail}")
    return info, sampler


def _window_cores(sampler: CpuSampler, t0: float, t1: float) -> dict:
    return {"client_cores": sampler.cores("client", t0, t1), "engine_cores": sampler.cores("engine", t0, t1)}


def aiperf_cmd(aiperf: Path, url: str, model: str, trace: Path, out: Path, hf_cache: Path, args,
               seed: int) -> tuple[list[str], dict]:
    cmd = [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", args.api,
           "--streaming", "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
           "--no-fixed-schedule", "--concurrency", str(args.concurrency),
           "--benchmark-duration", str(args.duration), "--benchmark-grace-period", "120",
           "--tokenizer", "agentserve/tiny", "--extra-inputs", "ignore_eos:true",
           "--artifact-dir", str(out), "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--random-seed", str(seed), "--workers-max", "1"]
    if not args.client_token_count:
        cmd.append("--use-server-token-count")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(hf_cache),
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return cmd, env


def parse_aiperf(out: Path) -> dict:
    d = json.loads((out / "profile_export_aiperf.json").read_text())

    def get(tag: str, stat: str = "avg"):
        v = d.get(tag)
        return None if not isinstance(v, dict) else v.get(stat)

    samples = {"ttft_ms": [], "itl_ms": []}
    for line in open(out / "profile_export.jsonl"):
        m = json.loads(line).get("metrics", {})
        for key, tag in (("ttft_ms", "time_to_first_token"), ("itl_ms", "inter_token_latency")):
            if isinstance(m.get(tag), dict) and m[tag].get("value") is not None:
                samples[key].append(m[tag]["value"])
    return {"samples": samples, "ttft_p50_ms": get("time_to_first_token", "p50"),
            "itl_p50_ms": get("inter_token_latency", "p50"),
            "output_tok_s": get("output_token_throughput"),
            "requests": get("request_count"), "duration_s": get("benchmark_duration"),
            "osl_mean": get("output_sequence_length"), "usage_completion_mean": get("usage_completion_tokens"),
            "isl_mean": get("input_sequence_length"), "usage_prompt_mean": get("usage_prompt_tokens"),
            "ttft_p90_ms": get("time_to_first_token", "p90"), "e2e_p50_ms": get("request_latency", "p50"),
            "errors": get("request_error_rate")}


def run_aiperf(aiperf: Path, url: str, model: str, trace: Path, out: Path, hf_cache: Path, args,
               seed: int) -> dict:
    cmd, env = aiperf_cmd(aiperf, url, model, trace, out, hf_cache, args, seed)
    info, sampler = _run(cmd, out.with_suffix(".log"), env, engine_pid=args.engine_pid)
    return {**info, **_window_cores(sampler, *aiperf_window(out)), **parse_aiperf(out)}


def parse_ours(out: Path) -> dict:
    s = json.loads((out / "summary.json").read_text())[0]
    recs = [json.loads(line) for line in open(out / "requests.jsonl")]
    ok = [r for r in recs if r["error"] is None]
    # ITL with AIPerf's end point (last content chunk) instead of our stream end, to size that gap.
    itl_last = [(r["chunk_times"][-1] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3
                for r in ok if r["chunk_times"] and r["output_tokens"] > 1]
    samples = {"ttft_ms": [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None],
               "itl_ms": [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3
                          for r in ok if r["ttft"] is not None and r["output_tokens"] > 1]}
    return {"samples": samples, "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3, "itl_p50_ms": s["itl_ms"]["p50"],
            "output_tok_s": s["output_tok_s"], "requests": s["requests_ok"], "duration_s": s["duration_s"],
            "osl_mean": s["output_tokens"] / max(1, s["requests_ok"]),
            "isl_mean": s["input_tokens"] / max(1, s["requests_ok"]),
            "ttft_p90_ms": s["ttft_s"]["p90"] * 1e3, "e2e_p50_ms": s["e2e_s"]["p50"] * 1e3,
            "itl_p50_ms_last_chunk": statistics.median(itl_last) if itl_last else None,
            "cached_token_ratio": s["cached_token_ratio"], "errors": s["requests_failed"]}


def run_ours(url: str, trace: Path, out: Path, args, seed: int) -> dict:
    """`agentserve bench --mode concurrency` as a subprocess (the sequential design)."""
    cmd = agentserve_cmd("bench", "--url", url, "--trace", str(trace), "--mode", "concurrency",
                         "--concurrency", str(args.concurrency), "--stage-duration", str(args.duration),
                         "--seed", str(seed), "--out", str(out), "--api", args.api,
                         *(["--tokenizer", args.bench_tokenizer] if args.bench_tokenizer else []))
    info, sampler = _run(cmd, out.with_suffix(".log"), dict(os.environ, COLUMNS="120"),
                         engine_pid=args.engine_pid)
    res = parse_ours(out)
    end = sampler.samples[-1][0] if sampler.samples else time.time()  # it exits right after its drain
    return {**info, **_window_cores(sampler, end - res["duration_s"], end), **res}


def _engine_busy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
            m = parse_prometheus(r.read().decode(), ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    except OSError:
        return False
    return sum(m.values()) > 0


def _aiperf_log_has(out: Path, text: str) -> bool:
    """Whether AIPerf's own log (artifact dir; its stdout is block-buffered when piped) has `text`."""
    for log in (out / "logs" / "aiperf.log", out.with_suffix(".log")):
        try:
            if text in log.read_text(errors="replace"):
                return True
        except OSError:
            pass
    return False


def _phase_gap(out: Path) -> float | None:
    """Seconds from AIPerf's "Initialized 1 phase" log line to its profiling phase start."""
    import datetime as dt

    stamps = {}
    try:
        for line in open(out / "logs" / "aiperf.log", errors="replace"):
            for key, text in (("init", "Initialized 1 phase"), ("start", "Phase profiling (profiling) started")):
                if text in line and key not in stamps:
                    stamps[key] = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f")
    except (OSError, ValueError):
        return None
    return (stamps["start"] - stamps["init"]).total_seconds() if len(stamps) == 2 else None


def run_overlapped(aiperf: Path, url: str, model: str, trace: Path, a_trace: Path, work: Path,
                   hf_cache: Path, args, r: int) -> tuple[dict, dict]:
    """Both tools at once, each at the same concurrency, over the same window of the engine's life.

    Whatever else the machine is doing then hits both tools alike. The tool whose first requests
    reach the idle engine first gets the first prefill step to itself, which lowers its TTFT for
    that first wave; so the lead alternates. Even rounds: AIPerf leads: our bench starts the
    moment its first requests show on the engine's /metrics. Odd rounds: ours leads: it starts
    after AIPerf logs "Initialized 1 phase(s)", by the gap from that line to AIPerf's profiling
    start seen in the round before less `--lead` (that gap was ~1.1 s idle, ~4 s at load 20: a
    fixed wait had ours lead by 3 s there). The ~1.1 s before its
    first request. Ours runs in this process through `run_bench`, the function behind
    `agentserve bench`, so it starts within milliseconds. Both stop issuing after --duration and
    drain, so the windows coincide to a few tenths of a second.
    """
    from agentserve.workload.replay import BenchConfig, run_bench

    a_out, o_out = work / f"aiperf-r{r}", work / f"agentserve-r{r}"
    a_log = a_out.with_suffix(".log")
    lead = "aiperf" if r % 2 == 0 else "agentserve"
    cmd, env = aiperf_cmd(aiperf, url, model, a_trace, a_out, hf_cache, args, r + 1)
    load0, cpu0, t0 = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    with open(a_log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        sampler = CpuSampler(proc.pid, args.engine_pid).__enter__()
        try:
            deadline = time.monotonic() + 180
            while not (_engine_busy(url) if lead == "aiperf" else _aiperf_log_has(a_out, "Initialized 1 phase")):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"AIPerf did not start profiling (exit {proc.poll()}); log {a_log}")
                time.sleep(0.01)
            if lead == "agentserve":
                time.sleep(max(0.0, args.phase_gap_s - args.lead))
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            o0, ours_wall0 = time.perf_counter(), time.time()
            run_bench(BenchConfig(url=url, trace=str(trace), mode="concurrency", concurrency=[args.concurrency],
                                  stage_duration=args.duration, seed=r + 1, out=str(o_out), model=model,
                                  api=args.api, tokenizer=args.bench_tokenizer, progress=False, plots=False))
            ru1, ours_wall1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
            ours_info = {"wall_s": time.perf_counter() - o0, "loadavg_1m": [load0, os.getloadavg()[0]],
                         "client_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)}
            rc = proc.wait(timeout=300)
        finally:
            sampler.__exit__(None, None, None)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0:
        raise RuntimeError(f"aiperf exited {rc}; log {a_log}")
    a_info = {"wall_s": time.perf_counter() - t0, "client_cpu_s": _children_cpu() - cpu0,
              "loadavg_1m": [load0, os.getloadavg()[0]]}
    starts = [json.loads(line)["metadata"]["request_start_ns"] for line in open(a_out / "profile_export.jsonl")]
    # > 0: our bench started after AIPerf's first request (AIPerf led), in seconds.
    ours_info["start_after_aiperf_s"] = ours_wall0 - min(starts) / 1e9 if starts else None
    ours_info["lead"] = lead
    args.phase_gap_s = _phase_gap(a_out) or args.phase_gap_s
    # Cores while measuring. Ours: its RUSAGE_SELF less the sampler thread's own CPU (roughly:
    # the thread ran over AIPerf's longer life, so this leans low only by its small share).
    window = ours_wall1 - ours_wall0
    ours_info.update(engine_cores=sampler.cores("engine", ours_wall0, ours_wall1),
                     client_cores=max(0.0, ours_info["client_cpu_s"] - sampler.own_cpu * window
                                      / max(window, a_info["wall_s"])) / window)
    a_info.update(_window_cores(sampler, *aiperf_window(a_out)))
    return {**ours_info, **parse_ours(o_out)}, {**a_info, **parse_aiperf(a_out)}


def run_overlapped_self(url: str, model: str, trace: Path, p_trace: Path, work: Path, args,
                        r: int) -> tuple[dict, dict]:
    """The control for run_overlapped: a second `agentserve bench` (a subprocess) in AIPerf's
    place, leading as AIPerf leads in even rounds (ours starts when its requests show on the
    engine). Two copies of one client should agree; what they do not is the design's own bias
    and noise, and what AIPerf adds beyond it is AIPerf's."""
    from agentserve.workload.replay import BenchConfig, run_bench

    p_out, o_out = work / f"peer-r{r}", work / f"agentserve-r{r}"
    cmd = agentserve_cmd("bench", "--url", url, "--trace", str(p_trace), "--mode", "concurrency",
                         "--concurrency", str(args.concurrency), "--stage-duration", str(args.duration),
                         "--seed", str(r + 101), "--out", str(p_out), "--api", args.api, "--model", model,
                         *(["--tokenizer", args.bench_tokenizer] if args.bench_tokenizer else []))
    load0 = os.getloadavg()[0]
    with open(p_out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, COLUMNS="120"))
        sampler = CpuSampler(proc.pid, args.engine_pid).__enter__()
        try:
            deadline = time.monotonic() + 120
            while not _engine_busy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the peer bench did not start (exit {proc.poll()}); log {log.name}")
                time.sleep(0.01)
            ru0, o0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.time()
            run_bench(BenchConfig(url=url, trace=str(trace), mode="concurrency", concurrency=[args.concurrency],
                                  stage_duration=args.duration, seed=r + 1, out=str(o_out), model=model,
                                  api=args.api, tokenizer=args.bench_tokenizer, progress=False, plots=False))
            ru1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
            rc = proc.wait(timeout=300)
        finally:
            sampler.__exit__(None, None, None)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0:
        raise RuntimeError(f"the peer bench exited {rc}; log {p_out.with_suffix('.log')}")
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    ours = {"wall_s": time.perf_counter() - o0, "loadavg_1m": [load0, os.getloadavg()[0]], "client_cpu_s": cpu,
            "lead": "peer", "engine_cores": sampler.cores("engine", w0, w1), "client_cores": cpu / (w1 - w0)}
    peer = {"wall_s": w1 - w0, "loadavg_1m": [load0, os.getloadavg()[0]],
            "client_cpu_s": (sampler.cores("client", w0, w1) or 0.0) * (w1 - w0),
            **_window_cores(sampler, w0, w1)}
    return {**ours, **parse_ours(o_out)}, {**peer, **parse_ours(p_out)}


class EngineTrace:
    """The engine's own view of each request (AGENTSERVE_STEP_TRACE's request trace: `recv`, the
    HTTP handler began; `first`, the first output reached its event loop), so each tool's TTFT
    splits into the engine's part and the client's (send to handler, event loop to read)."""

    def __init__(self, prefix: Path) -> None:
        self.prefix, self._seen = prefix, 0

    def _lines(self) -> list[dict]:
        out = []
        for f in sorted(self.prefix.parent.glob(self.prefix.name + "-requests.*.jsonl")):
            out += [json.loads(line) for line in open(f) if line.strip()]
        return out

    def take(self) -> dict[str, float]:
        """Engine-side TTFT (s) of the requests traced since the last call, by client request id
        (the engine's id is `chatcmpl-<X-Request-Id>-<8 hex>` / `cmpl-...`)."""
        lines = self._lines()
        new, self._seen = lines[self._seen:], len(lines)
        out = {}
        for x in new:
            if "api" in x and "first" in x and "recv" in x:
                rid = x["api"].split("-", 1)[1].rsplit("-", 1)[0]
                out[rid] = x["first"] - x["recv"]
        return out


def split_ttft(res: dict, engine_ttft: dict[str, float], ids: dict[str, float]) -> None:
    """Add the engine-side TTFT p50 and the client's share (client TTFT - engine TTFT) p50."""
    both = [(ids[k], engine_ttft[k]) for k in ids if k in engine_ttft]
    res["traced"] = len(both)
    if both:
        res["engine_ttft_p50_ms"] = statistics.median(e for _, e in both) * 1e3
        res["client_share_p50_ms"] = statistics.median(c - e for c, e in both) * 1e3


def client_ttfts(tool: str, out: Path) -> dict[str, float]:
    """Client TTFT (s) by the X-Request-Id each tool sent."""
    if tool == "aiperf":
        rows = [json.loads(line) for line in open(out / "profile_export.jsonl")]
        return {r["metadata"]["x_request_id"]: r["metrics"]["time_to_first_token"]["value"] / 1e3
                for r in rows if "time_to_first_token" in r.get("metrics", {})}
    recs = [json.loads(line) for line in open(out / "requests.jsonl")]
    return {r["request_id"]: r["ttft"] for r in recs if r["ttft"] is not None}


def serve_stub(port: int, ttft: float, itl: float) -> None:
    """A vLLM-shaped streaming server with fixed timing, so a TTFT gap between the tools is
    theirs alone (no engine, no batching): each stream opens with a role-only chat delta
    (`content: ""`) or an empty completion text AT ONCE, then the first token after `ttft`
    seconds, one token per `itl`, a usage chunk and `[DONE]`. A tool that started its clock
    on the opening chunk would report a TTFT near 0 instead of `ttft`."""
    from aiohttp import web

    running = 0

    async def complete(request: web.Request) -> web.StreamResponse:
        nonlocal running
        body = await request.json()
        chat = "messages" in body
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish: str | None = None, role: bool = False) -> bytes:
            choice = ({"index": 0, "delta": {"role": "assistant", "content": text} if role else {"content": text}}
                      if chat else {"index": 0, "text": text})
            choice["finish_reason"] = finish
            return b"data: " + json.dumps({"id": "x", "object": obj, "model": "stub",
                                           "choices": [choice]}).encode() + b"\n\n"

        running += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(chunk("", role=True))
            await asyncio.sleep(ttft)
            for k in range(n):
                await resp.write(chunk(f" t{k}", "length" if k == n - 1 else None))
                if k < n - 1:
                    await asyncio.sleep(itl)
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            await resp.write(b"data: " + json.dumps({"id": "x", "object": obj, "model": "stub", "choices": [],
                                                     "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            running -= 1

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", lambda _: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def chat_overhead(url: str, model: str) -> int:
    """Tokens the served chat template adds around one user message (its roles, any default
    system prompt): the prompt_tokens of a chat whose message is empty."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": ""}], "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return int(json.loads(r.read())["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", choices=("completions", "chat"), default="completions",
                    help="endpoint both tools stream from (chat: ~540-token prompts by default)")
    ap.add_argument("--target", choices=("engine", "stub"), default="engine",
                    help="engine: our engine on the tiny model; stub: a fixed-timing server "
                         "(--stub-ttft, --stub-itl), which isolates the tools' clocks from any engine")
    ap.add_argument("--stub-ttft", type=float, default=0.3)
    ap.add_argument("--stub-itl", type=float, default=0.02)
    ap.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)  # internal: the stub
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds per run (both tools)")
    ap.add_argument("--design", choices=("overlap", "sequential"), default="overlap",
                    help="overlap: both tools at once over the same window (default; cancels machine "
                         "noise); sequential: one after the other, ABBA order")
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds (overlap: the lead alternates, so use an even number); medians over rounds")
    ap.add_argument("--lead", type=float, default=0.2,
                    help="overlap, odd rounds: ours leads AIPerf's first request by about this (s)")
    ap.add_argument("--requests", type=int, default=1000, help="trace length (no tool wraps around)")
    ap.add_argument("--isl", default=None, help="input length range MIN,MAX (completions 256,512; chat 508,572: "
                                                "served tokens, chat template included)")
    ap.add_argument("--osl", default="48,80", help="output length range MIN,MAX")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--client-token-count", action="store_true",
                    help="let AIPerf count output tokens with its tokenizer (shows the ~12%% skew)")
    ap.add_argument("--peer", choices=("aiperf", "agentserve"), default="aiperf",
                    help="agentserve: the control, a second copy of our bench in AIPerf's place "
                         "(overlap design; results land in the 'aiperf' slot, labelled)")
    ap.add_argument("--engine-trace", action="store_true",
                    help="engine: turn its request trace on and split each tool's TTFT into the "
                         "engine's part and the client's")
    ap.add_argument("--work-dir", default=None, help="keep traces and both tools' outputs here")
    ap.add_argument("--out", default="bench-out/aiperf_crosscheck.json")
    args = ap.parse_args()
    if args.serve_stub is not None:
        serve_stub(args.serve_stub, args.stub_ttft, args.stub_itl)
        return
    args.isl = args.isl or ("508,572" if args.api == "chat" else "256,512")
    isl = tuple(int(x) for x in args.isl.split(","))
    osl = tuple(int(x) for x in args.osl.split(","))
    from agentserve.cluster.procs import free_port, start_process
    from agentserve.engine.model.tiny import default_model_dir

    aiperf = ensure_aiperf()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="aiperf-crosscheck-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = default_model_dir()
    hf_cache = hf_cache_with_tokenizer(model_dir, work / "hf-cache")
    # The stub has no /tokenize: our bench sizes chat prompts with the tiny tokenizer itself.
    args.bench_tokenizer = str(model_dir) if args.target == "stub" and args.api == "chat" else None
    if args.target == "stub":
        port = free_port()
        server = start_process("stub", [sys.executable, __file__, "--serve-stub", str(port), "--stub-ttft",
                                        str(args.stub_ttft), "--stub-itl", str(args.stub_itl)],
                               work / "logs" / "stub.log", url=f"http://127.0.0.1:{port}")
    else:
        engine_args = ["--model", str(model_dir), "--kv-cache-tokens", "65536", "--max-num-batched-tokens", "4096"]
        trace_env = {"AGENTSERVE_STEP_TRACE": str(work / "logs" / "trace")} if args.engine_trace else None
        server = start_engine(work / "logs", extra=engine_args, name="agentserve", env=trace_env)
    etrace = EngineTrace(work / "logs" / "trace") if args.engine_trace and args.target == "engine" else None
    args.engine_pid = server.pid
    args.phase_gap_s = 1.1  # until a round has measured it (see run_overlapped)
    runs: dict[str, list[dict]] = {"agentserve": [], "aiperf": []}
    try:
        server.wait_healthy(300)
        url = server.url
        model = asyncio.run(model_id(url))
        # Chat: AIPerf's trace asks for the content's tokens (it sizes the message text with
        # its tokenizer and the server's template adds its own), ours for the served total
        # (bench fits the content to the template). Same requests on the wire: AIPerf's input
        # lengths are ours minus the template's tokens; the served means are in the result.
        overhead = chat_overhead(url, model) if args.api == "chat" and args.target == "engine" else 0
        args.aiperf_input_offset = -overhead
        if args.target == "engine":  # warm it (first-request costs): no tool pays for them
            asyncio.run(fire(url, model, random_prompts(args.concurrency, 384, seed=7), 16))
        for r in range(args.rounds):
            trace, a_trace = work / f"trace-r{r}.jsonl", work / f"trace-r{r}-aiperf.jsonl"
            write_trace(trace, args.requests, isl, osl, seed=r, id_base=(r + 1) * 1_000_000)
            write_trace(a_trace, args.requests, isl, osl, seed=r, id_base=(r + 1) * 1_000_000 + 500_000,
                        input_offset=-overhead if args.peer == "aiperf" else 0)
            if args.peer == "agentserve":
                Console().print(f"round {r}: agentserve and a second agentserve together (control)")
                ours, theirs = run_overlapped_self(url, model, trace, a_trace, work, args, r)
                runs["agentserve"].append(ours)
                runs["aiperf"].append(theirs)
                continue
            if args.design == "overlap":
                Console().print(f"round {r}: AIPerf and agentserve together ({args.duration:g} s, "
                                f"concurrency {args.concurrency} each, {args.api}, {args.target})")
                ours, theirs = run_overlapped(aiperf, url, model, trace, a_trace, work, hf_cache, args, r)
                if etrace is not None:
                    seen = etrace.take()
                    split_ttft(ours, seen, client_ttfts("agentserve", work / f"agentserve-r{r}"))
                    split_ttft(theirs, seen, client_ttfts("aiperf", work / f"aiperf-r{r}"))
                runs["agentserve"].append(ours)
                runs["aiperf"].append(theirs)
                continue
            order = ["aiperf", "agentserve"] if r % 2 == 0 else ["agentserve", "aiperf"]
            for tool in order:
                Console().print(f"round {r}: {tool} ({args.duration:g} s at concurrency {args.concurrency})")
                if tool == "aiperf":
                    res = run_aiperf(aiperf, url, model, a_trace, work / f"aiperf-r{r}", hf_cache, args, r + 1)
                else:
                    res = run_ours(url, trace, work / f"agentserve-r{r}", args, r + 1)
                if etrace is not None:
                    split_ttft(res, etrace.take(), client_ttfts(tool, work / f"{tool}-r{r}"))
                runs[tool].append(res)
    finally:
        server.stop()
    result = summarize(runs, args, work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _print(result)
    Console().print(f"wrote {args.out}; raw outputs in {work}")
    sys.exit(0 if result["pass"] else 1)


def pooled_ratio_ci(ours: list[float], theirs: list[float], n: int = 2000, seed: int = 0) -> dict:
    """Ratio of pooled medians (ours / AIPerf's per-request values) and its bootstrap 90% interval.

    TTFT in a closed loop is wide and clumpy (a request that lands behind a wave of prefills waits
    seconds), so the p50 of ~50 requests moves by 20% between identical runs; the interval says
    whether a gap is more than that sampling noise.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(ours), np.asarray(theirs)
    if not a.size or not b.size:
        return {"ratio": None, "ci90": [None, None], "n": [int(a.size), int(b.size)]}
    ra = np.median(rng.choice(a, (n, a.size)), axis=1)
    rb = np.median(rng.choice(b, (n, b.size)), axis=1)
    lo, hi = np.percentile(ra / rb, [5, 95])
    return {"ratio": float(np.median(a) / np.median(b)), "ci90": [float(lo), float(hi)],
            "n": [int(a.size), int(b.size)]}


def summarize(runs: dict[str, list[dict]], args, work: Path) -> dict:
    med = {tool: {k: statistics.median(x[k] for x in rs) for k, _ in METRICS} for tool, rs in runs.items()}
    pooled = {k: pooled_ratio_ci([v for x in runs["agentserve"] for v in x["samples"][k]],
                                 [v for x in runs["aiperf"] for v in x["samples"][k]])
              for k in ("ttft_ms", "itl_ms")}
    compare = {}
    for k, _ in METRICS:
        ratio = med["agentserve"][k] / med["aiperf"][k]
        # Per round: the two runs of a round are adjacent in time, so their ratio shows drift less.
        paired = [a[k] / b[k] for a, b in zip(runs["agentserve"], runs["aiperf"])]
        ok = abs(ratio - 1) <= args.tolerance
        pool = pooled.get(k.replace("_p50", ""))
        # Outside the band but the pooled interval holds 1: sampling noise, not a measurement gap.
        noise = bool(not ok and pool and pool["ci90"][0] is not None and pool["ci90"][0] <= 1 <= pool["ci90"][1])
        compare[k] = {"agentserve": med["agentserve"][k], "aiperf": med["aiperf"][k], "ratio": ratio,
                      "round_ratios": paired, "pooled": pool,
                      "verdict": "pass" if ok else ("inconclusive" if noise else "fail"), "pass": ok}
    for rs in runs.values():  # per-request samples stay in the work dir's raw files, not the summary
        for x in rs:
            x.pop("samples", None)
    # The prompts both tools had served (usage.prompt_tokens; AIPerf's own count when it has none).
    served = {tool: statistics.median((x.get("usage_prompt_mean") or x["isl_mean"]) for x in rs)
              for tool, rs in runs.items()}
    cores = {tool: {k: (statistics.median(v) if (v := [x[k] for x in rs if x.get(k) is not None]) else None)
                    for k in ("client_cores", "engine_cores")} for tool, rs in runs.items()}
    split = {tool: {k: (statistics.median(v) if (v := [x[k] for x in rs if x.get(k) is not None]) else None)
                    for k in ("engine_ttft_p50_ms", "client_share_p50_ms")} for tool, rs in runs.items()}
    verdicts = {c["verdict"] for c in compare.values()}
    target = ("our engine, tiny fp32 model" if args.target == "engine" else
              f"fixed-timing stub (TTFT {args.stub_ttft:g} s, ITL {args.stub_itl:g} s)")
    return {"machine": f"2-core CPU (shared sandbox), {target}",
            "config": {"api": args.api, "target": args.target, "peer": args.peer, "stub_ttft_s": args.stub_ttft if args.target == "stub" else None,
                       "stub_itl_s": args.stub_itl if args.target == "stub" else None,
                       "aiperf_input_offset": args.aiperf_input_offset,
                       "design": args.design, "concurrency": args.concurrency, "duration_s": args.duration, "rounds": args.rounds,
                       "isl": args.isl, "osl": args.osl, "trace_requests": args.requests,
                       "aiperf_token_count": "client tokenizer" if args.client_token_count else "server usage",
                       "tolerance": args.tolerance, "work_dir": str(work)},
            "served_input_mean": served, "cores_while_measuring": cores, "ttft_split": split, "compare": compare, "runs": runs, "pass": all(c["pass"] for c in compare.values()),
            "verdict": "fail" if "fail" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "pass")}


def _cores(x: dict) -> str:
    """Cores the client and the engine used while this tool measured."""
    f = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731
    return f"while measuring: client {f(x.get('client_cores'))} cores, engine {f(x.get('engine_cores'))}"


def _split(x: dict) -> str:
    if x.get("engine_ttft_p50_ms") is None:
        return ""
    return (f", TTFT p50 at the engine {x['engine_ttft_p50_ms']:.0f} ms + client share p50 "
            f"{x['client_share_p50_ms']:.1f} ms ({x['traced']} traced)")


def _console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=140)  # logs keep the table whole


def _print(result: dict) -> None:
    runs = result["runs"]
    tol = f"±{result['config']['tolerance']:.0%}"
    peer = "AIPerf" if result["config"].get("peer", "aiperf") == "aiperf" else "agentserve #2"
    t = Table(title=f"agentserve bench vs AIPerf 0.13.0 ({result['config']['api']}, {result['machine']}, "
                    f"{result['config']['design']}, concurrency "
                    f"{result['config']['concurrency']} per tool, "
                    f"{result['config']['duration_s']:g} s runs, median of {result['config']['rounds']} rounds)")
    for col in ("metric", "agentserve", peer, "ratio", tol, "agentserve runs", f"{peer} runs",
                "ratio per round", "pooled ratio [90% CI]"):
        t.add_column(col, justify="right")
    for k, name in METRICS:
        c = result["compare"][k]
        p = c.get("pooled")
        pooled = (f"{p['ratio']:.3f} [{p['ci90'][0]:.2f}, {p['ci90'][1]:.2f}]"
                  if p and p["ratio"] is not None else "-")
        mark = {"pass": "[green]pass[/]", "inconclusive": "[yellow]noise[/]", "fail": "[red]FAIL[/]"}[c["verdict"]]
        t.add_row(name, f"{c['agentserve']:.1f}", f"{c['aiperf']:.1f}", f"{c['ratio']:.3f}", mark,
                  " ".join(f"{x[k]:.1f}" for x in runs["agentserve"]),
                  " ".join(f"{x[k]:.1f}" for x in runs["aiperf"]),
                  " ".join(f"{x:.3f}" for x in c["round_ratios"]), pooled)
    _console().print(t)
    for tool, rs in runs.items():
        for i, x in enumerate(rs):
            led = f", started {x['start_after_aiperf_s']:+.2f} s after AIPerf" if "start_after_aiperf_s" in x else ""
            served = x.get("usage_prompt_mean") or x["isl_mean"]  # AIPerf: the server's count
            _console().print(f"  {tool} r{i}: {x['requests']:.0f} req in {x['duration_s']:.1f} s{led}, mean in "
                            f"(served)/out {served:.0f}/{x['osl_mean']:.1f} tok, {_cores(x)}{_split(x)}, client CPU {x['client_cpu_s']:.1f} s "
                            f"over {x['wall_s']:.0f} s, load avg {x['loadavg_1m'][0]:.1f}->{x['loadavg_1m'][1]:.1f}")
    v = result["verdict"]
    _console().print("verdict: " + {"pass": "[green]PASS[/]", "fail": "[red]FAIL[/]",
                                     "inconclusive": "[yellow]INCONCLUSIVE[/]"}[v]
                     + f" (pass: all three within ±{result['config']['tolerance']:.0%}; inconclusive: a metric "
                       "is outside but its pooled 90% interval holds 1.0, so rerun with more --rounds or "
                       "a longer --duration)")


if __name__ == "__main__":
    main()
