"""`agentserve sim --seeds N`: the mean of N seeds' summaries and each figure's spread."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from agentserve.sim import cli as sim_cli
from agentserve.sim import sessions as sim_workload
from agentserve.sim.run import SimConfig, simulate
from agentserve.sim.seeds import simulate_seeds
from agentserve.workload.schema import Session, TraceRequest


def _sessions(seed: int) -> list[Session]:
    """A workload that differs by seed (as the synthesizer's does): 3 + seed % 3 turns."""
    out = []
    for i in range(3):
        ids, items = list(range(30 + 10 * i)), []
        for t in range(3 + seed % 3):
            items.append(TraceRequest(t=float(t), input_tokens=len(ids) * 64, output_tokens=40,
                                      hash_ids=list(ids)))
            ids += list(range(len(ids), len(ids) + 4))
        out.append(Session(id=f"s{seed}-{i}", block_size=64, items=items))
    return out


@pytest.fixture
def seeded_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_workload, "load_workload", lambda name, n, seed, *a: _sessions(seed))


def _cfg(**kw) -> SimConfig:
    base = dict(model="tiny", gpu="cpu-local", prefill=1, decode=1, prefill_width=1,
                decode_width=1, concurrency=2, duration=600.0, mtp=False, cpu_offload_gib=0.0,
                warmup=0.0, clients="closed", workload="seeded.jsonl", seed=5)
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("workers", [1, 2])
def test_seeds_are_the_mean_of_each_seed_s_own_run(seeded_workload, workers: int) -> None:
    alone = [simulate(_cfg(seed=s)) for s in (5, 6, 7)]
    got = simulate_seeds(_cfg(), 3, workers=workers)
    outs = [a["output_tok_s"] for a in alone]
    assert len(set(outs)) > 1  # the seeds draw different workloads: the spread is real
    assert got["output_tok_s"] == pytest.approx(sum(outs) / 3)
    assert got["ttft_s"]["p50"] == pytest.approx(sum(a["ttft_s"]["p50"] for a in alone) / 3)
    assert got["requests_ok"] == pytest.approx(sum(a["requests_ok"] for a in alone) / 3)
    m = got["seeds"]["metrics"]["output_tok_s"]
    assert got["seeds"]["seeds"] == [5, 6, 7] and m["values"] == pytest.approx(outs)
    assert m["ci_low"] < m["mean"] < m["ci_high"] and got["config"]["seed"] == 5


def test_one_seed_is_a_plain_run_and_none_is_refused(seeded_workload) -> None:
    one = simulate_seeds(_cfg(), 1)
    assert one["output_tok_s"] == simulate(_cfg())["output_tok_s"]
    assert one["seeds"]["metrics"]["output_tok_s"]["n"] == 1
    with pytest.raises(ValueError, match="at least one seed"):
        simulate_seeds(_cfg(), 0)


def _app() -> typer.Typer:
    app = typer.Typer()
    sim_cli.register(app)
    app.command("noop")(lambda: None)  # keep `sim` a sub-command
    return app


ARGS = ["sim", "--model", "tiny", "--gpu", "cpu-local", "--topology", "1P1D", "--prefill-width",
        "1", "--decode-width", "1", "--concurrency", "2", "--no-mtp", "--cpu-offload-gib", "0",
        "--duration", "600", "--warmup", "0", "--workload", "seeded.jsonl"]


def test_cli_seeds_keeps_the_issue_keys_and_adds_the_spread(seeded_workload) -> None:
    res = CliRunner().invoke(_app(), [*ARGS, "--seeds", "2", "--workers", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # progress lines go to stderr
    assert "sim: runs: 2/2 done" in res.stderr
    for k in sim_cli.KEYS:
        assert k in out
    assert out["seeds"]["seeds"] == [0, 1] and out["seeds"]["metrics"]["ttft_p50_s"]["n"] == 2
    text = CliRunner().invoke(_app(), [*ARGS, "--seeds", "2", "--workers", "1"])
    assert text.exit_code == 0 and "spread over seeds 0-1" in text.output, text.output


@pytest.mark.parametrize("flags, message", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--seeds", "65"], "--seeds must be <= 64"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--seed", str(2**32 - 1), "--seeds", "2"], "--seed must be <= 4294967295"),
])
def test_cli_bad_seed_flags_are_one_line_errors(flags: list[str], message: str) -> None:
    res = CliRunner().invoke(_app(), ["sim", *flags])
    assert res.exit_code == 2 and message in res.output, res.output
