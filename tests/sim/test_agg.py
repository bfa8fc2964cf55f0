"""Aggregated ("both") engines: mixed prefill/decode steps, prefix reuse, measured step model."""

from __future__ import annotations

import pytest

from agentserve.sim.agg import AggInstance
from agentserve.sim.cluster import Clock, Rank, SimRequest
from agentserve.sim.memory import Topology
from agentserve.sim.perf import PerfModel, interp
from agentserve.sim.run import SimConfig, Simulation, parse_topology, simulate
from agentserve.sim.specs import cpu_local, model_spec
from agentserve.workload.record import RequestRecord
from agentserve.workload.schema import Session, TraceRequest

PROFILE = {"tok_s": 1e-4, "step_overhead_s": 5e-3, "per_seq_s": 5e-4, "attn_prefill_s": 1e-7,
           "attn_cold_s": 5e-8, "attn_decode_s": 1e-6, "request_overhead_s": 0.0,
           "cached_prefill": "in_place"}


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
    want = 5e-3 + 3 * 5e-4 + 102 * 1e-4 + 5e-8 * 100 * 100 / 2 + 1e-6 * 1000
    assert abs(t - want) < 1e-12


def test_measured_decode_steps_are_interpolated_in_batch_size(tmp_path, monkeypatch) -> None:
    """With measured decode steps per batch size, a step between them is interpolated, and
    context beyond the calibration's is charged per token; prefill chunks add their terms."""
    _hw(tmp_path, monkeypatch, decode_step_s={"1": 4e-3, "2": 7e-3, "4": 10e-3}, decode_ref_ctx=1000)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    assert perf.measured_step([], decode_ctx=2 * 1500.0, decode_n=2) == pytest.approx(7e-3 + 1e-6 * 1000)
    assert perf.measured_step([], decode_ctx=3 * 1000.0, decode_n=3) == pytest.approx(8.5e-3)
    assert perf.measured_step([], decode_ctx=6 * 1000.0, decode_n=6) == pytest.approx(13e-3)  # last slope
    with_chunk = perf.measured_step([(100, 0)], decode_ctx=2 * 1000.0, decode_n=2)
    assert with_chunk == pytest.approx(7e-3 + 5e-4 + 100 * 1e-4 + 5e-8 * 100 * 100 / 2)


def test_prefill_over_a_cached_prefix_adds_its_scores_and_one_read(tmp_path, monkeypatch) -> None:
    _hw(tmp_path, monkeypatch)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    cold = perf.measured_step([(100, 0)], decode_ctx=0.0, decode_n=0)
    warm = perf.measured_step([(100, 900)], decode_ctx=0.0, decode_n=0)
    # the chunk's queries by the prefix and one read of the prefix (in place, nothing
    # gathered); the chunk's own triangle as before
    assert warm - cold == pytest.approx(1e-7 * 100 * 900 + 1e-6 * 900)


def test_engine_reuses_whole_blocks_of_its_own_size(tmp_path, monkeypatch) -> None:
    """With 2-token trace blocks and a 16-token engine block, every reused prefix is a
    multiple of 16 tokens, and less is reused than at 2-token granularity."""
    _hw(tmp_path, monkeypatch)
    out = {}
    for eb in (None, 16):
        cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=2, duration=30.0,
                        mtp=False, cpu_offload_gib=0, chunk=512, block_size=2, token_scale=2,
                        kv_tokens=20_000, max_output=4, join_midway=False, engine_block_tokens=eb)
        sim = Simulation(cfg, iter(_sessions(40, turns=4, blocks=9)))
        sim.run()
        out[eb] = [r.cached_tokens for r in sim.records if r.cached_tokens]
    assert out[16] and all(c % 16 == 0 for c in out[16])
    assert any(c % 16 for c in out[None])
    assert sum(out[16]) / len(out[16]) < sum(out[None]) / len(out[None])


