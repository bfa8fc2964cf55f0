"""Stage summaries, output files and the CLI, on hand-checkable cases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stub_server import StubConfig, StubServer  # noqa: E402

from agentserve.workload.cli_bench import register_bench  # noqa: E402
from agentserve.workload.record import RequestRecord, SessionRecord  # noqa: E402
from agentserve.workload.replay import BenchConfig, BenchRun  # noqa: E402
from agentserve.workload.report import summarize, write_outputs  # noqa: E402
from agentserve.workload.schema import Session, TraceRequest  # noqa: E402

KEYS = {"duration_s", "requests_ok", "requests_failed", "ttft_s", "itl_ms", "e2e_s", "output_tok_s",
        "input_tok_s", "output_tok_s_per_user", "cached_token_ratio", "reusable_ceiling_ratio",
        "captured_reuse", "server_metrics"}


def rec(i: int, ttft: float, e2e: float, out: int, n_in: int, cached: int, reusable: int,
        error: str | None = None) -> RequestRecord:
    return RequestRecord(f"r{i}", "s", i, start=float(i), ttft=ttft, e2e=e2e, output_tokens=out,
                         input_tokens=n_in, cached_tokens=cached, reusable_tokens=reusable, error=error,
                         chunk_times=[ttft, e2e], chunk_tokens=[1, out - 1])


def test_summarize_hand_checked() -> None:
    records = [rec(0, 1.0, 3.0, 11, 1000, 0, 0), rec(1, 2.0, 4.0, 21, 2000, 1500, 1800),
               rec(2, 9.0, 9.0, 0, 500, 0, 0, error="HTTP 500: boom")]
    sess = [SessionRecord("s", 0.0, 10.0, 5.0), SessionRecord("t", 0.0, 1.0, 0.0, complete=False)]
    s = summarize(records, duration=10.0, label={"sessions": 2}, sessions=sess, gpus=2)
    assert KEYS <= set(s) and s["sessions"] == 2
    assert (s["requests_ok"], s["requests_failed"]) == (2, 1) and s["errors"] == {"HTTP 500: boom": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(1.5) and s["ttft_s"]["mean"] == pytest.approx(1.5)
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)  # (3-1)/10 = 0.2 s and (4-2)/20 = 0.1 s
    assert s["e2e_s"]["p90"] == pytest.approx(3.9)
    assert s["output_tok_s"] == pytest.approx(3.2) and s["input_tok_s"] == pytest.approx(300.0)
    assert s["output_tok_s_per_gpu"] == pytest.approx(1.6)
    assert s["output_tok_s_per_user"]["mean"] == pytest.approx((11 / 3 + 21 / 4) / 2)
    assert s["cached_token_ratio"] == pytest.approx(0.5) and s["reusable_ceiling_ratio"] == pytest.approx(0.6)
    assert s["captured_reuse"] == pytest.approx(1500 / 1800)
    assert s["session_makespan_s"]["p50"] == 10.0 and s["session_slowdown"]["p50"] == 2.0
    assert s["sessions_complete"] == 1
    empty = summarize([], duration=0.0)
    assert empty["ttft_s"]["p50"] is None and empty["cached_token_ratio"] is None


def test_captured_reuse_counts_cached_up_to_reusable() -> None:
    # A P/D decode leg counts the KV it pulled as cached (as vLLM does): 1,990 of 2,000 tokens
    # cached, 1,500 reusable. Its surplus is not reuse; the other request fell short of its own.
    records = [rec(0, 1.0, 2.0, 5, 2000, 1990, 1500), rec(1, 1.0, 2.0, 5, 1000, 300, 500)]
    s = summarize(records, duration=10.0)
    assert s["captured_reuse"] == pytest.approx((1500 + 300) / 2000)
    assert s["cached_token_ratio"] == pytest.approx(2290 / 3000)  # uncapped: what servers said
    pulled = summarize([rec(0, 1.0, 2.0, 5, 2000, 1990, 0), rec(1, 1.0, 2.0, 5, 2000, 1990, 1500)], 10.0)
    assert pulled["captured_reuse"] == pytest.approx(1.0)


def test_write_outputs_files(tmp_path: Path) -> None:
    records = [rec(0, 1.0, 3.0, 11, 1000, 0, 0), rec(1, 2.0, 4.0, 21, 2000, 1500, 1800)]
    stages = [dict(summarize(records, 10.0, {"concurrency": c, "stage": 0}), stage=0) for c in (4, 8)]
    out = write_outputs(tmp_path / "o", stages, records, [SessionRecord("s", 0, 1, 1)])
    for name in ("summary.json", "requests.jsonl", "requests.csv", "sessions.jsonl", "report.html",
                 "ttft_cdf.png", "itl_cdf.png", "throughput.png", "frontier.png"):
        assert (out / name).stat().st_size > 0, name
    assert len(json.loads((out / "summary.json").read_text())) == 2
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(list(out.glob("*.png"))) and "<table>" in page
    back = [RequestRecord.from_dict(json.loads(x)) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert back == records
    assert (out / "requests.csv").read_text().splitlines()[0].startswith("request_id,session_id")


async def test_end_to_end_reuse_numbers(tmp_path: Path) -> None:
    # Two turns of one session, 4 tokens per block: turn 2 repeats turn 1's 10 blocks and
    # adds 5. Ceiling = 40 / (40 + 60); the stub's block-4 cache captures all of it.
    srv = StubServer(StubConfig(ttft=0.005, itl=0.001, cache_block=4))
    await srv.start()
    try:
        s = Session("a", 64, [TraceRequest(0, 640, 3, list(range(10))), TraceRequest(0, 960, 3, list(range(15)))])
        c = BenchConfig(url=srv.url, trace_sessions=[s], token_scale=4, out=str(tmp_path / "e"), progress=False)
        stages = await BenchRun(c).run()
    finally:
        await srv.stop()
    st = stages[0]
    assert st["input_tokens"] == 100 and st["output_tokens"] == 6 and st["requests_ok"] == 2
    assert st["reusable_ceiling_ratio"] == pytest.approx(0.4) and st["cached_token_ratio"] == pytest.approx(0.4)
    assert st["captured_reuse"] == pytest.approx(1.0)
    assert st["server_metrics"]["prefix_cache_hits"] == 40 and st["server_metrics"]["prefix_cache_queries"] == 100
    assert st["session_slowdown"]["p50"] is None  # recorded duration 0: no slowdown
    assert (tmp_path / "e" / "report.html").exists() and (tmp_path / "e" / "throughput.png").exists()
    assert st["run"]["url"] == srv.url and st["run"]["mode"] == "sessions" and st["run"]["model"]
    page = (tmp_path / "e" / "report.html").read_text()
    assert srv.url in page and st["run"]["model"] in page and "(preloaded)" in page
    assert not (tmp_path / "e" / "frontier.png").exists()  # one stage: a table row, not a dot


def test_cli_registered_with_flags() -> None:
    app = typer.Typer()
    register_bench(app)

    @app.command()
    def other() -> None:  # a second command keeps `bench` a sub-command, as in agentserve
        pass

    res = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for flag in ("--url", "--trace", "--mode", "--sessions", "--session-rate", "--concurrency",
                 "--stage-duration", "--token-scale", "--gap-cap", "--gap-scale", "--duration", "--max-turns",
                 "--max-input", "--max-output", "--api", "--model", "--api-key", "--vocab-size",
                 "--request-timeout", "--gpus", "--seed", "--out"):
        assert flag in res.output, flag
    bad = CliRunner().invoke(app, ["bench", "--url", "http://x", "--trace", "t", "--mode", "nope"])
    assert bad.exit_code != 0


@pytest.mark.parametrize("flags, message", [
    (["--url", "localhost:8000"], "--url must be an http(s)://"),
    (["--sessions", "0"], "--sessions must be >= 1"),
    (["--token-scale", "-3"], "--token-scale must be >= 1"),
    (["--duration", "-1"], "--duration must be positive"),
    (["--gap-scale", "-0.5"], "--gap-scale must be >= 0"),
    (["--trace", "BAD"], ":1: not a JSON object"),
    (["--trace", "/nonexistent/t.jsonl"], "no such trace file"),
])
def test_cli_refuses_bad_flags_and_traces_before_sending(tmp_path, flags, message) -> None:
    """Checked before any request: the URL below would refuse every connection."""
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"truncated\n')
    app = typer.Typer()
    register_bench(app)
    app.command("other")(lambda: None)
    args = {"--url": "http://127.0.0.1:9", "--trace": str(tmp_path / "w.jsonl"),
            "--out": str(tmp_path / "o")}
    for k, v in zip(flags[::2], flags[1::2]):
        args[k] = str(bad_trace) if v == "BAD" else v
    (tmp_path / "w.jsonl").write_text('{"id": "s", "requests": []}\n')
    res = CliRunner().invoke(app, ["bench", *[x for kv in args.items() for x in kv]],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2 and message in res.output, res.output


def test_cli_end_to_end_weka_and_mooncake(stub_thread: StubServer, tmp_path: Path) -> None:
    weka = {"id": "w1", "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": 0, "type": "n", "in": 640, "out": 3, "hash_ids": list(range(10)), "api_time": 0.1},
        {"t": 0.2, "type": "subagent", "agent_id": "a", "requests": [
            {"t": 0, "type": "n", "in": 128, "out": 2, "hash_ids": [50, 51], "api_time": 0.1}]},
        {"t": 0.5, "type": "n", "in": 704, "out": 3, "hash_ids": list(range(11)), "api_time": 0.1}]}
    (tmp_path / "w.jsonl").write_text(json.dumps(weka) + "\n")
    mc = [{"timestamp": ms, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]} for ms in (0, 50)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    app = typer.Typer()
    register_bench(app)

    @app.command()
    def other() -> None:
        pass

    for trace, mode in (("w.jsonl", "sessions"), ("m.jsonl", "schedule"), ("w.jsonl", "concurrency")):
        out = tmp_path / f"out-{mode}"
        res = CliRunner().invoke(app, ["bench", "--url", stub_thread.url, "--trace", str(tmp_path / trace),
                                       "--mode", mode, "--token-scale", "4", "--gap-scale", "0.1",
                                       "--concurrency", "2", "--stage-duration", "0.3", "--out", str(out)])
        assert res.exit_code == 0, res.output
        summary = json.loads((out / "summary.json").read_text())
        assert summary[0]["requests_ok"] >= 2 and summary[0]["requests_failed"] == 0, mode
        assert (out / "report.html").exists()
    assert json.loads((tmp_path / "out-sessions" / "summary.json").read_text())[0]["requests_ok"] == 3


def test_itl_token_samples_are_the_records_own_samples_concatenated() -> None:
    """The vectorized token-weighted ITL equals `RequestRecord.itl_samples()` record by record,
    chunk token counts shorter or longer than the chunk times, empty chunks and all."""
    import random

    import numpy as np

    from agentserve.workload.record import itl_token_samples

    rng = random.Random(7)
    recs = []
    for i in range(300):
        times = sorted(rng.uniform(0, 5) for _ in range(rng.randrange(0, 12)))
        toks = [rng.choice([0, 1, 1, 2, 3, 4]) for _ in range(len(times) + rng.randrange(-3, 3))]
        recs.append(RequestRecord(f"r{i}", "s", i, start=0.0, chunk_times=times,
                                  chunk_tokens=toks))
    want = [x for r in recs for x in r.itl_samples()]
    got = itl_token_samples(recs)
    assert len(want) > 500 and got.tolist() == want  # exactly, value for value
    assert itl_token_samples([]).size == 0 and np.asarray(want).mean() == got.mean()
