"""`agentserve bench` as AIPerf users drive it: synthetic lengths without a trace, a request
count, warm-up requests left out of the figures, progress lines when not on a terminal, the
GPUs behind a router, and a one-line error for a URL nobody listens on."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import typer
from aiohttp import web
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stub_server import StubConfig, StubServer  # noqa: E402

from agentserve.cluster.procs import free_port  # noqa: E402
from agentserve.workload.cli_bench import register_bench  # noqa: E402
from agentserve.workload.replay import BenchConfig, BenchRun  # noqa: E402
from agentserve.workload.replay_progress import TaskProgress  # noqa: E402
from agentserve.workload.schema import Session, TraceRequest  # noqa: E402


def _app() -> typer.Typer:
    app = typer.Typer()
    register_bench(app)
    app.command("other")(lambda: None)  # keeps `bench` a sub-command, as in agentserve
    return app


def _bench(*args: str):
    return CliRunner().invoke(_app(), ["bench", *args], env={"COLUMNS": "200"})


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_synthetic_counts_and_warmup_excluded(stub_thread: StubServer, tmp_path: Path,
                                              api: str) -> None:
    out = tmp_path / "o"
    res = _bench("--url", stub_thread.url, "--isl", "100", "--isl-stddev", "10", "--osl", "8",
                 "--request-count", "12", "--concurrency", "3", "--warmup-requests", "4",
                 "--api", api, "--out", str(out))
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert len(recs) == 12 and all(r["stage"] == 0 and r["max_tokens"] == 8 for r in recs)
    assert stub_thread.stats.requests == 16  # the 4 warm-up requests were sent, not recorded
    asked = [r["requested_input_tokens"] for r in recs]
    assert len(set(asked)) > 1 and 85 < statistics.mean(asked) < 115  # N(100, 10)
    assert [r["input_tokens"] for r in recs] == asked  # the stub counts what it got
    [st] = json.loads((out / "summary.json").read_text())
    assert st["requests_ok"] == 12 and st["mode"] == "concurrency" and st["concurrency"] == 3


def test_aiperf_spellings(stub_thread: StubServer, tmp_path: Path) -> None:
    out = tmp_path / "o"
    res = _bench("--url", stub_thread.url, "--synthetic-input-tokens-mean", "50",
                 "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", "4",
                 "--output-tokens-stddev", "0", "--request-count", "5", "--warmup-request-count", "2",
                 "--random-seed", "3", "--concurrency", "2", "--out", str(out))
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert len(recs) == 5 and {r["input_tokens"] for r in recs} == {50}
    assert {r["output_tokens"] for r in recs} == {4} and stub_thread.stats.requests == 7


@pytest.mark.parametrize("flags, message", [
    ([], "no workload: pass --trace FILE, or --isl N"),
    (["--trace", "x.jsonl", "--isl", "10"], "not both"),
    (["--isl", "10", "--mode", "schedule"], "--mode schedule replays a trace"),
    (["--isl", "0"], "--isl must be >= 1"),
])
def test_workload_flag_errors(stub_thread: StubServer, tmp_path: Path, flags: list[str],
                              message: str) -> None:
    res = _bench("--url", stub_thread.url, "--out", str(tmp_path / "o"), *flags)
    assert res.exit_code == 2 and message in res.output, res.output


def test_refused_connection_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    res = _bench("--url", f"http://127.0.0.1:{port}", "--isl", "10", "--out", str(tmp_path / "o"))
    assert res.exit_code != 0
    assert res.output.strip() == f"bench: cannot connect to http://127.0.0.1:{port}: connection refused"


async def test_progress_lines_when_not_a_terminal(tmp_path: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    srv = StubServer(StubConfig(ttft=0.02, itl=0.01))
    await srv.start()
    try:
        trace = [Session(f"s{i}", 64, [TraceRequest(0.0, 64, 10, hash_ids=[i])]) for i in range(4)]
        c = BenchConfig(url=srv.url, trace_sessions=trace, mode="concurrency", concurrency=[2],
                        stage_duration=0.8, out=str(tmp_path / "o"), plots=False,
                        progress_interval=0.2)
        await BenchRun(c).run()
    finally:
        await srv.stop()
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("bench: concurrency")]
    assert len(lines) >= 2, lines  # ~4 in 0.8 s; none would be printed before
    assert "concurrency=2:" in lines[-1] and " done, 0 failed, TTFT p50 " in lines[-1]
    assert int(lines[-1].split(": ")[2].split()[0]) > 0  # requests done so far


@web.middleware
async def _router_health(request: web.Request, handler):
    if request.path == "/health":  # our router's shape: the engines it routes to
        return web.json_response({"status": "ok", "healthy": ["http://a", "http://b"],
                                  "unhealthy": ["http://c"]})
    return await handler(request)


@pytest.mark.parametrize("router", [False, True])
async def test_gpus_from_a_router_health(tmp_path: Path, router: bool) -> None:
    srv = StubServer(StubConfig(ttft=0.001, itl=0.001))
    if router:
        srv.app.middlewares.append(_router_health)
    await srv.start()
    trace = [Session("s", 64, [TraceRequest(0.0, 64, 2, hash_ids=[0])])]

    async def gpus(**kw) -> tuple[int, str]:
        r = BenchRun(BenchConfig(url=srv.url, trace_sessions=trace, out=str(tmp_path / "o"),
                                 plots=False, progress=False, **kw))
        await r.run()
        return r.stages[0]["gpus"], r.stages[0]["gpus_from"]

    try:
        n, why = await gpus()
        if router:
            assert n == 3 and why == "router /health lists 3 engine(s)"
        else:  # the stub's /health is plain text: nothing to count
            assert (n, why) == (1, "assumed (pass --gpus)")
        assert await gpus(gpus=8) == (8, "--gpus")
    finally:
        await srv.stop()


def test_task_progress_lines(capfd: pytest.CaptureFixture[str]) -> None:
    """`plan` and `sim --seeds` off a terminal: a line at most every interval, and the last."""
    with TaskProgress(3, "plan: simulations", interval=3600) as p:
        for _ in range(3):
            p.advance()
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: simulations: 3/3 done, ")
    with TaskProgress(2, "sim: runs", interval=0) as p:
        p.advance()
        p.advance()
    lines = capfd.readouterr().err.splitlines()
    assert [x.split(",")[0] for x in lines] == ["sim: runs: 1/2 done", "sim: runs: 2/2 done"]
    assert "s left" in lines[0]


@web.middleware
async def _no_tokenize(request: web.Request, handler):
    if request.path == "/tokenize":
        raise web.HTTPNotFound()
    return await handler(request)


async def test_chat_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    srv = StubServer(StubConfig(ttft=0.001, itl=0.001))
    srv.app.middlewares.append(_no_tokenize)
    await srv.start()
    trace = [Session("s", 64, [TraceRequest(0.0, 64, 2, hash_ids=[0])])]
    try:
        c = BenchConfig(url=srv.url, trace_sessions=trace, api="chat", out=str(tmp_path / "o"),
                        plots=False, progress=False)
        with pytest.raises(RuntimeError, match=r"has no /tokenize \(HTTP 404\).*pass --tokenizer"):
            await BenchRun(c).run()
        assert srv.stats.requests == 0  # nothing sent with a guessed length
        c.tokenizer = str(tmp_path)  # not a tokenizer
        with pytest.raises(ValueError, match="neither a .gguf file nor a folder with tokenizer.json"):
            await BenchRun(c).run()
    finally:
        await srv.stop()


def test_warmup_in_schedule_mode(stub_thread: StubServer, tmp_path: Path) -> None:
    mc = [{"timestamp": ms, "input_length": 256, "output_length": 3, "hash_ids": [0]}
          for ms in (0, 20, 40)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    out = tmp_path / "o"
    res = _bench("--url", stub_thread.url, "--trace", str(tmp_path / "m.jsonl"), "--mode",
                 "schedule", "--warmup-requests", "2", "--out", str(out))
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert len(recs) == 3 and stub_thread.stats.requests == 5
    # salted apart: the warm-up did not pre-fill the measured prompts' cache
    assert recs[0]["cached_tokens"] == 0


def test_a_served_count_off_the_asked_is_flagged(stub_thread: StubServer, tmp_path: Path) -> None:
    """--tokenizer names the tiny model's tokenizer (its template adds 27 tokens) while the stub
    counts content words only: each prompt is served 27 short, and bench says so."""
    from agentserve.engine.model.tiny import default_model_dir

    out = tmp_path / "o"
    res = _bench("--url", stub_thread.url, "--isl", "100", "--osl", "2", "--request-count", "3",
                 "--api", "chat", "--tokenizer", str(default_model_dir()), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert {(r["requested_input_tokens"], r["input_tokens"]) for r in _records(out)} == {(100, 73)}
    assert "the server counted 0.730x the input tokens asked" in res.stderr
