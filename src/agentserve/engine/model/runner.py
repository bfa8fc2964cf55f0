"""Runs one scheduled step on the model: build the batch, forward over paged KV, sample
(and, for requests that asked, score their prompt tokens: prompt logprobs)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from agentserve.engine.model.llama import KVCache, LlamaForCausalLM, SeqChunk, prepare_batch
from agentserve.engine.core.request import TokenLogprobs
from agentserve.engine.model.sampler import sample
from agentserve.engine.core.scheduler import SchedulerOutput
from agentserve.engine.core.sequence import Sequence
from agentserve.kv.manager import KVCacheManager

# Attention kernels the engine lets SDPA pick on CUDA: not cuDNN's, which builds an execution
# plan for every new shape, and here every decode step attends over a new KV length and
# every chunk after a cached prefix has its own. On an H200 (small preset, bf16, torch 2.11)
# leaving it out raised prefill from 99-134K to 487-507K tok/s (scripts/gpu_checks.sh).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Prompt rows projected onto the vocabulary at a time: a 2,048-token chunk at once would
# be 2,048 x 151,936 float32 logits (1.2 GiB); 256 rows of it are 156 MiB.
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    """Owns the model and its paged KV tensors; stateless across steps otherwise."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        # cached context tokens attention read in place / gathered, summed over steps (once a
        # step, not per layer): how fragmented the pool's block tables run (paged_prefix.py)
        self.read_in_place_tokens = 0
        self.read_gathered_tokens = 0
        self.read_shared_tokens = 0  # not read: a shared prefix's, per decode beyond the first

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> list[int | Exception]:
        """Compute the step; return one sampled token per entry that completes its prompt
        (or the exception that failed that entry's sampling alone: see ``sample``)."""
        chunks: list[SeqChunk] = []
        need = []
        scored: list[tuple[Sequence, int, int]] = []  # (seq, first position, rows): prompt logprobs
        for s in out.scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            rows = 0
            if seq.wants_prompt_logprobs:  # positions up to the next-to-last predict a prompt token
                rows = max(min(start + s.num_tokens, seq.num_prompt_tokens - 1) - start, 0)
                if rows:
                    scored.append((seq, start, rows))
            chunks.append(SeqChunk(token_ids=seq.token_ids[start:start + s.num_tokens], start_pos=start,
                                   block_ids=kv.block_ids(seq.request_id), need_logits=s.completes_prompt,
                                   prompt_rows=rows))
            if s.completes_prompt:
                need.append(seq)
        meta = prepare_batch(chunks, self.block_size, self.device)
        self.read_in_place_tokens += meta.read_in_place
        self.read_gathered_tokens += meta.read_gathered
        self.read_shared_tokens += meta.read_shared
        kernels = sdpa_kernel(CUDA_SDPA_BACKENDS) if self.device.type == "cuda" else nullcontext()
        with kernels:
            if scored:
                h = self.model.forward_hidden(meta, self.kv_cache)
                logits = self.model.compute_logits(h[: len(need)])
                self._score_prompts(h[len(need):], scored)
            else:
                logits = self.model(meta, self.kv_cache)
        if not need:
            return []
        return sample(logits, need)

    def _score_prompts(self, h: torch.Tensor, scored: list[tuple[Sequence, int, int]]) -> None:
        """Each position's log-probability of the prompt token after it, its rank, and the
        k most likely tokens, from the raw distribution (as vLLM's prompt logprobs); stored
        on the sequence by position, so a chunk computed again (preemption) overwrites."""
        targets = torch.tensor([t for seq, start, rows in scored
                                for t in seq.token_ids[start + 1:start + 1 + rows]],
                               dtype=torch.long, device=h.device)
        k = max(seq.params.prompt_logprobs or 0 for seq, _, _ in scored)
        lps, ranks, top_v, top_i = [], [], [], []
        for a in range(0, len(h), PROMPT_LOGPROB_ROWS):
            lp = torch.log_softmax(self.model.compute_logits(h[a:a + PROMPT_LOGPROB_ROWS]), dim=-1)
            tok = lp.gather(1, targets[a:a + PROMPT_LOGPROB_ROWS, None])  # [R, 1]
            lps.append(tok[:, 0])
            ranks.append((lp >= tok).sum(-1))  # (vLLM's rank: the tokens at least as likely)
            if k:
                top = torch.topk(lp, k, dim=-1)
                top_v.append(top.values)
                top_i.append(top.indices)
        lp_l, rank_l = torch.cat(lps).tolist(), torch.cat(ranks).tolist()
        tv = torch.cat(top_v).tolist() if k else None
        ti = torch.cat(top_i).tolist() if k else None
        r = 0
        for seq, start, rows in scored:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens
            kk = seq.params.prompt_logprobs or 0
            for j in range(rows):
                top = list(zip(ti[r][:kk], tv[r][:kk])) if kk else []
                seq.prompt_logprobs[start + 1 + j] = TokenLogprobs(
                    seq.token_ids[start + 1 + j], lp_l[r], top, rank_l[r])
                r += 1
