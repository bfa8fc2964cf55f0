"""Planner: candidate enumeration under the budget, frontier, recommendation, tiny sweep."""

from __future__ import annotations

import json

from agentserve.sim import plan as pl
from agentserve.sim import run as sim_run
from agentserve.sim.specs import CPU_PROFILE_ENV
from tests.sim.test_agg import PROFILE
from tests.sim.test_cluster import _session


def test_candidates_fill_the_budget() -> None:
    cands = pl.candidates("glm-5.2-fp8", "h200", 64)
    assert len(cands) == 24  # DEP8: 7P1D..4P4D, DEP16: 3P1D, 2P2D; x MTP x CPU tier
    assert all(c.gpus == 64 and c.prefill >= c.decode >= 1 for c in cands)
    assert {c.width for c in cands} == {8, 16}


def test_frontier_and_recommendation() -> None:
    pts = [{"tok_s_per_user": u, "output_tok_s_per_gpu": g, "output_tok_s": 1.0, "n": i}
           for i, (u, g) in enumerate([(50, 10), (40, 30), (30, 20), (20, 60), (35, 25)])]
    assert [p["n"] for p in pl.frontier(pts)] == [0, 1, 3]
    assert pl.recommend(pts, 30)["n"] == 1
    assert pl.recommend(pts, 60) is None
    pts[1]["rejected_share"] = 0.16  # serves only part of the workload (a DEP8 point)
    assert pl.recommend(pts, 30)["n"] == 4


def test_tiny_sweep_prices_points(monkeypatch, tmp_path) -> None:
    # a fixed cpu-local profile: the committed one is rewritten by every sim_vs_bench run,
    # and one measured on a slow spell of the box (stop 39 run 4) answered nothing in 120 s
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    monkeypatch.setenv(CPU_PROFILE_ENV, str(tmp_path / "profile.json"))
    monkeypatch.setattr(sim_run, "load_workload", lambda *a: [_session(i) for i in range(3)])
    cands = [pl.Candidate(1, 1, 1, False, 0.0), pl.Candidate(1, 1, 1, True, 0.0)]
    done: list[int] = []  # progress: one call per finished simulation
    pts = pl.sweep(cands, [2], "tiny", "cpu-local", "sweep-full", 120.0, workers=1,
                   on_done=lambda: done.append(1))
    assert len(done) == 2
    pl.price(pts, 1.0)
    assert len(pts) == 2 and all(p["output_tok_s"] > 0 and p["cost_per_m_output"] for p in pts)
    pl.write(tmp_path, pts, pl.frontier(pts), pl.recommend(pts, 0.0), {"min_tok_s_per_user": 0})
    assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_known_optimistic_rows_are_marked(capsys, tmp_path) -> None:
    """DEP8 prefill pools of GLM-5.2 on H200 carry the published comparison's caveat, in the
    points and on the printed frontier; DEP16 rows and other models do not."""
    from agentserve.sim.cli import _print_plan

    assert "75%" in pl.caveat("glm-5.2-fp8", "h200", 8)
    assert pl.caveat("glm-5.2-fp8", "h200", 16) is None
    assert pl.caveat("tiny", "cpu-local", 8) is None
    base = {"concurrency": 64, "tok_s_per_user": 40.0, "output_tok_s_per_gpu": 90.0,
            "ttft_p50_s": 2.0, "itl_p50_ms": 15.0, "cost_per_m_input": 0.04, "cost_per_m_output": 4.0}
    dep8 = {**base, "config": "4P4D DEP8 MTP cpu100", "caveat": pl.caveat("glm-5.2-fp8", "h200", 8)}
    dep16 = {**base, "config": "2P2D DEP16 MTP cpu100", "caveat": None}
    _print_plan([dep8, dep16], dep8, 30.0, tmp_path)
    out = capsys.readouterr().out
    assert "4P4D DEP8 MTP cpu100 *" in out and "DEP16 MTP cpu100 *" not in out
    assert "* DEP8 prefill pools" in out and "caution:" in out
    _print_plan([dep16], dep16, 30.0, tmp_path)
    out = capsys.readouterr().out
    assert "*" not in out and "caution" not in out
    odd = {**dep8, "caveat": "a note with [brackets] printed as text"}  # not rich markup
    _print_plan([odd], odd, 30.0, tmp_path)
    assert capsys.readouterr().out.count("[brackets]") == 2  # the footnote and the caution
    pl.plot([dep8, dep16], [dep16], dep16, 30.0, tmp_path / "f.png")  # the footnoted figure
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_sweep_applies_efficiency_overrides_to_every_point() -> None:
    """`plan --efficiency`: each simulated configuration runs with the overridden factors
    (weights streamed at half the HBM bandwidth: slower decode, so a longer ITL)."""
    cand = [c for c in pl.candidates("glm-5.2-fp8", "h200", 32, (16,)) if c.mtp and c.cpu_gib][:1]
    base, slow = (pl.sweep(cand, [16], "glm-5.2-fp8", "h200", "sweep-full", 20.0, workers=1,
                           efficiency=e)[0] for e in (None, {"hbm": 0.5}))
    assert slow["itl_p50_ms"] > 1.2 * base["itl_p50_ms"]
