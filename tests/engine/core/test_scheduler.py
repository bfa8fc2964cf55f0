"""Scheduler + KV manager without a model: budgets, FCFS, preemption, prefix hits, no leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.engine.core.request import RequestStatus, SamplingParams
from agentserve.engine.core.scheduler import Scheduler
from agentserve.engine.core.sequence import Sequence
from agentserve.kv.hashing import BlockHasher
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.pool import BlockPool

BS = 4


def make(num_blocks: int = 16, max_seqs: int = 8, budget: int = 32,
         long_prefill: int = 0) -> Scheduler:
    pool = BlockPool(num_blocks, BS)
    kv = KVCacheManager(pool, BlockHasher(block_size=BS, seed="0"))
    return Scheduler(kv, max_seqs, budget, long_prefill_token_threshold=long_prefill)


def seq(rid: str, n: int, start: int = 0, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def advance(s: Scheduler, new_token: int = 999) -> list[Sequence]:
    """Pretend the model ran: advance computed tokens, cache blocks, append a token when due."""
    out = s.schedule()
    for e in out.scheduled:
        done = e.completes_prompt
        e.seq.num_computed_tokens += e.num_tokens
        s.kv.cache_blocks(e.seq)
        if done:
            e.seq.token_ids.append(new_token)
    return [e.seq for e in out.scheduled]


def test_chunked_prefill_respects_budget() -> None:
    s = make(budget=8)
    a = seq("a", 20)
    s.add(a)
    sizes = []
    for _ in range(3):
        out = s.schedule()
        sizes.append(out.num_tokens)
        for e in out.scheduled:
            e.seq.num_computed_tokens += e.num_tokens
    assert sizes == [8, 8, 4]
    assert a.num_computed_tokens == 20


def test_decodes_and_prefill_share_a_step() -> None:
    s = make(budget=10)
    a, b = seq("a", 6), seq("b", 30, start=100)
    s.add(a)
    advance(s)  # a prefilled (6 tokens), now decoding
    s.add(b)
    out = s.schedule()
    assert [(e.seq.request_id, e.num_tokens) for e in out.scheduled] == [("a", 1), ("b", 9)]


def test_long_prefill_threshold_lets_a_short_request_share_the_steps() -> None:
    """Without the cap a long prefill takes each step's whole budget and the short
    request behind it waits until it is done; with it both are computed side by side."""
    for cap, first_b_step in ((0, 3), (6, 0)):
        s = make(num_blocks=32, budget=12, long_prefill=cap)
        a, b = seq("a", 44), seq("b", 5, start=200)
        s.add(a)
        s.add(b)
        steps = []
        for _ in range(6):
            out = s.schedule()
            steps.append({e.seq.request_id: e.num_tokens for e in out.scheduled})
            for e in out.scheduled:
                done = e.completes_prompt
                e.seq.num_computed_tokens += e.num_tokens
                s.kv.cache_blocks(e.seq)
                if done:
                    e.seq.token_ids.append(999)
        assert all(sum(x.values()) <= 12 for x in steps)
        assert all(x.get("a", 0) <= (cap or 12) for x in steps)
        assert next(i for i, x in enumerate(steps) if "b" in x) == first_b_step, steps


def test_fcfs_head_blocks_queue() -> None:
    s = make(num_blocks=4, budget=64)  # 16 tokens of KV
    big, small = seq("big", 15), seq("small", 3, start=50)
    s.add(seq("first", 8, start=200))
    advance(s)
    s.add(big)
    s.add(small)
    out = s.schedule()
    # `big` does not fit beside `first`; `small` would, but must not overtake it.
    assert [e.seq.request_id for e in out.scheduled] == ["first"]


def test_preempts_newest_and_recomputes() -> None:
    s = make(num_blocks=6, budget=64)  # 24 tokens
    a, b = seq("a", 11), seq("b", 11, start=100)
    s.add(a)
    s.add(b)
    advance(s)  # both prefilled: 3 blocks each, pool full
    for _ in range(2):
        advance(s)
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert s.waiting[0] is b and b.num_computed_tokens == 0
    assert a.status == RequestStatus.RUNNING
    s.kv.pool.check_invariants()


def test_prefix_hit_counts_and_leaves_last_token() -> None:
    s = make()
    a = seq("a", 12)
    s.add(a)
    advance(s)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = seq("b", 12)  # same 12 tokens: 3 full blocks cached, but the last token is recomputed
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 8 and out.scheduled[0].num_tokens == 4
    assert s.stats.prefix_queries_tokens == 24 and s.stats.prefix_hits_tokens == 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(4, 24), st.integers(4, 40), st.sampled_from([0, 4, 8]))
def test_random_workloads_finish_without_leaks(reqs, num_blocks, budget, chunk_cap) -> None:
    """Prompts share heads (4 distinct starts), so requests also wait on each other's
    computation (kv/inflight.py); with a chunk cap, also mid-prefill."""
    s = make(num_blocks=num_blocks, max_seqs=4, budget=budget, long_prefill=chunk_cap)
    cap = num_blocks * BS
    seqs = []
    for i, (n, out, prefix) in enumerate(reqs):
        n = min(n, cap - out - 1)
        if n < 1:
            continue
        q = seq(f"r{i}", n, start=prefix * 1000, max_tokens=out)
        seqs.append(q)
        s.add(q)
    for _ in range(2000):
        if not s.has_work():
            break
        for q in advance(s):
            if q.num_output_tokens >= q.params.max_tokens and q.num_computed_tokens == q.num_tokens - 1:
                s.finish(q, RequestStatus.FINISHED_LENGTH)
        s.kv.pool.check_invariants()
    assert not s.has_work(), "scheduler did not drain (starvation or deadlock)"
    assert all(q.num_output_tokens == q.params.max_tokens for q in seqs)
    assert s.kv.pool.num_used_blocks == 0 and not s.kv.req_blocks
    assert not s.joined and not s.inflight.owner and not s.kv_waits._join_need
