"""`agentserve report DIR [DIR ...]`: the HTML report of one run, or several compared.

One folder: DIR/report.html (what bench and sim write at the end of a run, redrawn from the
folder's files). Several: a comparison on the same axes with each run's deltas against the
first, into DIR1/compare.html. `--out FILE` writes elsewhere; `--screenshot PNG` opens the page
in headless Chromium (report_browser.py) and saves what it shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def report(
    dirs: list[Path] = typer.Argument(..., help="bench or sim output folders (summary.json, requests.jsonl)"),
    out: Optional[Path] = typer.Option(None, "--out", help="HTML file to write (default: DIR/report.html for "
                                                            "one folder, DIR1/compare.html for several)"),
    screenshot: Optional[Path] = typer.Option(None, "--screenshot",
                                              help="also open the page in headless Chromium and save a PNG"),
) -> None:
    """Render the HTML report of a run, or compare runs (deltas against the first)."""
    from agentserve.workload.report_data import load_run, run_names
    from agentserve.workload.report_html import write_report

    try:
        runs = [load_run(d, n) for d, n in zip(dirs, run_names(dirs))]
    except (ValueError, OSError) as e:
        typer.echo(f"report: {e}", err=True)
        raise typer.Exit(2)
    path = out or dirs[0] / ("report.html" if len(dirs) == 1 else "compare.html")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_report(path, runs)
    except OSError as e:
        typer.echo(f"report: cannot write {path}: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {path}")
    if screenshot is not None:
        from agentserve.workload.report_browser import check_page

        try:
            seen = check_page(path)
            screenshot.write_bytes(seen.png)
        except (RuntimeError, OSError) as e:
            typer.echo(f"report: screenshot: {e}", err=True)
            raise typer.Exit(2)
        for err in seen.errors:
            typer.echo(f"report: the browser reported {err}", err=True)
        typer.echo(f"wrote {screenshot} ({seen.size[0]}x{seen.size[1]} px, {seen.images} plots"
                   + (f", {seen.broken_images} not drawn" if seen.broken_images else "") + ")")


def register_report(app: typer.Typer) -> None:
    app.command("report")(report)
