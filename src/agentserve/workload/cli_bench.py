"""`agentserve bench`: the command-line face of workload.replay (flags as in WORKLOAD-1)."""

from __future__ import annotations

from typing import Optional

import typer

from agentserve.cli_checks import POSITIVE, flag_range_error
from agentserve.runstats import interval_text


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers like 16,32,64, got {text!r}")
    if not vals or min(vals) < 1:
        raise typer.BadParameter("concurrency levels must be positive integers")
    return vals


def bench(
    url: str = typer.Option(..., "--url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000"),
    trace: Optional[str] = typer.Option(None, "--trace",
                                        help="Weka sessions JSONL or mooncake JSONL (.gz ok); or --isl"),
    isl: Optional[float] = typer.Option(None, "--isl", "--synthetic-input-tokens-mean",
                                        help="synthetic prompts (no trace): input tokens, mean"),
    isl_stddev: float = typer.Option(0.0, "--isl-stddev", "--synthetic-input-tokens-stddev"),
    osl: Optional[float] = typer.Option(None, "--osl", "--output-tokens-mean",
                                        help="synthetic: output tokens, mean (default 128)"),
    osl_stddev: float = typer.Option(0.0, "--osl-stddev", "--output-tokens-stddev"),
    request_count: Optional[int] = typer.Option(
        None, "--request-count", help="requests per stage, at most (the trace cycles); "
        "synthetic default 10 unless --stage-duration"),
    warmup_requests: int = typer.Option(0, "--warmup-requests", "--warmup-request-count",
                                        help="sent first at the first stage's concurrency, not measured"),
    mode: Optional[str] = typer.Option(None, "--mode", help="sessions | concurrency | schedule "
                                       "(default: sessions; concurrency for --isl)"),
    sessions: int = typer.Option(16, "--sessions", help="sessions mode: sessions at once (closed loop)"),
    session_rate: Optional[float] = typer.Option(None, "--session-rate", help="open loop: sessions/s"),
    concurrency: str = typer.Option("16", "--concurrency", help="concurrency mode: levels, e.g. 16,32,64"),
    stage_duration: Optional[float] = typer.Option(
        None, "--stage-duration", help="seconds per concurrency stage (default 60 unless --request-count)"),
    token_scale: Optional[int] = typer.Option(None, "--token-scale", help="tokens sent per trace block"),
    gap_cap: Optional[float] = typer.Option(None, "--gap-cap", help="cap on each idle gap, seconds"),
    gap_scale: float = typer.Option(1.0, "--gap-scale", help="multiply recorded idle gaps"),
    duration: Optional[float] = typer.Option(None, "--duration", help="sessions/schedule: stop after S s"),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", help="main-agent turns per session"),
    max_input: Optional[int] = typer.Option(None, "--max-input", help="skip requests with more (scaled) input"),
    max_output: Optional[int] = typer.Option(None, "--max-output", help="cap on max_tokens"),
    output_scale: float = typer.Option(1.0, "--output-scale", help="multiply the trace's output lengths"),
    api: str = typer.Option("completions", "--api", help="completions (token ids, exact) | chat (text)"),
    model: Optional[str] = typer.Option(None, "--model", help="default: first id at /v1/models"),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", help="chat: size prompts with this tokenizer (HF model folder or .gguf); "
        "default: the server's POST /tokenize"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    vocab_size: int = typer.Option(4000, "--vocab-size", help="target vocabulary size"),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="seconds per request"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs behind the URL (for tok/s per GPU); "
                                       "default: the engines a router lists, else 1"),
    seed: int = typer.Option(0, "--seed", "--random-seed"),
    out: str = typer.Option("bench-out", "--out", help="output directory"),
    num_profile_runs: int = typer.Option(1, "--num-profile-runs",
                                         help="run the bench N times (same workload) and aggregate"),
    confidence_level: float = typer.Option(0.95, "--confidence-level",
                                           help="of the aggregate's confidence intervals"),
    cooldown: float = typer.Option(0.0, "--profile-run-cooldown-seconds",
                                   help="pause between profile runs, seconds"),
) -> None:
    """Replay agent traces against an OpenAI endpoint; write summary.json, records, plots, report.html."""
    from agentserve.workload.replay import MODES, BenchConfig, run_bench

    mode, request_count, stage_duration = _workload_flags(trace, isl, osl, mode, request_count,
                                                          stage_duration)
    if mode not in MODES:
        raise typer.BadParameter(f"--mode must be one of {', '.join(MODES)}")
    if not url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"--url must be an http(s):// base URL, got {url!r}")
    message = flag_range_error(
        sessions=(sessions, 1), session_rate=(session_rate, POSITIVE),
        stage_duration=(stage_duration, POSITIVE), token_scale=(token_scale, 1),
        gap_cap=(gap_cap, 0), gap_scale=(gap_scale, 0), duration=(duration, POSITIVE),
        max_turns=(max_turns, 1), isl=(isl, 1), isl_stddev=(isl_stddev, 0), osl=(osl, 1),
        osl_stddev=(osl_stddev, 0), request_count=(request_count, 1),
        warmup_requests=(warmup_requests, 0), max_input=(max_input, 1), max_output=(max_output, 1),
        output_scale=(output_scale, POSITIVE), vocab_size=(vocab_size, 2),
        request_timeout=(request_timeout, POSITIVE), gpus=(gpus, 1),
        num_profile_runs=(num_profile_runs, 1), profile_run_cooldown_seconds=(cooldown, 0))
    if message is None and not 0 < confidence_level < 1:
        message = f"--confidence-level must be between 0 and 1, got {confidence_level}"
    if message is not None:
        raise typer.BadParameter(message)
    if api not in ("completions", "chat"):
        raise typer.BadParameter("--api must be completions or chat")
    cfg = BenchConfig(url=url, trace=trace, mode=mode, sessions=sessions, session_rate=session_rate,
                      concurrency=_ints(concurrency), stage_duration=stage_duration, token_scale=token_scale,
                      gap_scale=gap_scale, gap_cap=gap_cap, duration=duration, max_turns=max_turns,
                      max_input=max_input, max_output=max_output, output_scale=output_scale, api=api,
                      model=model, tokenizer=tokenizer, api_key=api_key, vocab_size=vocab_size, request_timeout=request_timeout,
                      gpus=gpus, seed=seed, out=out, isl=isl, isl_stddev=isl_stddev,
                      osl=osl if osl is not None else 128.0, osl_stddev=osl_stddev,
                      request_count=request_count, warmup_requests=warmup_requests)
    try:
        if num_profile_runs > 1:
            from agentserve.workload.multirun import run_profile_runs

            record = run_profile_runs(cfg, num_profile_runs, confidence_level, cooldown,
                                      bench=lambda c: _printed(run_bench(c), c.out))
        else:
            stages = _printed(run_bench(cfg), out)
    except (RuntimeError, ValueError, OSError) as e:  # bad trace, unreachable model list, ...
        typer.echo(f"bench: {e}", err=True)
        raise typer.Exit(2)
    if num_profile_runs > 1:
        _print_aggregate(record, out)
        for f in record["metadata"]["failed_runs"]:
            typer.echo(f"bench: {f['label']} failed: {f['error']}", err=True)
        if record["metadata"]["interrupted"]:
            raise typer.Exit(130)
    elif any(s.get("interrupted") for s in stages):
        raise typer.Exit(130)  # partial results are written; say so to scripts


