"""`agentserve demo`: the main job on the embedded tiny model, CPU only, no network.

Starts a local prefill/decode cluster with `agentserve.launch` (the same code as
`agentserve up --topology 1P1D`: one prefill engine, one decode engine and the router,
each its own process, logs in a temporary folder), replays bundled agent sessions (a few
Claude Code sessions from the Weka sample, tokens scaled down so a 2-core CPU finishes
in about a minute) through the router with `agentserve bench --mode sessions`, stops
the cluster (no processes left), and prints the per-turn table of the first session
(prefix cache at work), the P/D split (requests whose uncached prompt on the decode
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
) -> None:
    """Start a 1P1D cluster (prefill + decode engines + router) on the tiny model and
    replay bundled agent sessions through the router."""
    from agentserve.launch import Cluster, parse_topology, status_table
    from agentserve.procs import free_port
    from agentserve.workload.replay import BenchConfig, run_bench

    console = Console()
    run_dir = Path(tempfile.mkdtemp(prefix="agentserve-demo-"))
    topo = parse_topology(topology)
    console.print(f"[bold]agentserve demo[/]: `agentserve up --topology {topology}` on the built-in "
                  f"tiny model (CPU): {len(topo.roles)} engines + router, logs in {run_dir}...")
    cluster = Cluster(run_dir, port=free_port(), engine_args=["--kv-cache-tokens", "32768"])
    try:
        cluster.start(topo, health_timeout=180)
        console.print(status_table(cluster))
        url = cluster.state()["router"]
        cfg = BenchConfig(url=url, trace=str(bundled_trace()), mode="sessions", sessions=sessions,
                          max_turns=max_turns, token_scale=token_scale, gap_cap=0.5, max_output=32,
                          out=str(out))
        stages = run_bench(cfg)
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
                      "them; captured reuse can therefore exceed 100%)")
    if s["requests_failed"]:  # a demo that lost requests failed, whatever else it shows
        console.print(f"[bold red]{s['requests_failed']} requests failed[/]: see the errors in "
                      f"{out / 'requests.jsonl'} and the engine logs in {run_dir}")
        raise typer.Exit(1)


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
