"""llm-d's approximate prefix scoring, as the reference's endpoint picker ran it.

The GLM-5.2 router overrides (`guides/wide-ep-lws/router/glm-5.2-overrides.values.yaml`) score
prefill ranks with two `approx-prefix-cache-producer`s, not with KV events. Each is the endpoint
picker's own record of the prompts it routed (llm-d `approximateprefix`):

- a prompt's head is hashed in blocks, at most `MaxPrefixBlocksToMatch` = 256 of them;
- routing a request to a rank adds its head's hashes to that rank's LRU (`PreRequest`);
- a rank's match is the run of leading hashes its LRU holds, and the scorer's value is that run
  over the head's length.

GPU producer: `autoTune` (its default) takes the rank's block size and its vLLM KV block count
(`CacheNumBlocks`) as the LRU's capacity, so its head is 256 x 64 = 16,384 tokens. CPU producer:
`autoTune: false`, `lruCapacityPerServer: 200000` blocks of the default 16 tokens (3.2M tokens,
~6x what a 100 GiB tier holds), head 256 x 16 = 4,096 tokens.

Neither record sees evictions. A rank keeps scoring for a prefix its pool has dropped until
enough other heads are routed there to push it out of the LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from agentserve.router.scorers import weighted_scores
from agentserve.sim.cluster import Rank, Router, SimRequest, _cands

__all__ = ["ApproxIndex", "ApproxRouter"]

MAX_PREFIX_BLOCKS = 256  # llm-d approximateprefix DefaultMaxPrefixBlocks
CPU_LRU_BLOCKS = 200_000  # the overrides' lruCapacityPerServer for the CPU producer
CPU_BLOCK_TOKENS = 16  # DefaultBlockSizeTokens (no autoTune on the CPU producer)
SCALE = 10**6  # the candidates' common block total the two runs are scaled onto (`pick`)


class ApproxIndex:
    """Per-rank LRUs of head hashes the picker routed there (capacity in hashes)."""

    def __init__(self, ranks: int, capacity: int, head: int) -> None:
        if capacity < 1 or head < 1:
            raise ValueError(f"an approximate index needs capacity and head >= 1, got {capacity}, {head}")
        self.capacity, self.head = capacity, head
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(ranks)]

    def match(self, i: int, hashes: list[int]) -> int:
        """Leading hashes of the head rank `i`'s record holds."""
        lru, n = self.lru[i], 0
        for h in hashes[: self.head]:
            if h not in lru:
                break
            n += 1
        return n

    def add(self, i: int, hashes: list[int]) -> None:
        """Record the head as routed to rank `i` (most recent last; the oldest leave first)."""
        lru = self.lru[i]
        for h in hashes[: self.head]:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class ApproxRouter(Router):
    """The reference's picker with approximate prefix records for the prefill profile; the
    decode profile (requests in flight) is unchanged.

    Our hashes are the pools' blocks (`block_size` tokens): the GPU record keeps 256 of them per
    head and the rank's block count; the CPU record keeps 4,096 tokens per head and 3.2M tokens
    per rank, in the same blocks."""

    def __init__(self, seed: int, p_ranks: list[Rank], block_size: int,
                 decode_scorers: dict[str, float] | None = None) -> None:
        super().__init__(seed, decode_scorers)
        self.pos = {id(r): k for k, r in enumerate(p_ranks)}
        blocks = p_ranks[0].pool.num_blocks if p_ranks else 1
        cpu_head = max(1, MAX_PREFIX_BLOCKS * CPU_BLOCK_TOKENS // block_size)
        self.gpu = ApproxIndex(len(p_ranks), blocks, MAX_PREFIX_BLOCKS)
        self.cpu = ApproxIndex(len(p_ranks), CPU_LRU_BLOCKS * CPU_BLOCK_TOKENS // block_size, cpu_head)

    def pick(self, ranks: list[Rank], req: SimRequest, decode: bool) -> Rank:
        if decode:
            return super().pick(ranks, req, decode)
        hashes = self._prompt_hashes(ranks, req)
        n = len(hashes)
        gh, ch = min(n, self.gpu.head), min(n, self.cpu.head)
        # the two scorers' values are their records' runs over their heads; `_cands` reads
        # matched / total for the GPU scorer and weighted / total for the GPU-or-CPU one, so
        # each run is scaled onto the candidate's common total
        cands = []
        for c, r in zip(_cands(ranks, req.hashes, 0), ranks):  # the load fields, no prefix
            k = self.pos[id(r)]
            g = self.gpu.match(k, hashes) / gh if gh else 0.0
            cpu = self.cpu.match(k, hashes) / ch if ch else 0.0
            cands.append(replace(c, matched_blocks=round(g * SCALE), total_blocks=SCALE,
                                 weighted_blocks=cpu * SCALE))
        i, _ = self.picker.pick(cands, weighted_scores(self.prefill, cands))
        self._record(ranks[i], hashes)
        return ranks[i]

    def pick_blind(self, ranks: list[Rank], req: SimRequest) -> Rank:
        """A pick on load alone (`SimConfig.route_miss`); the picker still records the head it
        routed to the rank it chose (`PreRequest`)."""
        r = super().pick_blind(ranks, req)
        self._record(r, self._prompt_hashes(ranks, req))
        return r

    @staticmethod
    def _prompt_hashes(ranks: list[Rank], req: SimRequest) -> list[int]:
        """The prompt's full blocks but the one holding its last token (vLLM computes that)."""
        return req.hashes[: req.head_blocks(ranks[0].pool.block_size)]

    def _record(self, r: Rank, hashes: list[int]) -> None:
        k = self.pos[id(r)]
        self.gpu.add(k, hashes)
        self.cpu.add(k, hashes)