def _workload_flags(trace: str | None, isl: float | None, osl: float | None, mode: str | None,
                    request_count: int | None, stage_duration: float | None
                    ) -> tuple[str, int | None, float | None]:
    """A trace or synthetic prompts (AIPerf's way), and the defaults that follow from which."""
    if trace is not None and (isl is not None or osl is not None):
        raise typer.BadParameter("give --trace or synthetic lengths (--isl/--osl), not both")
    if trace is None and isl is None:
        raise typer.BadParameter("no workload: pass --trace FILE, or --isl N [--osl M] for "
                                 "synthetic prompts")
    if isl is not None:
        mode = mode or "concurrency"
        if request_count is None and stage_duration is None:
            request_count = 10
    if stage_duration is None and request_count is None:
        stage_duration = 60.0
    return mode or "sessions", request_count, stage_duration


def _printed(stages: list[dict], out: str) -> list[dict]:
    _print(stages, out)
    return stages


def _print_aggregate(record: dict, out: str) -> None:
    """Mean, confidence interval and CV of the headline figures per stage."""
    from rich.console import Console
    from rich.table import Table

    meta = record["metadata"]
    t = Table(title=f"agentserve bench, {meta['num_successful_runs']} runs → {out}/aggregate "
                    f"(mean [{meta['confidence_level']:.0%} CI] cv)")
    names = ("output_tok_s", "ttft_p50_s", "itl_p50_ms", "e2e_p50_s", "cached_token_ratio")
    for col in ("stage", *names):
        t.add_column(col, justify="right")
    for st in record["stages"]:
        t.add_row(st["stage"], *(interval_text(st["metrics"][n]) for n in names))
    Console().print(t)


def _print(stages: list[dict], out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"agentserve bench → {out}")
    for col in ("stage", "ok", "failed", "TTFT p50 s", "ITL p50 ms", "out tok/s", "in tok/s", "cached/in",
                "in served/asked"):
        t.add_column(col, justify="right")
    for s in stages:
        f = (lambda v, p=3: "-" if v is None else f"{v:.{p}f}")
        t.add_row(str(s.get("concurrency") or s.get("sessions") or s.get("stage")), str(s["requests_ok"]),
                  str(s["requests_failed"]), f(s["ttft_s"]["p50"]), f(s["itl_ms"]["p50"], 2),
                  f(s["output_tok_s"], 0), f(s["input_tok_s"], 0), f(s["cached_token_ratio"]),
                  f(s.get("served_input_ratio")))
    Console().print(t)
    for s in stages:  # the prompts were sized to the served tokenizer: say so when they missed
        ratio = s.get("served_input_ratio")
        if ratio is not None and abs(ratio - 1.0) > 0.01:
            typer.echo(f"bench: stage {s.get('stage')}: the server counted {ratio:.3f}x the input "
                       "tokens asked (a tokenizer or chat template other than the one measured?)",
                       err=True)


def register_bench(app: typer.Typer) -> None:
    """Add `bench` to the top-level `agentserve` app."""
    app.command("bench")(bench)
