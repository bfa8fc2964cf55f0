"""Fixtures shared by the engine's model tests."""

from __future__ import annotations

import pytest
import torch

from agentserve.engine.model.checkpoint import load_model
from agentserve.engine.model.tiny import make_tiny
from tests.engine.model.reference import DenseLlama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset (fp32): (paged model, config, dense reference)."""
    d = make_tiny(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)
    model, cfg = load_model(d, torch.float32, "cpu")
    return model, cfg, DenseLlama(d)
