"""`agentserve sim`: simulate one load stage of an xPyD deployment; JSON like `bench`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from agentserve.cli_checks import POSITIVE, check_flags, fail
from agentserve.runstats import interval_text
from agentserve.sim.config import (IDLE_GAP_CAP_S, LIMITS, ROUTE_MISS, check_clients,
                                   check_efficiency, parse_efficiency, parse_idle_gap_cap)
from agentserve.sim.run import SimConfig, parse_topology, simulate_records
from agentserve.sim.specs import CPU_PROFILE_ENV, cpu_profile_path
from agentserve.sim.sessions import SYNTH, load_workload

KEYS = ("output_tok_s", "input_tok_s", "ttft_s", "itl_ms", "e2e_s", "output_tok_s_per_user",
        "gpus", "cost_per_m_input", "cost_per_m_output", "cpu_restore_gib", "prefill_gpu_hit_rate",
        "captured_reuse", "decode_local_hit_rate", "rejected_share", "requests_unfinished",
        "queue_lengths")


def register(app: typer.Typer) -> None:
    """Add `sim` (and `sim calibrate`) to the `agentserve` app (wired by cli.py)."""
    sim_app = typer.Typer(add_completion=False)
    app.add_typer(sim_app, name="sim")
    register_calibrate(sim_app)

    @sim_app.callback(invoke_without_command=True)
    def sim(
        ctx: typer.Context,
        model: str = typer.Option("glm-5.2-fp8", help="model spec: glm-5.2-fp8, tiny, small"),
        gpu: str = typer.Option("h200", help="hardware spec: h200, cpu-local"),
        topology: str = typer.Option("3P1D", help="xPyD (prefill and decode instances) or N aggregated engines"),
        prefill_width: int = typer.Option(16, help="DEP width of each prefill instance"),
        decode_width: int = typer.Option(16, help="DEP width of each decode instance"),
        concurrency: str = typer.Option("128", help="AIPerf concurrency: replay lanes (or "
                                        "closed-loop clients); a comma-separated ladder "
                                        "(16,64,128) runs a stage a level, as `agentserve bench "
                                        "--mode concurrency` does"),
        mtp: bool = typer.Option(True, "--mtp/--no-mtp", help="MTP speculative decoding"),
        cpu_offload_gib: float = typer.Option(100.0, help="CPU KV tier per prefill rank (0: off)"),
        cpu_store_on: str = typer.Option("fill", help="when blocks reach the CPU tier, as the "
                                         "engine's --kv-store-on: fill (write-through) or evict "
                                         "(write-back)"),
        cpu_restore_ms_per_gb: float = typer.Option(None, help="CPU -> GPU restore time per GB "
                                                    "of a rank's CPU tier (default: the "
                                                    "hardware's; h200: SPEC's 26)"),
        cpu_profile: Path = typer.Option(None, help="--gpu cpu-local: the calibration profile "
                                         "(`agentserve sim calibrate`'s JSON; default "
                                         "$AGENTSERVE_SIM_CPU_PROFILE, else the package's "
                                         "agentserve/sim/data/cpu_profile.json)"),
        workload: str = typer.Option("sweep-full", help="sweep-full, sweep-limited or a trace "
                                     "FILE (Weka sessions or AIPerf mooncake_trace)"),
        duration: float = typer.Option(900.0, help="stage length, simulated seconds (the "
                                       "reference's AIPerf stages: 900); the summary's "
                                       "duration_s, which the throughputs divide, runs to the "
                                       "last counted answer where the stage drains, as "
                                       "AIPerf's benchmark duration does"),
        clients: str = typer.Option(None, help="load generator: agentx (AIPerf's agentic replay, "
                                    "as the reference ran: recorded think times, sub-agents in "
                                    "parallel, a warm-up of primers; default for xPyD), closed "
                                    "(no think time; default for aggregated engines) or schedule "
                                    "(a trace FILE's requests at their recorded times, open loop, "
                                    "as `agentserve bench --mode schedule`)"),
        session_rate: float = typer.Option(None, help="schedule: sessions per second, session i "
                                           "at i / rate (default: their recorded starts, a "
                                           "mooncake trace's timestamps)"),
        gap_cap_s: float = typer.Option(None, help="agentx: cap on each replayed think time, s "
                                        "(default: as recorded)"),
        prefix_index: str = typer.Option("precise", help="how the prefill picker sees prefixes: "
                                         "precise (the pools' contents) or approx (llm-d's "
                                         "approximate producers, as the reference's router ran)"),
        route_miss: float = typer.Option(ROUTE_MISS, help="xPyD: share of requests the prefill "
                                         "picker routes on load alone, as when its prefix view "
                                         "holds nothing for them (0: never; the default gives "
                                         "the reference's published 96-97% capture)"),
        idle_gap_cap_s: str = typer.Option(str(IDLE_GAP_CAP_S), help="agentx: AIPerf's per-trace "
                                           "idle-gap cap, s: consecutive request starts of a trace "
                                           "at most this far apart; off for none"),
        efficiency: str = typer.Option(None, help="override the step model's global factors, "
                                       "name=value pairs (e.g. hbm=0.5,flops=0.5): what-if "
                                       "kernels; see `sim/constants.py` Efficiency"),
        warmup: float = typer.Option(None, help="closed clients: simulated seconds before the "
                                     "stage (default: 120 for xPyD on a synthesized workload, else 0)"),
        replay_run: int = typer.Option(None, help="closed clients, synthesized xPyD stages: turns a client replays "
                                       "before it starts a fresh (cold) conversation (default: to "
                                       "the session's end, the reference's reusable-prefix ceiling)"),
        max_output: int = typer.Option(None, help="cap on each request's output tokens (max_tokens), "
                                       "as `agentserve bench --max-output` (default: as recorded)"),
        seed: int = typer.Option(0),
        seeds: int = typer.Option(1, help="simulate seeds SEED .. SEED + N - 1 and report their "
                                  "mean, with each headline figure's spread under `seeds`"),
        workers: int = typer.Option(2, help="--seeds: worker processes"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object (for a concurrency ladder, a list of them, one a stage)"),
        out: Path = typer.Option(None, help="also write the stage as `agentserve bench` writes a "
                                 "run: summary.json, requests.jsonl / .csv, TTFT, ITL and "
                                 "throughput plots and report.html, into this folder (one seed)"),
    ) -> None:
        """Predict throughput, latency and cost of a deployment with the real KV and router code."""
        if ctx.invoked_subcommand is not None:  # `sim calibrate`: no simulation
            return
        lim = LIMITS
        levels = _levels(concurrency)
        check_flags(prefill_width=(prefill_width, 1, lim["width"]),
                     decode_width=(decode_width, 1, lim["width"]),
                     concurrency=(min(levels), 1, lim["concurrency"]),
                     cpu_offload_gib=(cpu_offload_gib, 0, lim["cpu_offload_gib"]),
                     duration=(duration, 1, lim["duration"]), warmup=(warmup, 0, lim["duration"]),
                     replay_run=(replay_run, 1), gap_cap_s=(gap_cap_s, 0, lim["duration"]),
                     cpu_restore_ms_per_gb=(cpu_restore_ms_per_gb, POSITIVE, 1e6),
                     max_output=(max_output, 1), session_rate=(session_rate, POSITIVE, 1e6),
                     seed=(seed, 0, lim["seed"]), seeds=(seeds, 1, lim["seeds"]),
                     workers=(workers, 1, 256))
        check_flags(seed=(seed + seeds - 1, 0, lim["seed"]),  # the last seed drawn
                    concurrency=(max(levels), 1, lim["concurrency"]))
        if cpu_profile is not None and gpu != "cpu-local":
            fail(f"--cpu-profile is cpu-local's calibration; --gpu {gpu} has published rates")
        if len(levels) > 1 and clients == "schedule":
            fail("--clients schedule sends a trace at its own times: no concurrency to vary "
                 f"(got the ladder {concurrency})")
        if out is not None:
            if seeds > 1:
                fail(f"--out writes each stage's requests and plots; --seeds {seeds} averages "
                     "several runs of one (drop --seeds, or write each with --seed N --out DIR_N)")
            _out_dir(out, "sim writes summary.json, the request records, plots and report.html")
        try:
            profile = _cpu_profile(gpu, cpu_profile)
            idle_cap = parse_idle_gap_cap(idle_gap_cap_s)
            eff = parse_efficiency(efficiency) if efficiency is not None else None
            p, d = parse_topology(topology)
            n_gpus = p * prefill_width + d * decode_width if p else d
            if n_gpus > lim["gpus"]:
                raise ValueError(f"--topology {topology} with these widths is {n_gpus} GPUs; "
                                 f"the simulator takes at most {lim['gpus']}")
            cfg = SimConfig(model=model, gpu=gpu, prefill=p, decode=d, prefill_width=prefill_width,
                            decode_width=decode_width, concurrency=levels[0], mtp=mtp,
                            cpu_offload_gib=cpu_offload_gib, cpu_store_on=cpu_store_on,
                            workload=workload, duration=duration,
                            warmup=warmup, seed=seed, aggregated=d if p == 0 else 0,
                            replay_run=replay_run, clients=clients, session_rate=session_rate,
                            gap_cap_s=gap_cap_s,
                            idle_gap_cap_s=idle_cap, prefix_index=prefix_index,
                            route_miss=route_miss, cpu_profile=profile, max_output=max_output,
                            efficiency=eff, cpu_restore_s_per_gb=(
                                None if cpu_restore_ms_per_gb is None else cpu_restore_ms_per_gb / 1e3))
            if len(levels) > 1 or seeds > 1:
                from agentserve.sim.seeds import simulate_ladder

                from agentserve.workload.replay_progress import TaskProgress

                with TaskProgress(len(levels) * seeds, "sim: runs") as bar:
                    runs = simulate_ladder(cfg, levels, seeds, workers, keep_records=out is not None,
                                           on_done=bar.advance)
            else:
                runs = [simulate_records(cfg)]
        except (ValueError, OSError) as e:  # unknown spec or topology, unreadable trace
            fail(str(e))
        stages = [_label(cfg, i, c) | s for i, (c, (s, _)) in enumerate(zip(levels, runs))]
        for st in stages:
            if not st.get("requests_ok"):  # every figure is empty: say why, not just None
                typer.echo(f"warning: no request was answered in the stage{_at(st, levels)} "
                           f"({st.get('requests_unfinished', 0):g} sent and still unanswered "
                           "when it ended): lengthen --duration, or lighten the load "
                           "(--concurrency, --workload, --max-output)", err=True)
        if out is not None:
            from agentserve.workload.report import write_outputs  # matplotlib only when asked

            records = []
            for i, (_, recs) in enumerate(runs):
                for r in recs:
                    r.stage = i  # bench's records say their stage; the plots group by it
                records += recs
            write_outputs(out, stages, records,
                          title=f"agentserve sim: {model} on {gpu}, {topology} ({_widths(cfg)}), "
                                f"concurrency {concurrency}, {duration:g} s")
            typer.echo(f"wrote {out}/report.html", err=as_json)  # stdout stays JSON
        if len(levels) > 1:
            if as_json:  # one object a stage, as bench's summary.json
                typer.echo(json.dumps(stages, default=float))
            else:
                _print_ladder(stages)
            return
        s = runs[0][0]
        if as_json:
            typer.echo(json.dumps(s, default=float))
            return
        for k in KEYS:
            typer.echo(f"{k:24s} {s[k]}")
        if seeds > 1:
            typer.echo(f"spread over seeds {s['seeds']['seeds'][0]}-{s['seeds']['seeds'][-1]} "
                       "(mean [95% CI] cv):")
            for k, m in s["seeds"]["metrics"].items():
                if m["n"] > 1:
                    typer.echo(f"  {k:22s} {interval_text(m, 4)}")

    register_plan(app)


def _out_dir(out: Path, what: str) -> None:
    """Make `out` a writable folder before any simulating, or fail with one line."""
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file; {what} into a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out {out}: cannot create the folder ({e.strerror or e})")
    if not os.access(out, os.W_OK | os.X_OK):
        fail(f"--out {out}: the folder is not writable")


def _widths(cfg: SimConfig) -> str:
    if cfg.aggregated:
        return f"{cfg.aggregated} aggregated"
    return f"DEP{cfg.prefill_width} prefill, DEP{cfg.decode_width} decode"


def _levels(text: str) -> list[int]:
    """`--concurrency`: one level or a comma-separated ladder of integers (ranges checked by
    the caller)."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels:
        fail(f"--concurrency takes a level or a comma-separated ladder of integers like "
             f"16,64,128, got {text!r}")
    return levels


