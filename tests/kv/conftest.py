"""Shared fixtures: known-answer vectors produced by the real vLLM 0.32.

tests/kv/vllm_vectors.json was written by tests/kv/gen_vllm_vectors.py run with the vLLM
venv's python; the tests themselves never import vllm.
"""

import json
from pathlib import Path

import pytest

VECTORS = json.loads((Path(__file__).parent / "vllm_vectors.json").read_text())


def vtokens(n: int) -> list[int]:
    """The token pattern gen_vllm_vectors.py hashed."""
    return [(i * 7919 + 13) % 151936 for i in range(n)]


@pytest.fixture
def vectors() -> dict:
    return VECTORS
