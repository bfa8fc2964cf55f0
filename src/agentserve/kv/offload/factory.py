"""Assembling the offload tiers from their configuration: CPU tier, retention policy,
optional disk tier (its index rebuilt from the segments on disk), manager and transfer
worker, behind one ``TierConnector``."""

from __future__ import annotations

import logging

import torch

from agentserve.kv.offload.connector import TierConnector
from agentserve.kv.hashing import to_external
from agentserve.kv.offload.manager import OffloadManager
from agentserve.kv.pool import BlockPool
from agentserve.kv.offload.tiers import TierConfig
from agentserve.kv.offload.copy import TransferWorker

log = logging.getLogger("agentserve.kv.offload.tiers")


def make_connector(cfg: TierConfig, k: torch.Tensor, v: torch.Tensor, pool: BlockPool,
                   fingerprint: bytes) -> TierConnector:
    """CPU tier (+ disk tier, index rebuilt from its segments) over device KV ``k``, ``v``.

    ``k``, ``v``: [num_layers, num_blocks, block_size, Hkv, D]; ``fingerprint`` names the
    model layout so a disk tier never serves another model's blocks.
    """
    from agentserve.kv.offload.disk import DiskTier
    from agentserve.kv.offload.policies import make_policy
    from agentserve.kv.offload.tiers import CPUTier

    L, _, bs, H, D = k.shape
    tokens = cfg.block_tokens or bs
    if tokens <= 0 or tokens % bs:
        raise ValueError(f"--kv-offload-block-tokens must be a positive multiple of the block "
                         f"size {bs}, got {tokens}")
    shape = (2, L, tokens, H, D)
    block_bytes = 2 * L * tokens * H * D * k.element_size()
    slots = cfg.cpu_bytes // block_bytes
    if slots < 1:
        raise ValueError(f"--kv-cpu-gib holds no offload block of {block_bytes} bytes; raise it")
    policy = make_policy(cfg.cpu_policy, slots, cfg.session_ttl)
    cpu = CPUTier(slots, shape, k.dtype, policy, pin_memory=k.is_cuda)
    disk = None
    if cfg.disk_dir:
        if cfg.disk_bytes < block_bytes:
            raise ValueError("--kv-disk-gib must hold at least one offload block")
        disk = DiskTier(cfg.disk_dir, cfg.disk_bytes, block_bytes, fingerprint)
    mgr = OffloadManager(cpu, disk, bs)
    if disk is not None:
        found = disk.scan()
        ext = [[to_external(key, pool.int_hashes)] for key in found] if tokens == bs else None
        mgr.adopt_disk_keys(found, ext)
        skipped = sum(disk.skipped.values())
        log.info("disk KV tier %s: %d blocks found, %d corrupt, %d segments skipped",
                 cfg.disk_dir, len(found), disk.corrupt_at_scan, skipped)
    log.info("CPU KV tier: %d blocks of %d tokens (%.2f GiB), policy %s", slots, tokens,
             slots * block_bytes / 2**30, cfg.cpu_policy)
    return TierConnector(cfg, mgr, TransferWorker(k, v), pool, bs)