def _label(cfg: SimConfig, i: int, concurrency: int) -> dict:
    """A stage's label as bench writes it (`workload.replay`), so the same report, plots and
    tools read a simulated run and a measured one."""
    if cfg.clients == "schedule":
        return {"mode": "schedule", "stage": i}
    return {"mode": "concurrency", "stage": i, "concurrency": concurrency}


def _at(stage: dict, levels: list[int]) -> str:
    return f" at concurrency {stage['concurrency']}" if len(levels) > 1 else ""


def _print_ladder(stages: list[dict]) -> None:
    """A row a stage: what bench's table shows, and the simulator's own headline figures."""
    from rich.console import Console
    from rich.table import Table

    def f(v: float | None, p: int = 3) -> str:
        return "-" if v is None else f"{v:,.{p}f}"
    t = Table(title="agentserve sim: a stage a concurrency (c); TTFT s, ITL ms, tok/s out",
              caption="queued: requests waiting, mean over the stage (queue_lengths)")
    for col in ("c", "ok", "TTFT p50", "TTFT p90", "ITL p50", "tok/s", "/user", "/GPU",
                "$/M out", "queued"):
        t.add_column(col, justify="right")
    for s in stages:
        q = s.get("queue_lengths") or {}
        waiting = sum(v["mean"] for v in q.values() if isinstance(v, dict))
        t.add_row(str(s["concurrency"]), str(s["requests_ok"]), f(s["ttft_s"]["p50"]),
                  f(s["ttft_s"]["p90"]), f(s["itl_ms"]["p50"], 2), f(s["output_tok_s"], 0),
                  f(s["output_tok_s_per_user"]["mean"], 1), f(s["output_tok_s_per_gpu"], 1),
                  f(s.get("cost_per_m_output"), 2), f(waiting, 1))
    Console().print(t)


