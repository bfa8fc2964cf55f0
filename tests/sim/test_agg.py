"""Aggregated ("both") engines: mixed prefill/decode steps, prefix reuse, measured step model."""

from __future__ import annotations

from agentserve.sim.memory import Topology
from agentserve.sim.perf import PerfModel
from agentserve.sim.run import SimConfig, parse_topology, simulate
from agentserve.sim.specs import cpu_local, model_spec
from agentserve.workload.schema import Session, TraceRequest

PROFILE = {"tok_s": 1e-4, "step_overhead_s": 5e-3, "per_seq_s": 5e-4, "attn_prefill_s": 1e-7,
           "attn_decode_s": 1e-6, "request_overhead_s": 0.0}


def _sessions(n: int, turns: int = 3, blocks: int = 8) -> list[Session]:
    out = []
    for i in range(n):
        items, ids = [], list(range(blocks))
        for t in range(turns):
            items.append(TraceRequest(t=float(t), input_tokens=len(ids) * 64, output_tokens=20,
                                      hash_ids=list(ids)))
            ids += [len(ids), len(ids) + 1]
        out.append(Session(id=f"s{i}", block_size=64, items=items))
    return out


def _hw(tmp_path, monkeypatch, **kw):
    import json

    f = tmp_path / "p.json"
    f.write_text(json.dumps({**PROFILE, **kw}))
    monkeypatch.setenv("AGENTSERVE_SIM_CPU_PROFILE", str(f))


def test_parse_aggregated_topology() -> None:
    assert parse_topology("2") == (0, 2)
    assert parse_topology("3P1D") == (3, 1)


def test_measured_step_is_linear(tmp_path, monkeypatch) -> None:
    _hw(tmp_path, monkeypatch)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    assert perf.linear
    t = perf.measured_step([(100, 0)], decode_ctx=1000.0, decode_n=2)
    want = 5e-3 + 3 * 5e-4 + 102 * 1e-4 + 1e-7 * 100 * 50 + 1e-6 * 1000
    assert abs(t - want) < 1e-12


def test_aggregated_closed_loop(tmp_path, monkeypatch) -> None:
    _hw(tmp_path, monkeypatch, request_overhead_s=0.01)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=2, concurrency=4, duration=60.0,
                    mtp=False, cpu_offload_gib=0, chunk=256, block_size=16, token_scale=16,
                    kv_tokens=20_000, max_output=10, join_midway=False)
    s = simulate(cfg, iter(_sessions(200)))
    assert s["requests_ok"] > 20 and s["gpus"] == 2
    assert s["ttft_s"]["p50"] >= 0.01  # the request overhead is in TTFT
    assert s["output_tokens"] == 10 * s["requests_ok"]  # capped outputs, 1 token per step
    assert s["prefill_gpu_hit_rate"] > 0.3  # later turns reuse the earlier turns' blocks


def test_aggregated_preempts_when_blocks_run_out(tmp_path, monkeypatch) -> None:
    _hw(tmp_path, monkeypatch)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=8, duration=30.0,
                    mtp=False, cpu_offload_gib=0, chunk=512, block_size=16, token_scale=16,
                    kv_tokens=16 * 40, max_output=60, join_midway=False)
    s = simulate(cfg, iter(_sessions(200, blocks=4)))
    assert s["requests_ok"] > 0 and s["preemptions"] > 0