@pytest.mark.parametrize(("short", "keys"), [(2_500, 2 * 3_000), (100, 3_000 + 100)])
def test_decode_attention_reads_each_group_padded_to_its_longest_context(tmp_path, monkeypatch,
                                                                          short, keys) -> None:
    """The engine's decode SDPA runs per group of similar contexts, over a block table padded
    to the group's longest: 2,500 beside 3,000 share a call (2 x 3,000 keys read); 100 beside
    3,000 get their own (3,100), as kv/decode_groups.py groups them."""
    step = _decode_step(tmp_path, monkeypatch, 16, [([], short), ([], 3_000)])
    assert step == pytest.approx(keys * 1e-6)


def _decode_step(tmp_path, monkeypatch, block_size: int, decodes: list[tuple[list[int], int]],
                 engine_block: int | None = None) -> float:
    """One step of an aggregated engine whose running requests (hashes, input tokens) all
    decode, priced at 1 us per key their attention reads and nothing else."""
    _hw(tmp_path, monkeypatch, step_overhead_s=0.0, per_seq_s=0.0, tok_s=0.0, attn_prefill_s=0.0,
        attn_cold_s=0.0, attn_decode_s=1e-6)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    rank = Rank(0, 2_000, 0, block_size)
    inst = AggInstance(Clock(), perf, rank, budget=256, max_seqs=8, engine_block=engine_block)
    for i, (hashes, n_in) in enumerate(decodes):
        req = SimRequest(rec=RequestRecord(request_id=f"r{i}", session_id=f"s{i}", turn=0),
                         hashes=hashes, n_in=n_in, n_out=10, on_done=lambda r: None)
        req.computed, req.rank = n_in, rank
        req.blocks = rank.pool.allocate(n_in // block_size + 1)
        rank.running.append(req)
    steps: list[float] = []
    monkeypatch.setattr(inst, "_run", lambda dt, done: steps.append(dt))
    inst._step()
    assert len(steps) == 1
    return steps[0]


@pytest.mark.parametrize(("head", "engine_block", "keys"), [
    (2_000, 16, 2_000 + 2 * 500),  # 2,000 shared tokens read once, then 500 each
    (2_000, 1_536, 1_536 + 2 * 964),  # in whole engine blocks: 1,536 of them
    (2_000, 2_048, 2 * 2_500),  # not one whole engine block shared
    (800, 16, 2 * 1_300),  # too short to read once (MIN_SHARED_TOKENS)
])
def test_decodes_sharing_a_prefix_read_it_once(tmp_path, monkeypatch, head, engine_block, keys
                                                ) -> None:
    """Two decodes whose inputs start with the same block hashes (a sub-agent burst) read that
    prefix once, as the engine's cascade attention does (kv/decode_groups.py), in whole
    engine blocks and only from MIN_SHARED_TOKENS up."""
    n_in = head + 500
    decodes = [((list(range(head // 4)) + [10_000 * (i + 1) + j for j in range(125)])[: n_in // 4],
                n_in) for i in range(2)]
    assert _decode_step(tmp_path, monkeypatch, 4, decodes, engine_block) == pytest.approx(keys * 1e-6)


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


def test_closed_stage_counts_what_it_sent_and_drains_as_the_bench(tmp_path, monkeypatch) -> None:
    """Closed clients stop sending at the window's end and the requests in flight drain; the
    stage counts what was sent in the window, over the window and its drain, as `agentserve
    bench`'s concurrency stages do (and AIPerf's fixed-duration ones)."""
    _hw(tmp_path, monkeypatch)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=4, duration=5.0,
                    mtp=False, cpu_offload_gib=0, chunk=256, block_size=16, token_scale=16,
                    kv_tokens=20_000, join_midway=False)
    sim = Simulation(cfg, iter(_sessions(50)))
    s = sim.run()
    assert all(r.start < 5.0 for r in sim.records)  # nothing sent from the deadline on
    late = [r for r in sim.records if r.end > 5.0]
    assert late and all(r.error is None for r in late)  # in flight at the deadline: answered
    assert s["requests_ok"] == len(sim.records)  # ...and counted
    assert s["duration_s"] == pytest.approx(max(r.end for r in sim.records))  # the drain too
    assert s["output_tokens"] == 20 * s["requests_ok"]  # whole answers, the late ones too


def test_closed_clients_send_a_session_in_the_bench_order() -> None:
    """An aggregated closed client replays a session as `agentserve bench --mode concurrency`
    does: each sub-agent's calls back to back before the next sub-agent's, not interleaved by
    time as `flatten` orders them for xPyD closed clients."""
    from agentserve.sim.sessions import bench_order, flatten
    from agentserve.workload.replay_plan import session_jobs
    from agentserve.workload.schema import Subagent

    def req(t: float, n: int) -> TraceRequest:
        return TraceRequest(t=t, input_tokens=n * 64, output_tokens=5, hash_ids=list(range(n)))

    subs = [Subagent(t=1.0, requests=[req(0.0, 2), req(2.0, 3)]),
            Subagent(t=1.0, requests=[req(1.0, 4), req(3.0, 5)])]
    s = Session(id="x", block_size=64, items=[req(0.0, 1), *subs, req(9.0, 6)])
    got = [(a, r.input_tokens // 64) for _, a, r in bench_order(s)]
    assert got == [("main", 1), ("sub", 2), ("sub", 3), ("sub", 4), ("sub", 5), ("main", 6)]
    assert [r for _, _, r in bench_order(s)] == [j.req for j in session_jobs(s)]
    assert [r.input_tokens // 64 for _, _, r in flatten(s)] == [1, 2, 4, 3, 5, 6]  # by time


def test_aggregated_preempts_when_blocks_run_out(tmp_path, monkeypatch) -> None:
    _hw(tmp_path, monkeypatch)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=8, duration=30.0,
                    mtp=False, cpu_offload_gib=0, chunk=512, block_size=16, token_scale=16,
                    kv_tokens=16 * 40, max_output=60, join_midway=False)
    s = simulate(cfg, iter(_sessions(200, blocks=4)))
    assert s["requests_ok"] > 0 and s["preemptions"] > 0


def test_queue_lengths_are_sampled_over_the_window(tmp_path, monkeypatch) -> None:
    """`queue_lengths`: 8 closed clients on an engine with 2 seats keep ~6 waiting at every
    sample of the window; with 8 seats none wait. The end-of-run snapshot (`queue`) is 0 in
    both: it says nothing of the stage."""
    _hw(tmp_path, monkeypatch)
    out = {}
    for seats in (2, 8):
        cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=8,
                        duration=30.0, mtp=False, cpu_offload_gib=0, max_seqs=seats,
                        max_output=40, join_midway=False)
        out[seats] = simulate(cfg, iter(_sessions(200, blocks=4)))
    busy, free = (out[k]["queue_lengths"] for k in (2, 8))
    assert busy["samples"] == free["samples"] == 30 and busy["sample_s"] == 1.0
    assert 5.0 <= busy["engines"]["mean"] <= 6.0 and busy["engines"]["max"] == 6.0
    assert free["engines"] == {"mean": 0.0, "p90": 0.0, "max": 0.0}
    assert out[2]["queue"] == out[8]["queue"] == 0


def test_requests_over_a_head_being_computed_wait_for_it(tmp_path, monkeypatch) -> None:
    """As the engine (kv/inflight.py, the same class): three requests over one uncached 320-token head,
    admitted together, compute it once; the two that waited hit it in the cache."""
    _hw(tmp_path, monkeypatch)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    rank = Rank(0, 1_000, 0, 16)
    clock = Clock()
    inst = AggInstance(clock, perf, rank, budget=512, max_seqs=8)
    done: list[SimRequest] = []
    for i in range(3):
        hashes = list(range(20)) + [100 * (i + 1) + j for j in range(3)]  # 20 shared blocks
        rec = RequestRecord(request_id=f"r{i}", session_id=f"s{i}", turn=0)
        req = SimRequest(rec=rec, hashes=hashes, n_in=23 * 16 + 5, n_out=2, on_done=done.append)
        rank.waiting.append(req)
    inst.kick()
    clock.run(100.0)
    assert len(done) == 3 and sorted(r.cached for r in done) == [0, 320, 320]
    assert inst.joined_tokens == 2 * 320 and not inst._parked and not inst.inflight.owner


def test_cold_and_cached_chunks_cost_their_own_attention(tmp_path, monkeypatch) -> None:
    """Every chunk runs the engine's causal kernel over itself (the lower triangle,
    `attn_cold_s`); a chunk over a cached prefix adds the unmasked pass over the prefix, read
    in place (`attn_prefill_s` x its queries by the prefix, `attn_decode_s` per prefix token
    read; nothing gathered)."""
    _hw(tmp_path, monkeypatch, step_overhead_s=0.0, per_seq_s=0.0, tok_s=0.0, attn_prefill_s=1e-8,
        attn_cold_s=1e-7, attn_decode_s=1e-6)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    assert perf.measured_step([(100, 0)], 0.0, 0) == pytest.approx(1e-7 * 100 * 100 / 2)
    assert perf.measured_step([(100, 1_000)], 0.0, 0) == pytest.approx(
        1e-7 * 100 * 100 / 2 + 1e-8 * 100 * 1_000 + 1e-6 * 1_000)


def test_profile_of_an_older_prefill_kernel_is_refused(tmp_path, monkeypatch) -> None:
    """A profile fitted when a cached prefill ran masked over a gathered copy states its
    `attn_prefill_s` per score of that kernel: refused, not misread."""
    import json

    f = tmp_path / "old.json"
    f.write_text(json.dumps({k: v for k, v in PROFILE.items() if k != "cached_prefill"}))
    monkeypatch.setenv("AGENTSERVE_SIM_CPU_PROFILE", str(f))
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    with pytest.raises(ValueError, match="sim_calibrate_cpu"):
        perf.measured_step([(100, 0)], 0.0, 0)


def test_a_busy_engine_slows_its_api_server(tmp_path, monkeypatch) -> None:
    """Our engine's API server shares its process with the core thread: the profile's
    `request_overhead_busy_s` (measured under load by the server calibration) delays a request
    whose engine is stepping, and only then. Without it the run is the same as before."""
    def run(**kw):
        _hw(tmp_path, monkeypatch, **kw)
        cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=2, concurrency=4, duration=60.0,
                        mtp=False, cpu_offload_gib=0, chunk=256, block_size=16, token_scale=16,
                        kv_tokens=20_000, max_output=10, join_midway=False)
        sim = Simulation(cfg, iter(_sessions(200)))
        return sim.run(), sim
    base, _ = run()
    assert run(request_overhead_busy_s=0.0)[0]["ttft_s"] == base["ttft_s"]
    busy, sim = run(request_overhead_busy_s=0.01)
    assert all(a.busy_wait == (0.01, 0.0) for a in sim.aggs)
    # at concurrency 4 on 2 engines most requests meet a stepping engine: 10 ms more, and the
    # step boundary it may then miss (steps here ~6-7 ms)
    assert base["ttft_s"]["p50"] + 0.005 < busy["ttft_s"]["p50"] < base["ttft_s"]["p50"] + 0.02
    # since stop 49 also per prompt token (`request_overhead_busy_per_token_s`): the same 10 ms
    # for a prompt of 1,000 tokens, more for longer ones, nothing for a profile without it
    assert run(request_overhead_busy_per_token_s=0.0)[0]["ttft_s"] == base["ttft_s"]
    per_token, sim = run(request_overhead_busy_per_token_s=1e-5)
    assert all(a.busy_wait == (0.0, 1e-5) for a in sim.aggs)
    n_in = sorted(r.input_tokens for r in sim.records)
    lo, hi = 1e-5 * n_in[len(n_in) // 4], 1e-5 * n_in[-1]  # 1.3-1.9 ms here
    # its own delay, and the step boundary it may then miss (steps here ~6-7 ms)
    assert base["ttft_s"]["p50"] + lo / 2 < per_token["ttft_s"]["p50"]
    assert per_token["ttft_s"]["p50"] < base["ttft_s"]["p50"] + hi + 0.01


def test_requests_reaching_a_stepping_engine_stretch_its_step(tmp_path, monkeypatch) -> None:
    """A profile's `arrival_stretch_s` (+ `_per_token_s` x prompt tokens; opt-in, the
    calibration records its measurement under other names): each request that reaches an
    engine while a step is in flight makes that step end that much later (its handling took
    the GIL from the core thread), however many arrive during it, and a request reaching an
    idle engine stretches nothing. Without the keys the run is as before."""
    _hw(tmp_path, monkeypatch)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=1, concurrency=1, duration=60.0,
                    mtp=False, cpu_offload_gib=0, chunk=2048, kv_tokens=20_000, max_output=50,
                    join_midway=False)

    def steps_with(arrivals: list[tuple[float, int]], **kw) -> tuple[list[float], list]:
        """Step ends on one engine: a 640-token prompt at 0, then `arrivals` (time, tokens)."""
        _hw(tmp_path, monkeypatch, **kw)
        sim = Simulation(cfg, iter([]))
        agg = sim.aggs[0]
        ends: list[float] = []
        done = agg._done
        monkeypatch.setattr(agg, "_done", lambda plan: (ends.append(sim.clock.now), done(plan)))
        for i, (t, n) in enumerate([(0.0, 640), *arrivals]):
            tr = TraceRequest(t=t, input_tokens=n, output_tokens=50,
                              hash_ids=[100 * i + j for j in range(n // 64)])
            sim.clock.at(t, lambda i=i, tr=tr: agg.arrive(SimRequest(
                RequestRecord(f"r{i}", f"s{i}", 0, "main", start=sim.clock.now,
                              input_tokens=tr.input_tokens, max_tokens=50),
                [100 * i + j for j in range(tr.input_tokens // 64)], tr.input_tokens, 50,
                lambda q: None)))
        sim.clock.run(0.2)
        return ends, sim.aggs
    base, _ = steps_with([])
    assert steps_with([], arrival_stretch_s=0.0)[0] == base  # the key at 0: nothing moves
    # the prompt's step (~70 ms here: 640 tokens at 0.1 ms) ends 2 ms + 1 us a token later for
    # each of two requests arriving during it; the steps after it keep their own lengths
    first = base[0]
    ends, aggs = steps_with([(first / 2, 64), (first * 0.9, 128)], arrival_stretch_s=0.002,
                            arrival_stretch_per_token_s=1e-6)
    assert aggs[0].stretch == (0.002, 1e-6)
    assert ends[0] == pytest.approx(first + 0.004 + 1e-6 * (64 + 128), abs=1e-9)
    # a request reaching the engine after the first step, between steps (it is idle only if
    # nothing runs; here the 640-token request decodes on): it stretches that decode step
    late, _ = steps_with([(first + 1e-4, 64)], arrival_stretch_s=0.002)
    assert late[0] == pytest.approx(first, abs=1e-9) and late[1] - late[0] > base[1] - base[0] + 0.0019
    # the engine idle when the request arrives: nothing to stretch
    idle, _ = steps_with([], arrival_stretch_s=0.002)
    assert idle[0] == pytest.approx(first, abs=1e-9)


def test_a_burst_reaches_the_engines_in_its_order_spaced_by_its_prompts(tmp_path,
                                                                      monkeypatch) -> None:
    """Requests sent at one instant go through the client, the router and the API servers one
    at a time: in the order sent (a short prompt does not overtake a long one), each waiting
    for the per-token work of those before it; the fixed part is latency each pays alone, and
    a request sent alone pays the whole path as before."""
    _hw(tmp_path, monkeypatch, request_overhead_s=0.01, request_overhead_per_token_s=1e-5)
    cfg = SimConfig(model="tiny", gpu="cpu-local", aggregated=2, concurrency=1, duration=60.0,
                    mtp=False, cpu_offload_gib=0, chunk=2048, kv_tokens=20_000, max_output=4,
                    join_midway=False)
    sim = Simulation(cfg, iter([]))
    reached: list[tuple[float, int]] = []
    route = sim._route_agg
    monkeypatch.setattr(sim, "_route_agg", lambda req: (reached.append((sim.clock.now, req.n_in)),
                                                        route(req)))

    def send(n: int, i: int) -> None:
        tr = TraceRequest(t=0.0, input_tokens=n, output_tokens=4,
                          hash_ids=[100 * i + j for j in range(n // 64)])
        sim._send(i, f"s{i}", 0, "main", tr, 64, lambda ok: None)
    for i, n in enumerate((640, 64, 320)):  # a burst, long prompt first
        send(n, i)
    sim.clock.run(1.0)
    send(128, 3)  # alone, later
    sim.clock.run(2.0)
    assert [n for _, n in reached] == [640, 64, 320, 128]
    expect = [0.01 + 6.4e-3, 0.01 + 6.4e-3 + 0.64e-3, 0.01 + 6.4e-3 + 0.64e-3 + 3.2e-3,
              1.0 + 0.01 + 1.28e-3]
    assert [t for t, _ in reached] == pytest.approx(expect)
    assert len(sim.records) == 4 and all(r.error is None for r in sim.records)


def test_a_short_context_curve_gives_each_small_batch_its_own_context_slope(tmp_path, monkeypatch
                                                                            ) -> None:
    """With decode steps measured at a short context as well, a batch below 8 pays context
    below the reference context at its own measured slope, batch 8 and up (and every batch
    above the reference) at `attn_decode_s`; a profile without them is priced as before."""
    curve = {"1": 4e-3, "2": 7e-3, "4": 10e-3, "8": 20e-3}
    _hw(tmp_path, monkeypatch, decode_step_s=curve, decode_ref_ctx=1000,
        decode_step_short_s={"1": 3.8e-3, "2": 6.4e-3, "4": 9.6e-3}, decode_short_ctx=200)
    perf = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    # batch 2: (7 - 6.4) ms over 2 x 800 tokens = 3.75e-7 s a token, not 1e-6
    assert perf.measured_step([], decode_ctx=2 * 200.0, decode_n=2) == pytest.approx(6.4e-3)
    assert perf.measured_step([], decode_ctx=2 * 600.0, decode_n=2) == pytest.approx(
        7e-3 - 3.75e-7 * 800)
    # above the reference context every batch reads at attn_decode_s (stop 48: the small
    # batches' short-context slope there put the closed-loop check's output 6-12% higher)
    assert perf.measured_step([], decode_ctx=2 * 1500.0, decode_n=2) == pytest.approx(
        7e-3 + 1e-6 * 1000)
    assert perf.measured_step([], decode_ctx=8 * 200.0, decode_n=8) == pytest.approx(
        20e-3 - 1e-6 * 8 * 800)  # batch 8: the profile's attn_decode_s
    assert perf.measured_step([], decode_ctx=16 * 200.0, decode_n=16) == pytest.approx(
        interp([(4, 10e-3), (8, 20e-3)], 16) - 1e-6 * 16 * 800)
    (tmp_path / "old").mkdir()
    _hw(tmp_path / "old", monkeypatch, decode_step_s=curve, decode_ref_ctx=1000)
    old = PerfModel(model_spec("tiny"), cpu_local(), Topology("dep", 1, "decode"))
    assert old.measured_step([], decode_ctx=2 * 200.0, decode_n=2) == pytest.approx(7e-3 - 1e-6 * 1600)