def _cpu_profile(gpu: str, named: Path | None) -> str | None:
    """cpu-local's profile as a path (so the JSON's config names the one used and worker
    processes read the same), or None; says so on stderr when there is none to read."""
    if gpu != "cpu-local":
        return None
    path = cpu_profile_path(named)
    if path is None:
        typer.echo("warning: no cpu-local calibration profile (write one with "
                   "`agentserve sim calibrate`, or name it with --cpu-profile or "
                   f"${CPU_PROFILE_ENV}): placeholder rates, not this machine's", err=True)
        return None
    return str(path.resolve())


def register_calibrate(sim_app: typer.Typer) -> None:
    """Add `sim calibrate`: fit the cpu-local profile on this machine (sim/calibrate.py)."""

    @sim_app.command("calibrate")
    def calibrate(
        out: Path = typer.Option(None, help="where to write the profile (default: the one "
                                 "`agentserve sim --gpu cpu-local` reads, the package's "
                                 "agentserve/sim/data/cpu_profile.json)"),
        prompt: int = typer.Option(1024, help="decode context, tokens"),
        chunk: int = typer.Option(2048, help="prefill chunk (each engine's "
                                  "--max-num-batched-tokens), tokens"),
        kv_tokens: int = typer.Option(65_536, help="each engine's --kv-cache-tokens"),
        port: int = typer.Option(18_490, help="the router's port"),
    ) -> None:
        """Fit the cpu-local step model through `agentserve up --topology 2` (two tiny engines
        and the router on this machine, ~10 min) and write it as JSON."""
        from agentserve.sim import calibrate as cal
        from agentserve.sim.specs import CPU_PROFILE_DEFAULT

        check_flags(prompt=(prompt, 16, 65_536), chunk=(chunk, 16, 65_536),
                    kv_tokens=(kv_tokens, max(4 * chunk, 8 * (2048 + 256), 16 * (prompt + 320))),
                    port=(port, 1, 65_535))  # KV: the cached 4 x chunk prompt, batch 8 at
        # context 2048 and batch 16 at `prompt` (+ their outputs) on each engine, unpreempted
        try:
            profile = cal.calibrate_cluster(prompt, chunk, kv_tokens, port)
        except RuntimeError as e:
            fail(str(e))
        path = cal.write_profile(profile, out or CPU_PROFILE_DEFAULT)
        typer.echo(f"wrote {path}: a step {profile['step_overhead_s'] * 1e3:.2f} ms + "
                   f"{profile['per_seq_s'] * 1e3:.3f} ms a sequence + "
                   f"{profile['tok_s'] * 1e6:.1f} us a token")


