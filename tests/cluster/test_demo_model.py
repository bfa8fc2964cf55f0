"""`agentserve demo --model`: `tiny` (the default for now) keeps the built-in random model,
anything else goes to the engines (and the router's tokenizer) as `agentserve up --model`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agentserve.cli import app
from agentserve.cluster import launch


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("arg", "want"), [([], None), (["--model", "tiny"], None),
                                           (["--model", "smollm2-135m"], "smollm2-135m")])
def test_demo_passes_its_model_to_the_cluster(monkeypatch, tmp_path, arg, want) -> None:
    seen: dict = {}

    class FakeCluster:
        def __init__(self, run_dir, port, model=None, engine_args=()):
            seen.update(model=model, engine_args=list(engine_args))

        def start(self, topo, health_timeout):
            raise _Stop

        def stop(self):
            seen["stopped"] = True

    monkeypatch.setattr(launch, "Cluster", FakeCluster)
    r = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), *arg])
    assert isinstance(r.exception, _Stop), r.output
    assert seen["model"] == want and seen["stopped"]
    assert "--kv-cache-tokens" in seen["engine_args"]


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
