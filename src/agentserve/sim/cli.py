"""`agentserve sim`: simulate one closed-loop stage of an xPyD deployment; JSON like `bench`."""

from __future__ import annotations

import json

import typer

from agentserve.sim.run import SimConfig, parse_topology, simulate

KEYS = ("output_tok_s", "input_tok_s", "ttft_s", "itl_ms", "e2e_s", "output_tok_s_per_user",
        "gpus", "cost_per_m_input", "cost_per_m_output", "cpu_restore_gib", "prefill_gpu_hit_rate")


def register(app: typer.Typer) -> None:
    """Add `sim` to the `agentserve` app (wired by cli.py)."""

    @app.command("sim")
    def sim(
        model: str = typer.Option("glm-5.2-fp8", help="model spec: glm-5.2-fp8, tiny, small"),
        gpu: str = typer.Option("h200", help="hardware spec: h200, cpu-local"),
        topology: str = typer.Option("3P1D", help="xPyD: prefill and decode instances"),
        prefill_width: int = typer.Option(16, help="DEP width of each prefill instance"),
        decode_width: int = typer.Option(16, help="DEP width of each decode instance"),
        concurrency: int = typer.Option(128, help="closed-loop clients (AIPerf concurrency)"),
        mtp: bool = typer.Option(True, "--mtp/--no-mtp", help="MTP speculative decoding"),
        cpu_offload_gib: float = typer.Option(100.0, help="CPU KV tier per prefill rank (0: off)"),
        workload: str = typer.Option("sweep-full", help="sweep-full, sweep-limited or a trace FILE"),
        duration: float = typer.Option(600.0, help="stage length, simulated seconds"),
        seed: int = typer.Option(0),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Predict throughput, latency and cost of a deployment with the real KV and router code."""
        p, d = parse_topology(topology)
        cfg = SimConfig(model=model, gpu=gpu, prefill=p, decode=d, prefill_width=prefill_width,
                        decode_width=decode_width, concurrency=concurrency, mtp=mtp,
                        cpu_offload_gib=cpu_offload_gib, workload=workload, duration=duration,
                        seed=seed)
        s = simulate(cfg)
        if as_json:
            typer.echo(json.dumps(s, default=float))
            return
        for k in KEYS:
            typer.echo(f"{k:24s} {s[k]}")