def register_plan(app: typer.Typer) -> None:
    """Add `plan`: simulate candidate topologies, print the frontier, recommend one."""

    @app.command("plan")
    def plan(
        model: str = typer.Option("glm-5.2-fp8", help="model spec"),
        gpu: str = typer.Option("h200", help="hardware spec"),
        gpus: int = typer.Option(64, help="GPU budget"),
        min_tok_s_per_user: float = typer.Option(30.0, help="end-to-end output tok/s per user"),
        workload: str = typer.Option("sweep-full", help="sweep-full, sweep-limited or a trace "
                                     "FILE (Weka sessions or AIPerf mooncake_trace)"),
        price: float = typer.Option(2.71, help="$ per GPU-hour"),
        concurrency: str = typer.Option("32,64,128,192", help="concurrency ladder per config"),
        duration: float = typer.Option(100.0, help="stage length, simulated s (short by default)"),
        clients: str = typer.Option(None, help="load generator: agentx (AIPerf's agentic replay, "
                                    "default) or closed (no think time)"),
        warmup: float = typer.Option(50.0, help="closed clients: simulated s before each stage "
                                     "(the replay warms up with its primers)"),
        long: bool = typer.Option(False, "--long", help="600 s stages, 120 s warm-up for closed "
                                  "clients (slower, less warm-up bias)"),
        widths: str = typer.Option("8,16", help="DEP widths to try"),
        efficiency: str = typer.Option(None, help="override the step model's global factors for "
                                       "every configuration, e.g. hbm=0.5 (as `sim --efficiency`)"),
        workers: int = typer.Option(2, help="worker processes"),
        seed: int = typer.Option(0),
        out: Path = typer.Option(Path("bench-out/plan"), help="plan.json and frontier.png go here"),
    ) -> None:
        """Search xPyD x DEP width x MTP x CPU tier under the budget; frontier and cheapest config."""
        from agentserve.sim import plan as pl

        try:
            width_list = tuple(int(w) for w in widths.split(","))
            ladder = [int(c) for c in concurrency.split(",")]
        except ValueError:
            fail(f"--widths and --concurrency are comma-separated integers, got {widths!r} and "
                 f"{concurrency!r}")
        lim = LIMITS
        check_flags(gpus=(gpus, 1, lim["gpus"]), min_tok_s_per_user=(min_tok_s_per_user, 0),
                     price=(price, 0), concurrency=(min(ladder), 1),
                     widths=(min(width_list), 1), workers=(workers, 1, 256),
                     duration=(duration, 1, lim["duration"]), warmup=(warmup, 0, lim["duration"]),
                     seed=(seed, 0, lim["seed"]))
        check_flags(concurrency=(max(ladder), 1, lim["concurrency"]),
                     widths=(max(width_list), 1, lim["width"]))
        try:  # a bad trace fails now, not after the sweep (nor in a worker)
            _cpu_profile(gpu, None)  # a named profile that is missing, or none at all
            if workload not in SYNTH:
                load_workload(workload, 1, seed)
            cands = pl.candidates(model, gpu, gpus, width_list)
        except (ValueError, OSError) as e:
            fail(str(e))
        if not cands:
            fail(f"no xPyD configuration of DEP{'/'.join(map(str, width_list))} instances fits "
                 f"{gpus} GPUs of {gpu} (1P1D needs 2 instances whose weights fit a GPU)")
        dur, warm = (600.0, 120.0) if long else (duration, warmup)
        try:  # before the workers start, not in each of them
            check_clients(clients)
            eff = parse_efficiency(efficiency) if efficiency is not None else None
            check_efficiency(eff, gpu)
        except ValueError as e:
            fail(str(e))
        if clients == "schedule":  # one load per trace: nothing for a concurrency ladder to vary
            fail("plan sweeps a concurrency ladder; --clients schedule has none (simulate a "
                 "schedule per configuration with agentserve sim --clients schedule)")
        # an unwritable --out fails before the sweep, not after it
        _out_dir(out, "plan writes plan.json and frontier.png")
        lead = f"{warm:g} s warm-up" if clients == "closed" else "the replay's primers"
        typer.echo(f"simulating {len(cands)} configurations x {len(ladder)} concurrencies, "
                   f"{lead} + {dur:g} s stages, {workers} workers")
        t0 = time.perf_counter()
        try:
            from agentserve.workload.replay_progress import TaskProgress

            with TaskProgress(len(cands) * len(ladder), "plan: simulations") as bar:
                points = pl.sweep(cands, ladder, model, gpu, workload, dur, seed, workers, warm,
                                  clients, eff, on_done=bar.advance)
        except (ValueError, OSError) as e:  # an unreadable trace
            fail(str(e))
        pl.price(points, price)
        front, best = pl.frontier(points), pl.recommend(points, min_tok_s_per_user)
        pl.write(out, points, front, best, {"model": model, "gpu": gpu, "gpus": gpus,
                 "min_tok_s_per_user": min_tok_s_per_user, "price": price, "duration": dur,
                 "warmup": warm, "clients": clients or "agentx", "efficiency": eff,
                 "concurrency": ladder, "workload": workload,
                 "wall_s": time.perf_counter() - t0})
        _print_plan(front, best, min_tok_s_per_user, out)


