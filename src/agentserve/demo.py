"""`agentserve demo`: the main job on the embedded tiny model, CPU only, no network.

Starts an engine, replays bundled agent sessions (a few Claude Code sessions from
the Weka sample, tokens scaled down so a 2-core CPU finishes in about a minute)
with `agentserve bench --mode sessions`, and prints the per-turn table of the
first session (prefix cache at work) plus the summary and the report's path.
"""

from __future__ import annotations

import json
import tempfile
from importlib import resources
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def bundled_trace() -> Path:
    return Path(str(resources.files("agentserve") / "data" / "traces" / "weka-cc-mini.jsonl"))


def demo(
    out: Path = typer.Option(Path("out/demo"), help="Where the report goes."),
    sessions: int = typer.Option(3, help="Bundled sessions to replay at once."),
    max_turns: int = typer.Option(8, help="Main-agent turns per session."),
    token_scale: int = typer.Option(4, help="Tokens per trace block (64 -> K)."),
) -> None:
    """Serve the tiny model and replay bundled agent sessions against it."""
    from agentserve.procs import start_engine
    from agentserve.workload.replay import BenchConfig, run_bench

    console = Console()
    logs = Path(tempfile.mkdtemp(prefix="agentserve-demo-"))
    console.print("[bold]agentserve demo[/]: starting the engine on the built-in tiny model (CPU)...")
    engine = start_engine(logs, extra=["--kv-cache-tokens", "32768"])
    try:
        engine.wait_healthy(180)
        console.print(f"engine up at {engine.url} (log {engine.log_path})")
        cfg = BenchConfig(url=engine.url, trace=str(bundled_trace()), mode="sessions", sessions=sessions,
                          max_turns=max_turns, token_scale=token_scale, gap_cap=0.5, max_output=32,
                          out=str(out))
        stages = run_bench(cfg)
    finally:
        engine.stop()
    _turn_table(console, out / "requests.jsonl")
    console.print(f"\nreport: [bold]{(out / 'report.html').resolve()}[/]  summary: {out / 'summary.json'}")
    s = stages[0]
    console.print(f"requests ok {s['requests_ok']} failed {s['requests_failed']}, cached/input "
                  f"{s['cached_token_ratio']:.1%}, captured reuse {s['captured_reuse']:.1%}")


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
