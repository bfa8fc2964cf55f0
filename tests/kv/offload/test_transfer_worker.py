"""The tier copies of ``TransferWorker``: per-block (CPU) and batched (CUDA's, and CPU copies
of small blocks) agree, across staging chunks, slot runs, consecutive and scattered
destinations and a partial first offload block."""

from __future__ import annotations

import pytest
import torch

from agentserve.kv.offload import copy as transfer
from agentserve.kv.offload.copy import TransferWorker

L, NB, BS, H, D, PER = 3, 40, 4, 2, 8, 2  # PER device blocks per offload block


def cache() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(L, NB, BS, H, D, generator=g) for _ in "kv")


def offload_block(k: torch.Tensor, v: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """What a CPU slot holds for device blocks ``ids``: [2, L, PER * BS, H, D]."""
    return torch.stack([x[:, ids].reshape(L, len(ids) * BS, H, D) for x in (k, v)])


@pytest.mark.parametrize("batched,stage_blocks,small", [
    (False, 1, 0),  # block by block (CPU, large offload blocks)
    (False, 2, None),  # CPU, small offload blocks: loads staged like CUDA's, stores indexed
    (True, 1, None), (True, 2, None), (True, 64, None)])
def test_store_then_load_round_trips(batched: bool, stage_blocks: int, small: int | None,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if small is not None:
        monkeypatch.setattr(transfer, "SMALL_BLOCK_BYTES", small)
    k, v = cache()
    block_bytes = 2 * L * PER * BS * H * D * k.element_size()
    w = TransferWorker(k, v, batched=batched, stage_bytes=stage_blocks * block_bytes)
    try:
        host = torch.zeros(20, 2, L, PER * BS, H, D)
        slots = [5, 6, 7, 2, 10]  # runs 5-7, 2, 10
        groups = [[0, 1], [2, 3], [8, 9], [11, 12], [30, 31]]
        w.device_to_host(host, slots, groups)
        for slot, ids in zip(slots, groups):
            assert torch.equal(host[slot], offload_block(k, v, ids)), slot
        assert not host[[0, 1, 3, 4, 8, 9]].any()  # nothing written elsewhere

        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        w.k, w.v = k2, v2  # load into an empty cache
        # 5 sources, the first from sub-block 1; consecutive and scattered destinations
        dst = [20, 21, 22, 35, 24, 25, 26, 27, 3]
        w.host_to_device([host[s] for s in slots], 1, dst)
        src_ids = [1, 2, 3, 8, 9, 11, 12, 30, 31]
        for d, s in zip(dst, src_ids):
            assert torch.equal(k2[:, d], k[:, s]) and torch.equal(v2[:, d], v[:, s]), (d, s)
        untouched = sorted(set(range(NB)) - set(dst))
        assert not k2[:, untouched].any() and not v2[:, untouched].any()
    finally:
        w.close()
