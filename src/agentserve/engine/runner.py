"""Runs one scheduled step on the model: build the batch, forward over paged KV, sample."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from agentserve.engine.model import KVCache, LlamaForCausalLM, SeqChunk, prepare_batch
from agentserve.engine.sampler import sample
from agentserve.engine.scheduler import SchedulerOutput
from agentserve.kv.manager import KVCacheManager

# Attention kernels the engine lets SDPA pick on CUDA: not cuDNN's, which builds an execution
# plan for every new shape, and here every decode step attends over a new KV length and
# every chunk after a cached prefix has its own. On an H200 (small preset, bf16, torch 2.11)
# leaving it out raised prefill from 99-134K to 487-507K tok/s (scripts/gpu_checks.sh).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelRunner:
    """Owns the model and its paged KV tensors; stateless across steps otherwise."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> list[int | Exception]:
        """Compute the step; return one sampled token per entry that completes its prompt
        (or the exception that failed that entry's sampling alone: see ``sample``)."""
        chunks: list[SeqChunk] = []
        need = []
        for s in out.scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            chunks.append(SeqChunk(token_ids=seq.token_ids[start:start + s.num_tokens], start_pos=start,
                                   block_ids=kv.block_ids(seq.request_id), need_logits=s.completes_prompt))
            if s.completes_prompt:
                need.append(seq)
        meta = prepare_batch(chunks, self.block_size, self.device)
        kernels = sdpa_kernel(CUDA_SDPA_BACKENDS) if self.device.type == "cuda" else nullcontext()
        with kernels:
            logits = self.model(meta, self.kv_cache)
        if not need:
            return []
        return sample(logits, need)