def _print_plan(front: list[dict], best: dict | None, target: float, out: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="frontier: output tok/s per GPU vs tok/s per user")
    cols = ("config", "concurrency", "tok_s_per_user", "output_tok_s_per_gpu", "ttft_p50_s",
            "itl_p50_ms", "cost_per_m_input", "cost_per_m_output")
    for c in cols:
        t.add_column(c, justify="right")
    notes = list(dict.fromkeys(p["caveat"] for p in front if p.get("caveat")))
    for p in front:
        row = [f"{p[c]:,.3g}" if isinstance(p[c], float) else str(p[c]) for c in cols]
        if p.get("caveat"):  # a known-optimistic row: marked, its note printed below
            row[0] += " " + "*" * (notes.index(p["caveat"]) + 1)
        t.add_row(*row)
    con = Console(width=160)
    con.print(t)
    for i, note in enumerate(notes):
        con.print(f"{'*' * (i + 1)} {note}", markup=False)  # notes are text, not rich markup
    if best is None:
        con.print(f"no configuration reaches {target:g} tok/s per user")
    else:
        con.print(f"recommended: {best['config']} at concurrency {best['concurrency']}: "
                  f"{best['tok_s_per_user']:.1f} tok/s/user, {best['output_tok_s_per_gpu']:.0f} "
                  f"output tok/s/GPU, ${best['cost_per_m_input']:.3f}/M input, "
                  f"${best['cost_per_m_output']:.2f}/M output")
        if best.get("caveat"):
            con.print(f"[bold yellow]caution:[/] the recommendation is a row the model is known to be "
                      f"optimistic on: {escape(best['caveat'])}")
    con.print(f"wrote {out / 'plan.json'} and {out / 'frontier.png'}")
