"""Memory model: weights per GPU for a topology, runtime reserve, and KV tokens per rank.

    kv_bytes_per_rank = util * HBM - weights_per_gpu - mtp_head - reserve
    kv_tokens_per_rank = floor(kv_bytes / kv_bytes_per_token / block) * block

Topologies (SPEC.md capability 2):
- DEPn: data-parallel attention (each rank holds all attention, dense-FFN, shared-expert
  and embedding weights and its own KV) + expert parallelism (routed experts split n ways).
- TPn: every matrix split n ways except the MLA down-projections; an MLA latent has no head
  axis, so each rank keeps a full copy of every token's KV (per-node KV = per-rank KV).

Constants (each a physical quantity, none fitted to one figure):
- `RESERVE_BYTES` 17.5 GiB: memory vLLM keeps outside weights and KV: the profile run's
  activation peak (chunked prefill / MTP verify batch), CUDA graphs, NCCL/PyTorch context and
  allocator slack. Read off the intra-node facts of SPEC.md (DEP8 prefill 182K, TP8); 17 GiB
  before GLM-5.2's indexer (32 heads, not 64) took ~0.7 GB out of the replicated weights.
- `INTERNODE_A2A_BYTES` 7 GiB: extra when an instance spans nodes: DeepEP's RDMA buffers and
  the NVSHMEM symmetric heap for inter-node all-to-all (normal + low-latency modes).
- vLLM's MLA keeps bf16 copies of the absorbed `kv_b_proj` (W_UK, W_UV) beside the FP8 weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.sim.specs import GiB, HardwareSpec, ModelSpec

RESERVE_BYTES = 17.5 * GiB
INTERNODE_A2A_BYTES = 7 * GiB
GPU_MEM_UTIL = {"prefill": 0.935, "decode": 0.95, "both": 0.95}  # SPEC.md / reference flags
BLOCK_SIZE = 64  # tokens per KV block (SPEC.md)


@dataclass(frozen=True, slots=True)
class Topology:
    """One serving instance: `kind` "dep" or "tp", `width` GPUs, `role` prefill/decode/both."""

    kind: str
    width: int
    role: str = "both"
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("dep", "tp") or self.width < 1:
            raise ValueError(f"bad topology {self.kind}{self.width}: kind dep|tp, width >= 1")
        if self.role not in GPU_MEM_UTIL:
            raise ValueError(f"bad role {self.role!r}; choose prefill, decode or both")


def _absorbed_mla_bytes(m: ModelSpec) -> float:
    """bf16 W_UK / W_UV copies of kv_b_proj that vLLM's MLA makes after loading."""
    if not m.is_mla:
        return 0.0
    return m.layers * m.kv_lora * m.n_heads * (m.nope_dim + m.v_head_dim) * 2.0


def weight_bytes_per_gpu(m: ModelSpec, t: Topology) -> float:
    """Main-model weight bytes resident on one GPU of the instance."""
    wb, n = m.weight_bytes, t.width
    routed = m.routed_params() * wb / n
    if t.kind == "dep":  # attention & co. replicated, routed experts split
        rest = m.replicated_params() * wb + m.embed_params() * m.embed_bytes
        return routed + rest + _absorbed_mla_bytes(m)
    fixed = m.layers * m.attn_replicated_params() * wb  # cannot be split by heads
    shard = (m.replicated_params() * wb - fixed + m.embed_params() * m.embed_bytes
             + _absorbed_mla_bytes(m)) / n
    return routed + fixed + shard


def mtp_bytes_per_gpu(m: ModelSpec, t: Topology) -> float:
    """The MTP head on a decode (or aggregate) rank; its routed experts follow the topology."""
    if not (t.mtp and m.mtp_layers):
        return 0.0
    routed = m.mtp_layers * m.n_routed * m.expert_params() * m.weight_bytes
    rest = m.mtp_params() * m.weight_bytes - routed
    return routed / t.width + (rest if t.kind == "dep" else rest / t.width)


def reserve_bytes(hw: HardwareSpec, t: Topology) -> float:
    """Non-KV runtime memory; inter-node all-to-all buffers when the instance spans nodes."""
    if hw.name == "cpu-local":
        return 0.5 * GiB
    spans = t.kind == "dep" and t.width > hw.gpus_per_node
    return RESERVE_BYTES + (INTERNODE_A2A_BYTES if spans else 0.0)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The memory budget of one rank."""

    weights: float  # bytes
    mtp: float
    reserve: float
    kv_bytes: float
    kv_tokens: int  # per rank, whole blocks
    kv_tokens_per_node: int  # distinct tokens a node holds (TP: one copy shared by the group)

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // BLOCK_SIZE


def plan_memory(m: ModelSpec, hw: HardwareSpec, t: Topology, util: float | None = None,
                block_size: int = BLOCK_SIZE) -> MemoryPlan:
    """KV capacity of one rank of `t`; raises when the weights do not fit."""
    u = GPU_MEM_UTIL[t.role] if util is None else util
    w, mtp, r = weight_bytes_per_gpu(m, t), mtp_bytes_per_gpu(m, t), reserve_bytes(hw, t)
    kv = u * hw.hbm_bytes - w - mtp - r
    if kv <= 0:
        raise ValueError(
            f"{m.name} on {t.kind}{t.width} ({t.role}) does not fit one {hw.name}: weights "
            f"{w / GiB:.1f} GiB + MTP {mtp / GiB:.1f} + reserve {r / GiB:.1f} > "
            f"{u:.3f} x {hw.hbm_bytes / GiB:.1f} GiB"
        )
    tokens = int(kv // m.kv_bytes_per_token() // block_size) * block_size
    per_node = min(t.width, hw.gpus_per_node)
    node = tokens if t.kind == "tp" else tokens * per_node
    return MemoryPlan(w, mtp, r, kv, tokens, node)
