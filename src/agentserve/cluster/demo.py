"""`agentserve demo`: the main job on the embedded tiny model, CPU only, no network.

Starts a local prefill/decode cluster with `agentserve.cluster.launch` (the same code as
`agentserve up --topology 1P1D`: one prefill engine, one decode engine and the router,
each its own process, logs in a temporary folder), replays bundled agent sessions (a few
Claude Code sessions from the Weka sample, tokens scaled down so a 2-core CPU finishes
in about a minute) through the router with `agentserve bench --mode sessions`, stops
the cluster (no processes left), and prints the per-turn table of the first session
(prefix cache at work), a two-turn conversation in Claude Code's and Codex's APIs
(/v1/messages, /v1/responses) with what its second turn read from the cache, the P/D split (requests whose uncached prompt on the decode
engine reached the router's threshold were prefilled on the prefill engine and their KV
pulled; mostly cached turns stay on the decode engine), the summary and the report path.
"""

from __future__ import annotations

import json
import re
import tempfile
import urllib.request
from importlib import resources
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def bundled_trace() -> Path:
    return Path(str(resources.files("agentserve") / "data" / "traces" / "weka-cc-mini.jsonl"))


def demo(
    out: Path = typer.Option(Path("out/demo"), help="Where the report goes."),
    sessions: int = typer.Option(2, help="Bundled sessions to replay at once."),
    max_turns: int = typer.Option(6, help="Main-agent turns per session."),
    token_scale: int = typer.Option(4, help="Tokens per trace block (64 -> K)."),
    topology: str = typer.Option("1P1D", help="`agentserve up` topology to run the replay on."),
    model: str = typer.Option("tiny", help="Engines' model: `tiny` (the built-in random model), "
                              "a folder, a .gguf or a preset such as `smollm2-135m`."),
) -> None:
    """Start a 1P1D cluster (prefill + decode engines + router) on the tiny model and
    replay bundled agent sessions through the router."""
    from agentserve.cluster.launch import Cluster, parse_topology, status_table
    from agentserve.cluster.procs import free_port
    from agentserve.workload.replay import BenchConfig, run_bench

    console = Console()
    run_dir = Path(tempfile.mkdtemp(prefix="agentserve-demo-"))
    topo = parse_topology(topology)
    name = "the built-in tiny model" if model == "tiny" else model
    console.print(f"[bold]agentserve demo[/]: `agentserve up --topology {topology}` on "
                  f"{name} (CPU): {len(topo.roles)} engines + router, logs in {run_dir}...")
    cluster = Cluster(run_dir, port=free_port(), model=None if model == "tiny" else model,
                      engine_args=["--kv-cache-tokens", "32768"])
    try:
        cluster.start(topo, health_timeout=180)
        console.print(status_table(cluster))
        url = cluster.state()["router"]
        cfg = BenchConfig(url=url, trace=str(bundled_trace()), mode="sessions", sessions=sessions,
                          max_turns=max_turns, token_scale=token_scale, gap_cap=0.5, max_output=32,
                          out=str(out))
        stages = run_bench(cfg)
        agents = _agent_apis(url)
        pd = _pd_summary(url, [s.url for s, _ in cluster.engines if s.role in ("decode", "both")])
    finally:
        cluster.stop()
    console.print("cluster stopped")
    _turn_table(console, out / "requests.jsonl")
    console.print(f"\nreport: [bold]{(out / 'report.html').resolve()}[/]  summary: {out / 'summary.json'}")
    s = stages[0]
    console.print(f"requests ok {s['requests_ok']} failed {s['requests_failed']}, cached/input "
                  f"{s['cached_token_ratio']:.1%}, captured reuse {s['captured_reuse']:.1%}")
    if pd:
        console.print(pd)
        # vLLM's convention, which we follow: KV pulled from the prefill engine counts as
        # cached on the decode engine, so a turn's first prefill shows up as cached too.
        console.print("(cached tokens include KV pulled from the prefill engine, as vLLM reports "
                      "them; captured reuse counts a request's cached tokens up to its reusable ones)")
    console.print(agents)
    if s["requests_failed"] or agents.startswith("agent APIs failed"):
        # a demo that lost requests failed, whatever else it shows
        console.print(f"[bold red]requests failed[/] ({s['requests_failed']} of the replay): see "
                      f"the errors in {out / 'requests.jsonl'} and the engine logs in {run_dir}")
        raise typer.Exit(1)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _agent_apis(router: str) -> str:
    """Two turns of a conversation in Claude Code's API (/v1/messages) and in Codex's
    (/v1/responses) through the router: one line saying what the second turn read from
    the prefix cache."""
    system = "You are a coding agent in a large repository. " * 30
    try:
        msgs: list[dict] = []
        reads = []
        for turn in range(2):
            msgs.append({"role": "user", "content": f"turn {turn}: fix the failing test"})
            m = _post(router + "/v1/messages", {
                "max_tokens": 8, "system": system, "messages": msgs, "temperature": 0,
                "metadata": {"user_id": "demo_session_claude"}})
            msgs.append({"role": "assistant", "content": m["content"]})
            u = m["usage"]
        reads.append(f"Claude Code's /v1/messages: turn 2 read {u['cache_read_input_tokens']} of "
                     f"{u['input_tokens'] + u['cache_read_input_tokens']} prompt tokens from cache")
        items: list[dict] = []
        for turn in range(2):
            items.append({"role": "user", "content": f"turn {turn}: run the tests"})
            r = _post(router + "/v1/responses", {
                "max_output_tokens": 8, "instructions": system, "input": items, "temperature": 0,
                "prompt_cache_key": "demo_session_codex"})
            items += r["output"]
            u = r["usage"]
        reads.append(f"Codex's /v1/responses: {u['input_tokens_details']['cached_tokens']} of "
                     f"{u['input_tokens']}")
    except (OSError, KeyError, ValueError) as e:
        return f"agent APIs failed: {e!r}"
    return "agent APIs through the router: " + "; ".join(reads)


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
