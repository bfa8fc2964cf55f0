"""`agentserve trace ...`: stats, synth and convert for agentic traces.

Heavy imports (numpy, loaders) stay inside the commands so `agentserve --help` is instant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from agentserve.cli_checks import check_flags, fail

trace_app = typer.Typer(help="Agentic traces: measure (stats), generate (synth), convert.",
                        no_args_is_help=True, add_completion=False)


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if unit == "s":
        return f"{x / 60:.1f} min" if x >= 120 else f"{x:.1f} s"
    return f"{x / 1000:,.0f}K" if abs(x) >= 10_000 else f"{x:,.0f}"


def _table(stats: dict, source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{source}: {stats['traces']} sessions, {stats['main_requests']:,} main-agent "
                    f"+ {stats['subagent_requests']:,} sub-agent requests")
    for col in ("main-agent metric", "p50", "p90", "p99"):
        t.add_column(col, justify="left" if col.startswith("main") else "right")
    rows = [("input tokens per request", "input_p50_p90_p99", ""),
            ("output tokens per response", "output_p50_p90_p99", ""),
            ("input growth from previous turn", "growth_p50_p90_p99", ""),
            ("idle gap between turns", "gap_s_p50_p90_p99", "s"),
            ("turns per session", "turns_p50_p90_p99", "")]
    for label, key, unit in rows:
        vals = stats[key] or [None] * 3
        t.add_row(label, *(_fmt(v, unit) for v in vals))
    con = Console()
    con.print(t)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    g = stats["subagent_group_size_p50_p90"] or [None, None]
    con.print(f"turns reusing >=90% of input: {pct(stats['share_turns_reuse_ge_90pct'])}; "
              f"median reuse {pct(stats['median_reuse'])}\n"
              f"prefix resets: {pct(stats['prefix_reset_share'])}; "
              f"compactions: {pct(stats['compaction_share'])}\n"
              f"sub-agent groups: {stats['subagent_groups']}, size p50 {_fmt(g[0])} p90 {_fmt(g[1])}")


@trace_app.command()
def stats(file: Path = typer.Argument(..., help="Weka or mooncake trace (file or folder)"),
          as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
          block_size: int = typer.Option(512, help="block size of mooncake hash_ids"),
          skip_bad: bool = typer.Option(False, "--skip-bad", help="skip malformed lines")) -> None:
    """SPEC-table statistics of a trace (definitions: agentserve.workload.stats)."""
    from agentserve.workload.stats import compute_stats
    from agentserve.workload.traces import TraceFormatError, load_any

    check_flags(block_size=(block_size, 1))
    try:
        res = load_any(file, block_size=block_size, skip_bad=skip_bad)
    except (TraceFormatError, FileNotFoundError) as e:
        fail(str(e))
    if res.skipped:
        typer.echo(f"skipped {res.skipped} malformed line(s); first: {res.errors[0]}", err=True)
    out = compute_stats(res.sessions)
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        _table(out, file.name)


@trace_app.command()
def synth(profile: str = typer.Option("claude-code", help="claude-code | sweep"),
          sessions: int = typer.Option(219, help="number of sessions"),
          seed: int = typer.Option(0, help="random seed (same seed, same file)"),
          out: Path = typer.Option(..., help="output Weka JSONL (.gz to compress)"),
          max_input: int = typer.Option(None, help="end sessions before inputs above this")) -> None:
    """Generate production-shaped sessions in the Weka format (block size 64)."""
    from agentserve.workload.synth import PROFILES, synthesize
    from agentserve.workload.traces import write_sessions

    if profile not in PROFILES:
        fail(f"unknown profile {profile!r}; choose one of: {', '.join(PROFILES)}")
    check_flags(sessions=(sessions, 1), max_input=(max_input, 1))
    t0 = time.perf_counter()
    corpus = synthesize(profile, sessions, seed, max_input)
    try:
        write_sessions(corpus, out)
    except OSError as e:
        fail(f"cannot write {out}: {e}")
    typer.echo(f"wrote {len(corpus)} sessions to {out} in {time.perf_counter() - t0:.1f} s",
               err=True)


@trace_app.command()
def convert(src: Path = typer.Argument(..., help="input trace (Weka or mooncake, detected)"),
            dst: Path = typer.Argument(..., help="output file (.gz to compress)"),
            to: str = typer.Option("mooncake", help="weka | mooncake"),
            block_size: int = typer.Option(512, help="mooncake block size (input or output)"),
            skip_bad: bool = typer.Option(False, "--skip-bad", help="skip malformed lines")) -> None:
    """Convert between the Weka session format and AIPerf mooncake_trace JSONL."""
    from agentserve.workload.traces import (TraceFormatError, load_any, write_mooncake,
                                            write_sessions)

    if to not in ("weka", "mooncake"):
        fail("--to must be weka or mooncake")
    check_flags(block_size=(block_size, 1))
    try:
        res = load_any(src, block_size=block_size, skip_bad=skip_bad)
    except (TraceFormatError, FileNotFoundError) as e:
        fail(str(e))
    try:
        if to == "weka":
            write_sessions(res.sessions, dst)
        else:
            write_mooncake(res.sessions, dst, block_size=block_size)
    except OSError as e:
        fail(f"cannot write {dst}: {e}")
    typer.echo(f"wrote {len(res.sessions)} sessions to {dst} ({to}); skipped {res.skipped}",
               err=True)
