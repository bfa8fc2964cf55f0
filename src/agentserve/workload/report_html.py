"""report.html: one self-contained page (plots embedded as base64 PNGs, no script) for one run,
or a comparison of several on the same axes with a table of deltas against the first.

Order on the page: what ran (command, target, versions, machine), the stage table (or the
deltas), latency and throughput plots, the per-turn table and agent views, the P/D split
when the run has one, errors, and the definitions the figures use.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from agentserve.workload.report_data import Plot, Run, delta_rows, error_rows, stage_label, turn_rows

CSS = ("body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:1200px}"
       "h1{font-size:1.5em;margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}"
       "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
       "text-align:right;font-size:.9em}th{text-align:left;background:#f6f6f6}"
       "td.l{text-align:left}code{background:#f3f3f3;padding:1px 4px;word-break:break-all}"
       "figure{display:inline-block;vertical-align:top;margin:.6em 1.5em .6em 0;width:560px}"
       "figure.wide{display:block;width:auto;max-width:900px}img{width:100%}"
       "figcaption{font-size:.85em;color:#444}"
       ".better{color:#1a7f37}.worse{color:#c62828}.note{color:#555;font-size:.9em}")

INFO_FIELDS = (("producer", "producer"), ("URL", "url"), ("model", "model"), ("API", "api"),
               ("trace", "trace"), ("mode", "mode"), ("date", "date"), ("command", "command"))

DEFINITIONS = (
    "TTFT: seconds from handing the request to the connection to the first streamed token.",
    "ITL (tables): AIPerf's per-request (E2E - TTFT) / (output tokens - 1); the ITL CDF is token-weighted.",
    "cached / input: prompt tokens the server reported as served from its prefix cache, over prompt tokens; "
    "computed = input - cached.",
    "reusable ceiling: what an infinite cache could have served, given the order requests were sent.",
)


def fmt(v: object, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        s = f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    elif isinstance(v, int):
        s = f"{v:,}"
    else:
        return html.escape(str(v))
    return s + (f" {unit}" if unit and unit not in ("ratio", "requests") else "")


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td class='l'>{c}</td>" if i < left else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def title_of(runs: list[Run], fallback: str) -> str:
    if len(runs) > 1:
        return "agentserve report: " + " vs ".join(r.name for r in runs)
    info = runs[0].info
    if info.get("title"):
        return str(info["title"])
    if info.get("url"):
        return f"agentserve bench: {info.get('model') or 'model ?'} at {info['url']} ({info.get('mode', '?')})"
    return fallback


def _versions(info: dict) -> str:
    v = info.get("versions") or {}
    return ", ".join(f"{k} {x}" for k, x in v.items() if x) or "-"


def _machine(info: dict) -> str:
    m = info.get("machine") or {}
    return f"{m.get('cpus', '?')} CPUs, {m.get('arch', '?')}, {m.get('os', '?')}" if m else "-"


def what_ran(runs: list[Run]) -> str:
    rows = []
    for label, key in INFO_FIELDS:
        vals = [r.info.get(key) for r in runs]
        if all(v is None for v in vals):
            continue
        cells = [f"<code>{html.escape(str(v))}</code>" if key == "command" and v else fmt(v) for v in vals]
        rows.append([label, *cells])
    rows.append(["versions", *(_versions(r.info) for r in runs)])
    rows.append(["machine", *(_machine(r.info) for r in runs)])
    if not any(r.info for r in runs):
        rows.append(["note", *("summary.json has no run block (written before it was recorded)" for _ in runs)])
    head = ["", *(r.name for r in runs)] if len(runs) > 1 else ["", "this run"]
    return "<h2>What ran</h2>" + _table(head, rows, left=1 + len(runs))


STAGE_ROWS = (
    ("requests ok / failed / cancelled", lambda s: f"{s['requests_ok']:,} / {s['requests_failed']:,} / "
                                                   f"{s.get('requests_cancelled', 0):,}"),
    ("duration", lambda s: fmt(s["duration_s"], "s")),
    ("TTFT p50 / p90", lambda s: f"{fmt(s['ttft_s']['p50'])} / {fmt(s['ttft_s']['p90'], 's')}"),
    ("ITL p50 / p90 (per request)", lambda s: f"{fmt(s['itl_ms']['p50'])} / {fmt(s['itl_ms']['p90'], 'ms')}"),
    ("ITL p50 (token-weighted)", lambda s: fmt((s.get("itl_token_ms") or {}).get("p50"), "ms")),
    ("E2E p50", lambda s: fmt(s["e2e_s"]["p50"], "s")),
    ("output / input tok/s", lambda s: f"{fmt(s['output_tok_s'])} / {fmt(s['input_tok_s'])}"),
    ("output tok/s per user (mean)", lambda s: fmt(s["output_tok_s_per_user"]["mean"])),
    ("cached / input", lambda s: fmt(s["cached_token_ratio"])),
    ("reusable ceiling / captured", lambda s: f"{fmt(s['reusable_ceiling_ratio'])} / {fmt(s['captured_reuse'])}"),
    ("sessions complete / started", lambda s: (f"{s['sessions_complete']} / {s['sessions_started']}"
                                               if "sessions_started" in s else "-")),
    ("session slowdown p50", lambda s: fmt((s.get("session_slowdown") or {}).get("p50"))),
)


def stage_table(run: Run) -> str:
    head = ["", *(stage_label(s, i) for i, s in enumerate(run.stages))]
    rows = [[name, *(f(s) for s in run.stages)] for name, f in STAGE_ROWS]
    return "<h2>Summary</h2>" + _table(head, rows)


def delta_tables(runs: list[Run]) -> str:
    out = ["<h2>Differences</h2><p class='note'>Each run against the first, stage by stage (stages "
           "matched by position); green is better, red worse.</p>"]
    for i in range(min(len(r.stages) for r in runs)):
        stages = [r.stages[i] for r in runs]
        rows = []
        for d in delta_rows(stages):
            cells = [fmt(v, d["unit"]) for v in d["values"]]
            for dv, pct, verdict in d["deltas"]:
                whole = all(isinstance(v, int) for v in d["values"])
                text = "-" if dv is None else (f"{dv:+,.0f}" if whole else f"{dv:+,.3f}") + (
                    f" ({pct:+.0f}%)" if pct is not None else "")
                cells.append(f"<span class='{verdict}'>{text}</span>" if verdict else text)
            rows.append([d["metric"], *cells])
        head = ["", *(r.name for r in runs), *(f"{r.name} - {runs[0].name}" for r in runs[1:])]
        labels = {stage_label(s, i) for s in stages}
        out.append(f"<h3>{html.escape(' / '.join(sorted(labels)))}</h3>" + _table(head, rows))
    return "".join(out)


def turn_table(run: Run) -> str:
    rows = [[r["turn"], fmt(r["requests"]), fmt(r["sub_requests"]), fmt(r["failed"]), fmt(r["input_tokens"]),
             fmt(r["cached_tokens"]), fmt(r["computed_tokens"]), fmt(r["ttft_p50_s"]), fmt(r["itl_p50_ms"])]
            for r in turn_rows(run.records)]
    if not rows:
        return "<p>No requests recorded.</p>"
    head = ["turn", "requests", "of them sub-agent", "failed", "input tokens", "cached", "computed",
            "TTFT p50 s", "ITL p50 ms"]
    return _table(head, rows)


def pd_table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        for i, s in enumerate(run.stages):
            c = s.get("config") or {}
            if "prefill_busy_frac" not in s:
                continue
            rows.append([html.escape(run.name), stage_label(s, i),
                         f"{c.get('prefill', '?')} x {c.get('prefill_width', '?')}",
                         f"{c.get('decode', '?')} x {c.get('decode_width', '?')}",
                         fmt(s["prefill_busy_frac"]), fmt(s["decode_busy_frac"]), fmt(s.get("pd_pull_gib"), "GiB"),
                         fmt(s.get("prefill_gpu_hit_rate"))])
    if not rows:
        return ""
    head = ["run", "stage", "prefill engines x GPUs", "decode engines x GPUs", "prefill busy", "decode busy",
            "KV pulled P->D", "prefill cache hit rate"]
    return "<h2>P/D split</h2>" + _table(head, rows, left=2)


def errors_section(runs: list[Run]) -> str:
    out = ["<h2>Errors</h2>"]
    for run in runs:
        rows = error_rows(run.records)
        tag = f"{html.escape(run.name)}: " if len(runs) > 1 else ""
        skipped = sum(s.get("requests_skipped", 0) for s in run.stages)
        extra = f"; {skipped:,} skipped before sending (over --max-input)" if skipped else ""
        if not rows:
            out.append(f"<p>{tag}no failed request of {len(run.records):,}{extra}.</p>")
            continue
        out.append(f"<p>{tag}{sum(r['count'] for r in rows):,} of {len(run.records):,} requests failed{extra}.</p>")
        out.append(_table(["error", "count", "HTTP status", "first at s", "example request"],
                          [[fmt(r["error"]), fmt(r["count"]), fmt(r["status"]), fmt(r["first_at_s"]),
                            fmt(r["example"])] for r in rows]))
    return "".join(out)


def figures(plots: list[Plot]) -> str:
    return "".join(f"<figure{' class=wide' if p.wide else ''}><img src='data:image/png;base64,{base64.b64encode(p.png).decode()}' "
                   f"alt='{html.escape(p.title)}'><figcaption><b>{html.escape(p.title)}.</b> "
                   f"{html.escape(p.caption)}</figcaption></figure>" for p in plots)


def render(runs: list[Run], fallback_title: str = "agentserve bench",
           plots: bool = True) -> tuple[str, list[Plot]]:
    """The page and the plots in it (none when `plots` is False: tables only, no matplotlib)."""
    title = title_of(runs, fallback_title)
    lat: list[Plot] = []
    agent: list[Plot] = []
    if plots:
        from agentserve.workload.plots import latency_plots  # matplotlib is slow to import
        from agentserve.workload.report_plots import agent_plots

        lat, agent = latency_plots(runs), agent_plots(runs)
    parts = [f"<h1>{html.escape(title)}</h1>", what_ran(runs),
             stage_table(runs[0]) if len(runs) == 1 else delta_tables(runs),
             "<h2>Latency and throughput</h2>" if lat else "", figures(lat),
             "<h2>Turns and sessions</h2>"]
    for run in runs:
        if len(runs) > 1:
            parts.append(f"<h3>{html.escape(run.name)}</h3>")
        parts.append(turn_table(run))
    parts += [figures(agent), pd_table(runs), errors_section(runs),
              "<h2>Definitions</h2><ul class='note'>" + "".join(f"<li>{html.escape(d)}</li>" for d in DEFINITIONS)
              + "</ul>"]
    page = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>")
    return page, lat + agent


def write_report(path: Path, runs: list[Run], fallback_title: str = "agentserve bench",
                 png_dir: Path | None = None, plots: bool = True) -> Path:
    """Write the page to `path` (and each plot as NAME.png into `png_dir` when given)."""
    page, drawn = render(runs, fallback_title, plots)
    path.write_text(page)
    if png_dir is not None:
        for p in drawn:
            (png_dir / f"{p.name}.png").write_bytes(p.png)
    return path
