"""Approximate prefix tracking for endpoints that publish no KV events.

The router remembers the blocks of the prompts it routed to each endpoint in an LRU
sized to the endpoint's KV capacity (`capacity_blocks` from config, else scraped
`vllm:cache_config_info{num_gpu_blocks}`, else a default). The blocks live in the shared
`PrefixIndex` (GPU tier) under the endpoint's holder bit, so lookups are the same code;
when the LRU overflows, its oldest blocks are removed from the index, mimicking the
engine's own LRU eviction of unreferenced prefix blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from agentserve.router.index import Holder, PrefixIndex


class ApproxTracker:
    """Per-endpoint LRU of routed blocks, mirrored into the index."""

    def __init__(self, index: PrefixIndex, holder: Holder, capacity_blocks: int) -> None:
        self.index = index
        self.holder = holder
        self.capacity = max(1, capacity_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def touch(self, keys: list[int]) -> None:
        """The endpoint just served a prompt with these blocks: they are now most recent."""
        lru = self._lru
        new = []
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                new.append(k)
        self.index.store(self.holder, new)
        over = len(lru) - self.capacity
        if over > 0:
            evicted = [lru.popitem(last=False)[0] for _ in range(over)]
            self.index.remove(self.holder, evicted)

    def resize(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self.touch([])

    def __len__(self) -> int:
        return len(self._lru)
