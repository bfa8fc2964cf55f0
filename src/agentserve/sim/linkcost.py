"""KV movement between pools and tiers: the P->D pull (NIXL) and the CPU -> GPU restore.

`PerfModel` (perf.py) inherits these from `TransferModel`; they read its `model`, `hw` and
`eff`. Constants and their sources:

- `NIXL_TRANSFER_BW`: NIXL's achieved rate for one P->D pull, 167 MB in 38.7 ms (6.7 ms of it
  posting 1,785 descriptors) on a vLLM 3P1D NIXL deployment, vllm#50913; hardware not stated.
  Until stop 25: the InfiniBand line rate.
- `NIXL_POST_S`: host time the pulling (decode) worker spends posting the pull, per pulled block
  per registered KV region. vLLM's NIXL decode side posts a pull's READ descriptors on the
  worker's own thread (`start_load_kv` -> `_read_blocks`; vLLM 0.32 right after the forward
  launch, older versions before it), one descriptor per contiguous run of blocks per region
  (`_compute_desc_ids`). GLM-5.2 registers ~100 regions: each layer's latent cache, the MTP
  layer's and the indexer's key caches (GLM-5.3: 101, vllm#55434). Under AgentX load the block
  lists are fragmented: vllm#55434 measured 91K-120K descriptors for ~4.9 GB pulls, 57-75% of
  blocks x regions. A rank whose posting outlasts its forward starts its next step late, and
  the lockstep DEP instance waits for it (decode.py).

  The cost on the reference's transport is not published. 0.7 us per block and region is the
  one constant fitted to the calibration run (3P1D ITL p50 at c16 / c64 / c128, stop 30; 0.5 and
  0.94 us bracket it); a pull then posts for ~10% of its transfer time. The published anchors,
  on other hardware, put it 1.5-4x higher: on IB `rc_x` posting took ~15% of a transfer
  (vllm#55434), 1.1-1.3 us per block and region at `NIXL_TRANSFER_BW`; vllm#50913 posted at
  3.75 us a descriptor, 2.1-2.8 us per block and region at that fragmentation. The held-back
  configurations check it (docs/sim/notebook.md, stop 30).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentserve.sim.constants import Efficiency
    from agentserve.sim.specs import HardwareSpec, ModelSpec

NIXL_TRANSFER_BW = 4.3e9
NIXL_POST_S = 0.7e-6

__all__ = ["NIXL_POST_S", "NIXL_TRANSFER_BW", "TransferModel"]


class TransferModel:
    """Transfer times of one instance's KV; mixed into `PerfModel`."""

    __slots__ = ()
    model: ModelSpec
    hw: HardwareSpec
    eff: Efficiency

    def kv_regions(self) -> int:
        """KV regions NIXL registers per rank: each layer's latent cache, the MTP layers',
        and the indexer's key caches."""
        m = self.model
        return m.layers + m.mtp_layers + (m.indexer_layers() if m.index_topk else 0)

    def kv_transfer_time(self, tokens: int) -> float:
        """P->D KV pull of `tokens` by NIXL at its measured rate per transfer
        (`NIXL_TRANSFER_BW`); every cache the decode side needs moves: the latent KV of each
        layer and of the MTP layer, and the indexer's keys."""
        per_token = self.model.state_bytes_per_token()
        return 2 * self.eff.a2a_latency_s + tokens * per_token / NIXL_TRANSFER_BW

    def kv_post_time(self, tokens: int, block_size: int) -> float:
        """Host time the decode worker spends posting a pull of `tokens` (`NIXL_POST_S` per
        pulled block per registered region); 0 for nothing pulled."""
        return -(-max(0, tokens) // block_size) * self.kv_regions() * NIXL_POST_S

    def cpu_restore_time(self, tokens: int) -> float:
        """CPU -> GPU restore at the measured rate (SPEC.md: ~26 ms per GB) of every cache the
        tokens have (`ModelSpec.state_bytes_per_token`)."""
        return tokens * self.model.state_bytes_per_token() / 1e9 * self.hw.cpu_restore_s_per_gb
