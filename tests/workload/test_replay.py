"""Replay client against the stub streaming server on loopback (real aiohttp on both sides)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stub_server import StubConfig, StubServer  # noqa: E402

from agentserve.workload.record import RequestRecord  # noqa: E402
from agentserve.workload.replay import BenchConfig, BenchRun  # noqa: E402
from agentserve.workload.replay_http import parse_prometheus  # noqa: E402
from agentserve.workload.replay_load import detect_format, mooncake_jobs  # noqa: E402
from agentserve.workload.schema import Session, Subagent, TraceRequest  # noqa: E402


def req(t: float, n_in: int = 64, out: int = 4, api: float = 0.0, hids: list[int] | None = None) -> TraceRequest:
    return TraceRequest(t=t, input_tokens=n_in, output_tokens=out, api_time=api,
                        hash_ids=hids if hids is not None else list(range(-(-n_in // 64))))


@pytest.fixture
async def stub():
    srv = StubServer(StubConfig(ttft=0.01, itl=0.002))
    await srv.start()
    yield srv
    await srv.stop()


def cfg(stub: StubServer, tmp_path: Path, trace: list[Session], **kw) -> BenchConfig:
    kw.setdefault("token_scale", 4)
    return BenchConfig(url=stub.url, trace_sessions=trace, out=str(tmp_path / "out"), progress=False,
                       plots=False, **kw)


async def run(c: BenchConfig) -> BenchRun:
    r = BenchRun(c)
    await r.run()
    return r


def by_turn(records: list[RequestRecord]) -> dict:
    return {(r.turn, r.agent, r.sub_index, r.start): r for r in records}


async def test_fanout_join(stub: StubServer, tmp_path: Path) -> None:
    subs = [Subagent(0.3, [req(0, out=40)]), Subagent(0.3, [req(0, out=2)]), Subagent(0.3, [req(0, out=8)])]
    s = Session("a", 64, [req(0, 128, api=0.1), *subs, req(1.0, 192)])
    r = await run(cfg(stub, tmp_path, [s], gap_scale=0.0))
    main = sorted((x for x in r.records if x.agent == "main"), key=lambda x: x.start)
    sub = [x for x in r.records if x.agent == "sub"]
    assert len(main) == 2 and len(sub) == 3 and all(x.ok for x in r.records)
    starts = [x.start for x in sub]
    assert max(starts) - min(starts) < 0.02  # the group starts together
    assert min(starts) >= main[0].end  # after the turn before it
    assert main[1].start >= max(x.end for x in sub)  # the next turn joins all of them
    assert main[1].start - max(x.end for x in sub) < 0.05
    assert {x.turn for x in sub} == {1} and sorted(x.sub_index for x in sub) == [0, 1, 2]
    ses = r.sessions[0]
    assert ses.complete and ses.requests == 5 and ses.recorded_duration == pytest.approx(1.0)
    assert ses.makespan == pytest.approx(main[1].end - main[0].start, abs=1e-6)


async def test_gap_scale_and_cap(stub: StubServer, tmp_path: Path) -> None:
    s = Session("a", 64, [req(0, api=0.1), req(2.1, api=0.1), req(10.2)])  # recorded gaps 2 s, 10 s
    r = await run(cfg(stub, tmp_path, [s], gap_scale=0.1, gap_cap=0.3))
    a, b, c = sorted(r.records, key=lambda x: x.start)
    assert b.start - a.end == pytest.approx(0.2, abs=0.04)
    assert c.start - b.end == pytest.approx(0.3, abs=0.04)  # 1.0 s capped at 0.3


async def test_closed_loop_sessions_max_turns_and_duration(stub: StubServer, tmp_path: Path) -> None:
    sessions = [Session(f"s{i}", 64, [req(0), req(0.1), req(0.2)]) for i in range(5)]
    r = await run(cfg(stub, tmp_path, sessions, sessions=2, max_turns=2, gap_scale=0.0))
    assert stub.stats.max_in_flight <= 2 and len(r.records) == 10
    assert {x.turn for x in r.records} == {0, 1}
    # A duration bound stops new turns; cut sessions are marked incomplete.
    long = [Session("L", 64, [req(i * 1.0) for i in range(20)])]
    r2 = await run(cfg(stub, tmp_path, long, duration=0.3))
    assert len(r2.records) == 1 and not r2.sessions[0].complete
    assert r2.stages[0]["sessions_complete"] == 0
    # Open loop: sessions start at Poisson times whatever is still running.
    few = [Session(f"o{i}", 64, [req(0)]) for i in range(4)]
    r3 = await run(cfg(stub, tmp_path, few, session_rate=20.0))
    starts = sorted(x.start for x in r3.records)
    assert len(starts) == 4 and starts[-1] - starts[0] > 0.02 and r3.stages[0]["session_rate"] == 20.0


async def test_concurrency_keeps_c_in_flight(stub: StubServer, tmp_path: Path) -> None:
    sessions = [Session(f"s{i}", 64, [req(j, 64 * (j + 1), hids=list(range(j + 1))) for j in range(5)])
                for i in range(3)]
    stub.config.ttft = 0.02
    r = await run(cfg(stub, tmp_path, sessions, mode="concurrency", concurrency=[2, 4], stage_duration=0.4))
    assert [s["concurrency"] for s in r.stages] == [2, 4]
    assert stub.stats.max_in_flight == 4
    for stage, c in ((0, 2), (1, 4)):
        recs = [x for x in r.records if x.stage == stage]
        assert len(recs) > 2 * c
        events = sorted([(x.start, 1) for x in recs] + [(x.end, -1) for x in recs])
        level = peak = 0
        for _, d in events:
            level += d
            peak = max(peak, level)
        assert peak == c
    # Within a session, turn N+1 starts only after turn N ends.
    first = sorted((x for x in r.records if x.stage == 0 and x.session_id == "s0"), key=lambda x: x.start)
    assert all(b.start >= a.end for a, b in zip(first, first[1:]))


async def test_schedule_honours_timestamps(stub: StubServer, tmp_path: Path) -> None:
    recs = [{"timestamp": 1000 + ms, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]}
            for ms in (0, 200, 450)]
    jobs = mooncake_jobs(recs)
    assert [j.at for j in jobs] == pytest.approx([0.0, 0.2, 0.45]) and jobs[0].block_size == 512
    r = await run(cfg(stub, tmp_path, [], mode="schedule", trace_jobs=jobs, token_scale=8))
    starts = sorted(x.start for x in r.records)
    assert [b - starts[0] for b in starts] == pytest.approx([0.0, 0.2, 0.45], abs=0.03)
    arr = stub.stats.arrivals
    assert [a - arr[0] for a in arr] == pytest.approx([0.0, 0.2, 0.45], abs=0.03)
    assert r.records[1].input_tokens == 9  # round(600 * 8 / 512)
    # No timestamps: a session's `delay` (ms) accumulates from its previous request.
    rel = mooncake_jobs([{"session_id": "x", "delay": d, "input_length": 5, "output_length": 1, "hash_ids": [0]}
                         for d in (0, 300, 200)])
    assert [j.at for j in rel] == pytest.approx([0.0, 0.3, 0.5])


async def test_itl_with_multi_token_chunks(stub: StubServer, tmp_path: Path) -> None:
    stub.config.tokens_per_chunk, stub.config.itl = 4, 0.02
    r = await run(cfg(stub, tmp_path, [Session("a", 64, [req(0, out=16)])]))
    rec = r.records[0]
    assert rec.chunk_tokens == [4, 4, 4, 4] and rec.output_tokens == 16
    samples = rec.itl_samples()
    assert len(samples) == 12 and sum(samples) == pytest.approx(rec.chunk_times[-1] - rec.chunk_times[0])
    assert sorted(samples)[6] == pytest.approx(0.005, abs=0.003)  # 20 ms per 4-token chunk
    assert rec.itl_mean() == pytest.approx((rec.e2e - rec.ttft) / 15)


async def test_failures_recorded_with_reason(stub: StubServer, tmp_path: Path) -> None:
    stub.config.fail_every = 2
    s = Session("a", 64, [req(i * 0.01) for i in range(4)])
    r = await run(cfg(stub, tmp_path, [s], gap_scale=0.0))
    bad = [x for x in r.records if not x.ok]
    assert len(r.records) == 4 and len(bad) == 2
    assert all(x.status == 500 and x.error.startswith("HTTP 500: stub: injected failure") for x in bad)
    assert r.stages[0]["requests_failed"] == 2 and r.stages[0]["requests_ok"] == 2
    stub.config.fail_every, stub.config.ttft = 0, 2.0
    r2 = await run(cfg(stub, tmp_path, [Session("b", 64, [req(0)])], request_timeout=0.2))
    assert r2.records[0].error.startswith("timeout after 0.2s")
    dead = BenchConfig(url="http://127.0.0.1:9", model="m", trace_sessions=[Session("c", 64, [req(0)])],
                       out=str(tmp_path / "dead"), progress=False, plots=False)
    with pytest.raises(RuntimeError, match=r"^cannot connect to http://127.0.0.1:9: connection refused$"):
        await run(dead)


async def test_cancel_still_writes_summary(stub: StubServer, tmp_path: Path) -> None:
    s = Session("a", 64, [req(0), req(30.0)])  # the second turn waits 30 s
    c = cfg(stub, tmp_path, [s])
    br = BenchRun(c)
    task = asyncio.create_task(br.run())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert isinstance(summary, list) and summary[0]["requests_ok"] == 1
    assert summary[0]["sessions_complete"] == 0 and summary[0]["interrupted"] is True
    assert (tmp_path / "out" / "requests.jsonl").read_text().count("\n") == 1


def test_parse_prometheus_and_detect(tmp_path: Path) -> None:
    text = ('# HELP x\nvllm:prefix_cache_hits_total{engine="0"} 10.0\nvllm:prefix_cache_hits_total{engine="1"} 5\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:other_total 3\n')
    assert parse_prometheus(text) == {"vllm:prefix_cache_hits": 15.0, "vllm:kv_cache_usage_perc": 0.25}
    w, m = tmp_path / "w.jsonl", tmp_path / "m.jsonl"
    w.write_text(json.dumps({"id": "x", "block_size": 64, "requests": []}) + "\n")
    m.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}) + "\n")
    assert detect_format(str(w)) == "weka" and detect_format(str(m)) == "mooncake"


async def test_session_id_in_body_and_header(tmp_path: Path) -> None:
    """Every request names its agent session (`user` + `x-session-id`), chat and completions."""
    from aiohttp import web

    seen: list[str | None] = []

    @web.middleware
    async def grab(request: web.Request, handler):
        if request.path.startswith("/v1/") and request.method == "POST":
            seen.append(request.headers.get("x-session-id"))
        return await handler(request)

    srv = StubServer(StubConfig(ttft=0.001, itl=0.001), keep_bodies=True)
    srv.app.middlewares.append(grab)
    await srv.start()
    try:
        subs = [Subagent(0.0, [req(0)])]
        trace = [Session("a", 64, [req(0), *subs, req(0.1)]), Session("b", 64, [req(0)])]
        for api in ("completions", "chat"):
            srv.stats.bodies.clear()
            seen.clear()
            await run(cfg(srv, tmp_path, trace, sessions=2, gap_scale=0.0, api=api))
            users = sorted(b["user"] for b in srv.stats.bodies)
            assert users == ["0/a", "0/a", "0/a", "0/b"]  # sub-agents belong to their session
            assert sorted(seen) == users
    finally:
        await srv.stop()
