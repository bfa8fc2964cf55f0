"""Discrete-event cluster: xPyD pools of DEPn instances over the real `kv.pool.BlockPool`.

Each data-parallel rank owns a GPU `BlockPool` (kv's `LazyBlockPool`: 64-token blocks, LRU
eviction, prefix map) and, with offload on, a CPU tier (kv's `TierSlots` under its
`LRUPolicy`) written through on every computed block (as vLLM's CPU offloading connector
stores). Only step times come from `perf.PerfModel`; which blocks
hit, which are evicted and which must be restored is decided by the kv code itself.

Flow of a request: router (our scorers) -> prefill rank queue -> chunked prefill steps
(instance-synchronous, all ranks step together) -> KV pull by the decode rank (only blocks
it lacks) -> decode steps with MTP -> finish; the load generator (lanes.py, or a
closed-loop client) goes on.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from operator import attrgetter

import numpy as np

from agentserve.kv.offload.policies import BlockInfo, LRUPolicy
from agentserve.kv.offload.slots import TierSlots
from agentserve.kv.pool import Block, BlockPool, LazyBlockPool
from agentserve.router.approx import ApproxTracker
from agentserve.router.index import Holder, PrefixIndex
from agentserve.router.picker import MaxScorePicker
from agentserve.router.scorers import Candidate, build_scorers, weighted_scores
from agentserve.sim.constants import MTP_ACCEPT
from agentserve.workload.record import RequestRecord

# The reference deployment's endpoint picker (llm-d's GLM-5.2 P/D overrides,
# `guides/wide-ep-lws/router/glm-5.2-overrides.values.yaml`), per data-parallel rank: prefill
# weighs the prompt's prefix in GPU memory (5), in GPU or CPU memory (2; its CPU producer
# records every block routed to the rank, which the write-through tier holds) and requests in
# flight (1); decode weighs requests in flight only (3): no locality, so a decode rank pulls
# the whole prompt unless it happens to hold it.
PREFILL_SCORERS = {"gpu_prefix": 5.0, "prefix": 2.0, "active": 1.0}
DECODE_SCORERS = {"active": 3.0}
# The prefill profile without its prefix scorers: a pick on load alone (`Router.pick_blind`)
BLIND_PREFILL_SCORERS = {k: w for k, w in PREFILL_SCORERS.items() if "prefix" not in k}
CPU_TIER_WEIGHT = 0.8  # our router's tier weight for CPU-resident blocks (policy_router.py)
_REF_CNT = attrgetter("ref_cnt")  # C-level attribute read for the free-hit count in `fits`


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request in flight; `hashes` are global block keys of its input."""

    rec: RequestRecord
    hashes: list[int]
    n_in: int
    n_out: int
    on_done: Callable[[SimRequest], None]
    blocks: list[Block] = field(default_factory=list)
    computed: int = 0  # prompt tokens with KV on the current rank
    cached: int = 0  # prompt tokens served from cache (GPU + CPU) at prefill
    restored: int = 0  # of them, tokens restored from CPU
    out_done: int = 0
    ready_at: float = 0.0  # when its CPU restore finished loading
    ready_step: int = -1  # restoring: the first prefill step that may run it (-1: loading)
    seen_step: int = 0  # the first prefill step whose plan sees it queued (async scheduling)
    restore_from: int = -1  # first restored block, registered in the prefix map once loaded
    counted: bool = False  # its prompt is in the prefill pool's token counts (first admission)
    rank: Rank | None = None
    p_rank: Rank | None = None  # prefill rank, picked on arrival
    d_rank: Rank | None = None  # decode rank, picked with the prefill rank on arrival (llm-d)
    leg: float = 0.0  # one vLLM API server's request path for this prompt (P/D: two legs)
    api_s: list[float] = field(default_factory=list)  # per leg: time at the API server, wait included
    # decode segment (decode.py): acceptances drawn at admission, events keyed by generation
    cum: np.ndarray | None = None  # cumulative output tokens after each step of the segment
    seg_start: int = 0  # instance step the segment began on
    seg_out0: int = 0  # output tokens before the segment
    gen: int = 0  # bumped on admission and preemption; stale events are skipped
    f_rows: float = 0.0  # this request's share of its rank's attention-row sum
    f_idx: float = 0.0  # and of its indexer-key sum
    # phase times on the simulated clock (TTFT breakdown): routed to a prefill rank, admitted
    # there, prefill done, KV arrived at the decode rank, admitted to the decode batch
    t_route: float = 0.0
    t_admit: float = 0.0
    t_pdone: float = 0.0
    t_arrive: float = 0.0
    t_dadmit: float = -1.0
    preempted: bool = False  # its decode KV was freed: re-admission recomputes it (decode.py)
    uid: int = field(default_factory=itertools.count().__next__)  # unique, never reused

    # what in-flight prefix sharing (kv/inflight.py, `Prefilling`) reads of a request
    @property
    def request_id(self) -> int:
        return self.uid

    @property
    def block_hashes(self) -> list[int]:
        return self.hashes

    @property
    def num_tokens(self) -> int:
        return self.n_in

    @property
    def num_computed_tokens(self) -> int:
        return self.computed

    def head_blocks(self, block_size: int) -> int:
        """Full blocks of the prompt but its last token's: what a prefix lookup may match
        (vLLM computes the last prompt token even on a full hit, to sample from it)."""
        return max(0, (self.n_in - 1) // block_size)


class Rank:
    """One data-parallel rank: its KV pools and queues."""

    def __init__(self, idx: int, blocks: int, cpu_blocks: int, block_size: int) -> None:
        self.idx = idx
        self.pool: BlockPool = LazyBlockPool(blocks, block_size)
        # the CPU tier: the engine's tier bookkeeping (kv/offload/slots.py) under its LRU policy
        self.cpu: TierSlots | None = cpu_tier(cpu_blocks) if cpu_blocks else None
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        # prefill ranks: requests holding blocks before they run (restoring from CPU, or
        # restored), served ahead of `waiting` (vLLM's `kv_holding_waiting`); the blocks being
        # loaded (hash -> loads); when the rank's host-to-device copy stream is next free
        self.holding: deque[SimRequest] = deque()
        self.loading: dict[int, int] = {}
        self.copy_free = 0.0
        self.active = 0  # requests routed here whose response has not ended (the picker's count)
        self.api_free = 0.0  # when this rank's API server is done with the prompts it has
        self.pinned = 0  # prefilled requests whose KV the decode side has not pulled yet

    def prefix_blocks(self, hashes: list[int], n: int) -> tuple[int, int]:
        """(GPU, CPU-continuation) leading blocks held, by bisection over the prefix map."""
        g = _bisect_prefix(self.pool.cached, hashes, 0, n)
        c = _bisect_prefix(self.cpu.ready, hashes, g, n) - g if self.cpu else 0
        return g, c


def _bisect_prefix(cached: dict | set, hashes: list[int], lo: int, hi: int) -> int:
    """Length of the held prefix, assuming held blocks form a prefix (LRU frees tails first)."""
    if lo >= hi or hashes[lo] not in cached:
        return lo
    lo += 1
    while lo < hi:
        mid = (lo + hi) // 2
        if hashes[mid] in cached:
            lo = mid + 1
        else:
            hi = mid
    return lo


class Clock:
    """Heap of (time, seq, callback): the simulated clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    @property
    def idle(self) -> bool:
        """No event is scheduled."""
        return not self._heap

    def run(self, until: float) -> None:
        """Run the events up to `until`, with the cyclic garbage collector relaxed."""
        with relaxed_gc():
            heap, pop = self._heap, heapq.heappop
            while heap and heap[0][0] <= until:
                self.now, _, fn = pop(heap)
                fn()
        self.now = until


# A 64-GPU deployment creates millions of long-lived KV block objects (the pools fill lazily as
# the stage runs), linked into free lists. Under the collector's default thresholds (700, 10,
# 10) every allocation burst triggers young collections and, ~10 times a stage, full ones that
# walk all of them: 20-30% of a stage's CPU time, for nothing (blocks live as long as their
# pool; short-lived event objects are freed by reference counting). Young collections every
# 50,000 allocations and no scheduled full one save most of it (docs/sim/notebook.md, stop 35);
# memory is unchanged (maxrss 1.04 GB either way for 10 simulated minutes of 3P1D c128).
RELAXED_GC_THRESHOLD = (50_000, 20, 100)


@contextlib.contextmanager
def relaxed_gc() -> Iterator[None]:
    """Raise the collector's thresholds for the block below, then restore them."""
    old = gc.get_threshold()
    gc.set_threshold(*RELAXED_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _cands(ranks: list[Rank], hashes: list[int], n: int) -> list[Candidate]:
    out = []
    for r in ranks:
        g, c = r.prefix_blocks(hashes, n)
        out.append(Candidate(url=str(r.idx), matched_blocks=g, total_blocks=n,
                             weighted_blocks=g + c, waiting=len(r.waiting) + len(r.holding),
                             running=len(r.running), kv_usage=r.pool.usage,
                             inflight=r.active))
    return out


class Router:
    """Per-rank endpoints scored by the router's own scorers and max-score picker."""

    def __init__(self, seed: int, decode_scorers: dict[str, float] | None = None) -> None:
        self.prefill = build_scorers(PREFILL_SCORERS)
        self.decode = build_scorers(DECODE_SCORERS if decode_scorers is None else decode_scorers)
        self.blind = build_scorers(BLIND_PREFILL_SCORERS)
        self.picker = MaxScorePicker(seed=seed)

    def pick_blind(self, ranks: list[Rank], req: SimRequest) -> Rank:
        """A prefill pick on load alone, as when the picker's prefix view holds nothing for the
        request (`SimConfig.route_miss`): the request then lands where its prefix rarely is."""
        cands = _cands(ranks, [], 0)
        i, _ = self.picker.pick(cands, weighted_scores(self.blind, cands))
        return ranks[i]

    def pick(self, ranks: list[Rank], req: SimRequest, decode: bool) -> Rank:
        n = req.head_blocks(ranks[0].pool.block_size)
        cands = _cands(ranks, req.hashes, n)
        i, _ = self.picker.pick(cands, weighted_scores(self.decode if decode else self.prefill,
                                                       cands))
        return ranks[i]


# llm-d's approximate prefix scoring, as the reference's endpoint picker ran it. The GLM-5.2
# router overrides (`guides/wide-ep-lws/router/glm-5.2-overrides.values.yaml`) score prefill
# ranks with two `approx-prefix-cache-producer`s, not with KV events. Each is the endpoint
# picker's own record of the prompts it routed (llm-d `approximateprefix`): a prompt's head is
# hashed in blocks, at most `MaxPrefixBlocksToMatch` = 256 of them; routing a request to a rank
# adds its head's hashes to that rank's LRU (`PreRequest`); a rank's match is the run of leading
# hashes its LRU holds, and the scorer's value is that run over the head's length. GPU producer:
# `autoTune` (its default) takes the rank's block size and its vLLM KV block count as the LRU's
# capacity, so its head is 256 x 64 = 16,384 tokens. CPU producer: `autoTune: false`,
# `lruCapacityPerServer: 200000` blocks of the default 16 tokens (3.2M tokens, ~6x what a
# 100 GiB tier holds), head 256 x 16 = 4,096 tokens. Neither record sees evictions: a rank keeps
# scoring for a prefix its pool has dropped until enough other heads push it out of the LRU.
# Each record is our router's own (`router.approx.ApproxTracker`: an LRU per endpoint mirrored
# into a `router.index.PrefixIndex`), one holder per rank.
MAX_PREFIX_BLOCKS = 256  # llm-d approximateprefix DefaultMaxPrefixBlocks
CPU_LRU_BLOCKS = 200_000  # the overrides' lruCapacityPerServer for the CPU producer
CPU_BLOCK_TOKENS = 16  # DefaultBlockSizeTokens (no autoTune on the CPU producer)
SCALE = 10**6  # the candidates' common block total the two runs are scaled onto (`pick`)


class ApproxRecord:
    """Per-rank LRUs of head hashes the picker routed there (capacity in hashes): one router
    `ApproxTracker` per rank over one shared `PrefixIndex` (exact scans: an LRU's contents
    need not be a prefix run)."""

    def __init__(self, ranks: int, capacity: int, head: int) -> None:
        if capacity < 1 or head < 1:
            raise ValueError(f"an approximate index needs capacity and head >= 1, got {capacity}, {head}")
        self.capacity, self.head = capacity, head
        self.index = PrefixIndex(exact=True)
        self.holders: list[Holder] = [(str(i), 0) for i in range(ranks)]
        self.lru = [ApproxTracker(self.index, h, capacity) for h in self.holders]

    def runs(self, hashes: list[int]) -> list[int]:
        """Per rank, the leading hashes of the head its record holds."""
        m = self.index.match(hashes[: self.head])
        return [m.runs[h][0] if h in m.runs else 0 for h in self.holders]

    def match(self, i: int, hashes: list[int]) -> int:
        """Leading hashes of the head rank `i`'s record holds."""
        return self.runs(hashes)[i]

    def add(self, i: int, hashes: list[int]) -> None:
        """Record the head as routed to rank `i` (most recent last; the oldest leave first)."""
        self.lru[i].touch(hashes[: self.head])


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
        self.gpu = ApproxRecord(len(p_ranks), blocks, MAX_PREFIX_BLOCKS)
        self.cpu = ApproxRecord(len(p_ranks), CPU_LRU_BLOCKS * CPU_BLOCK_TOKENS // block_size,
                                cpu_head)

    def pick(self, ranks: list[Rank], req: SimRequest, decode: bool) -> Rank:
        if decode:
            return super().pick(ranks, req, decode)
        hashes = self._prompt_hashes(ranks, req)
        n = len(hashes)
        gh, ch = min(n, self.gpu.head), min(n, self.cpu.head)
        g_runs, c_runs = self.gpu.runs(hashes), self.cpu.runs(hashes)
        # the two scorers' values are their records' runs over their heads; `_cands` reads
        # matched / total for the GPU scorer and weighted / total for the GPU-or-CPU one, so
        # each run is scaled onto the candidate's common total
        cands = []
        for c, r in zip(_cands(ranks, req.hashes, 0), ranks):  # the load fields, no prefix
            k = self.pos[id(r)]
            g = g_runs[k] / gh if gh else 0.0
            cpu = c_runs[k] / ch if ch else 0.0
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


def cache_computed(pool: BlockPool, req: SimRequest, done: int, full: int) -> None:
    """Register blocks `done..full` of the request in `pool`'s prefix map."""
    if full > done:
        parent = req.hashes[done - 1] if done else None
        pool.cache_blocks(req.blocks[done:full], req.hashes[done:full], range(req.n_in), done, parent)


_INFO = BlockInfo()  # the simulator's CPU tier runs LRU: no session or position to tell it


def cpu_tier(blocks: int) -> TierSlots:
    """A rank's CPU tier of `blocks` blocks: the engine's slots and LRU retention policy (the
    reference's), with no bytes behind them (the simulator's clock prices the copies)."""
    return TierSlots(blocks, LRUPolicy())


def store_cpu(cpu: TierSlots | None, hashes: list[int]) -> int:
    """Write-through of full blocks to the CPU tier (LRU refresh for ones it holds); blocks
    stored. At most as many as the tier has unpinned slots (the rest would evict each other)."""
    if cpu is None or not hashes:
        return 0
    held = cpu.ready.__contains__
    for h in filter(held, hashes):  # the held ones are refreshed first, before stores evict
        cpu.policy.touch(h)
    new = list(itertools.filterfalse(held, hashes))[: cpu.num_slots - len(cpu.pins)]
    slots, reserve, commit = cpu.slots, cpu.reserve, cpu.commit
    for h in new:
        if h in slots:  # the same hash twice in one store: a slot taken, nothing kept
            if not cpu.free_slots and (v := cpu.policy.victim(cpu.is_pinned)) is not None:
                cpu.drop(v)
            continue
        reserve(h, _INFO)
        commit(h, True, _INFO)
    return len(new)


def refresh_cpu(cpu: TierSlots, hashes: list[int]) -> None:
    """Move the blocks of `hashes` the CPU tier holds to its LRU's newest end; write nothing."""
    ready, touch = cpu.ready, cpu.policy.touch
    for h in hashes:
        if h in ready:
            touch(h)


def fits(pool: BlockPool, hits: list[Block], need: int, reserved: int = 0) -> bool:
    """Can `need` new blocks be taken after touching `hits` (free hits leave the free queue),
    leaving `reserved` free? The scan of the hits is skipped when even all of them being free
    would fit, or when the new blocks alone do not."""
    free = pool.num_free_blocks - reserved
    if need + len(hits) <= free:
        return True
    if need > free:  # fails even if no hit is free: skip the scan
        return False
    return need + list(map(_REF_CNT, hits)).count(0) <= free


def mtp_accepted(rng: np.random.Generator, k: int, accept: tuple[float, ...] = MTP_ACCEPT) -> int:
    """Drafts accepted this step: position i is accepted with (unconditional) prob accept[i]."""
    u = rng.random()
    return sum(1 for a in accept[:k] if a > u)
