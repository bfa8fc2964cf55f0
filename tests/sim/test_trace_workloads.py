"""The simulator replays trace files in both of SPEC's formats: Weka sessions and AIPerf's
mooncake_trace JSONL (hash ids at 512 tokens, shared across requests), on its 64-token blocks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agentserve.sim import sessions as wl
from agentserve.sim.run import SimConfig, simulate

# r1 extends r0's two 512-token blocks; r2 shares nothing. No session ids: each record is its
# own session, and their ids mean the same content across sessions (mooncake's global scope).
MOONCAKE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 10, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 20, "input_length": 300, "output_length": 4, "hash_ids": [7]},
]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_mooncake_trace_is_put_on_64_token_blocks_with_its_prefixes_kept(tmp_path) -> None:
    sessions = wl.load_workload(_write(tmp_path / "mc.jsonl", MOONCAKE), 1, 0)
    assert [s.block_size for s in sessions] == [64, 64, 64]
    r0, r1, r2 = (s.items[0] for s in sessions)
    assert len(r0.hash_ids) == 16 and len(r1.hash_ids) == 24 and len(r2.hash_ids) == 5
    assert r1.hash_ids[:16] == r0.hash_ids  # the shared 1,024 tokens: the same 16 blocks
    assert len(set(r0.hash_ids + r1.hash_ids[16:] + r2.hash_ids)) == 16 + 8 + 5
    assert r1.input_tokens == 1500 and r1.output_tokens == 4


def test_a_local_scope_trace_at_another_block_size_keeps_reuse_within_its_sessions(tmp_path) -> None:
    reqs = [{"t": 0, "type": "n", "in": 1024, "out": 4, "hash_ids": [3, 4]},
            {"t": 5, "type": "n", "in": 1600, "out": 4, "hash_ids": [3, 4, 5, 6]}]
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"id": "a", "block_size": 512, "requests": reqs}) + "\n")
    (s,) = wl.load_workload(str(f), 1, 0)
    a, b = s.items
    assert s.block_size == 64 and s.hash_id_scope == "local"
    assert len(a.hash_ids) == 16 and len(b.hash_ids) == 25 and b.hash_ids[:16] == a.hash_ids


def _stage(path: str) -> dict:
    return simulate(SimConfig(model="tiny", gpu="cpu-local", prefill=1, decode=1, prefill_width=1,
                              decode_width=1, concurrency=1, duration=600.0, mtp=False,
                              cpu_offload_gib=0.0, warmup=0.0, clients="closed", workload=path))


def test_a_mooncake_trace_shares_prefixes_across_its_sessions_in_the_simulation(tmp_path) -> None:
    """One client sends the three records in turn: r1 finds r0's 16 blocks on the prefill rank
    (the records are separate sessions, but mooncake ids are global); nothing else is reusable."""
    s = _stage(_write(tmp_path / "mc.jsonl", MOONCAKE))
    assert s["requests_ok"] == 3
    total = 1024 + 1500 + 300
    assert abs(s["reusable_ceiling_ratio"] - 1024 / total) < 1e-9
    assert abs(s["prefill_gpu_hit_rate"] - 1024 / total) < 1e-9


def test_the_cli_simulates_a_mooncake_file_and_names_a_bad_one(tmp_path) -> None:
    import typer

    from agentserve.sim import cli as sim_cli

    app = typer.Typer()
    sim_cli.register(app)
    args = ["sim", "--model", "tiny", "--gpu", "cpu-local", "--topology", "1P1D", "--prefill-width",
            "1", "--decode-width", "1", "--concurrency", "2", "--duration", "30", "--json",
            "--workload"]
    res = CliRunner().invoke(app, args + [_write(tmp_path / "mc.jsonl", MOONCAKE)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["requests_ok"] > 0 and out["output_tokens"] == 4 * out["requests_ok"]
    res = CliRunner().invoke(app, args + [str(tmp_path / "mc.jsonl"), "--max-output", "2"])
    out = json.loads(res.output)  # every record asks for 4 tokens; the cap answers 2
    assert out["requests_ok"] > 0 and out["output_tokens"] == 2 * out["requests_ok"]
    short = [{"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1]}]
    bad = _write(tmp_path / "short.jsonl", short)  # 1,088 tokens of full blocks need 3 ids
    res = CliRunner().invoke(app, args + [bad])
    assert res.exit_code == 2 and "has 1 hash ids; at block size 512 it needs 3" in res.output
    assert bad in res.output


def test_pool_blocks_must_match_the_workloads_blocks() -> None:
    """Hash ids stand for 64-token blocks (or token_scale tokens when scaled): other pool
    blocks would misread every trace, so the config is refused up front."""
    with pytest.raises(ValueError, match="block_size 16 does not match"):
        simulate(SimConfig(model="tiny", gpu="cpu-local", block_size=16, duration=10.0))
    with pytest.raises(ValueError, match="block_size 64 does not match"):
        simulate(SimConfig(model="tiny", gpu="cpu-local", token_scale=16, duration=10.0))


def test_a_token_scaled_mooncake_trace_sends_what_the_bench_sends(tmp_path) -> None:
    """`agentserve bench --token-scale 8` sends 8 tokens per 512-token mooncake block; the
    simulator with the same scale sends as many (until stop 46 it re-blocked the trace to 64
    tokens first and sent 8 per 64: 8x the bench's prompts), and each trace id is one 8-token
    pool block, so r1 still finds r0's prefix."""
    from agentserve.workload.prompts import scaled_length

    path = _write(tmp_path / "mc.jsonl", MOONCAKE)
    s = simulate(SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=1,
                           duration=600.0, mtp=False, cpu_offload_gib=0.0, warmup=0.0,
                           clients="closed", workload=path, token_scale=8, block_size=8))
    bench = [scaled_length(r["input_length"], 512, 8) for r in MOONCAKE]
    assert s["requests_ok"] == 3 and s["input_tokens"] == sum(bench) == 16 + 23 + 5
    assert s["cached_tokens"] == 16  # r0's two ids: two 8-token blocks
    with pytest.raises(ValueError, match="token scale of 64 or less"):
        wl.load_workload(path, 1, 0, token_scale=128)
    assert [s.block_size for s in wl.load_workload(path, 1, 0)] == [64, 64, 64]  # unscaled
