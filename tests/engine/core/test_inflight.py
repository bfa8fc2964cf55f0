"""In-flight prefix sharing (kv/inflight.py) over the engine's sequences: which waiting request waits for which
running one, and until when."""

from __future__ import annotations

import asyncio

from agentserve.engine.core.request import RequestStatus, SamplingParams
from agentserve.engine.core.sequence import Sequence
from agentserve.kv.inflight import MIN_JOIN_BLOCKS
from agentserve.kv.inflight import InflightPrefill as _Inflight
from tests.engine.core.test_engine import _greedy, _prompt, _run, _with_engine

BS = 16


def InflightPrefill(bs: int) -> _Inflight[Sequence]:
    """The scheduler's: a sequence computes while it is RUNNING."""
    return _Inflight(bs, computing=lambda s: s.status == RequestStatus.RUNNING)


def seq(rid: str, blocks: list[bytes], extra: int = 5) -> Sequence:
    s = Sequence(rid, list(range(len(blocks) * BS + extra)), SamplingParams(max_tokens=1))
    s.block_hashes = list(blocks)
    return s


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def test_a_request_waits_only_for_a_long_enough_shared_run_being_computed() -> None:
    f = InflightPrefill(BS)
    head = keys("h", 10)
    leader = seq("L", head)
    leader.status = RequestStatus.RUNNING
    f.add(leader, 2)  # blocks 0-1 were a prefix hit: it computes 2-9
    assert f.joins(seq("F", head + keys("f", 3)), 2) == ("L", 10 * BS)
    # a follower whose own device hit is longer waits for less
    assert f.joins(seq("F", head[:8] + keys("f", 3)), 4) == ("L", 8 * BS)
    short = head[:2 + MIN_JOIN_BLOCKS - 1] + keys("g", 6)
    assert f.joins(seq("G", short), 2) is None  # cheaper to compute than to wait for
    assert f.joins(seq("X", keys("x", 12)), 0) is None
    assert f.joins(leader, 2) is None  # never itself


def test_the_wait_ends_when_the_leader_computed_the_blocks_or_left() -> None:
    f = InflightPrefill(BS)
    head = keys("h", 12)
    leader = seq("L", head)
    leader.status = RequestStatus.RUNNING
    f.add(leader, 0)
    assert not f.ready("L", 8 * BS)
    leader.num_computed_tokens = 8 * BS - 1
    assert not f.ready("L", 8 * BS)
    leader.num_computed_tokens = 8 * BS
    assert f.ready("L", 8 * BS)
    leader.num_computed_tokens = 0
    leader.status = RequestStatus.PREEMPTED
    assert f.ready("L", 8 * BS)
    f.prune()
    assert not f.owner and len(f) == 0


def test_too_short_a_computation_is_not_registered() -> None:
    f = InflightPrefill(BS)
    s = seq("L", keys("h", MIN_JOIN_BLOCKS + 1))
    f.add(s, 2)
    assert len(f) == 0 and not f.owner
    f.drop("nobody")  # harmless


def test_the_request_waited_on_is_aborted_mid_prefill() -> None:
    """The follower computes the head itself then, with the same answer."""
    shared = _prompt(480, 50)
    prompts = [shared + _prompt(30, 51), shared + _prompt(30, 52)]

    async def alone(eng):
        return [(await _run(eng, f"a{i}", p, _greedy(5)))[0] for i, p in enumerate(prompts)]

    async def go(eng):
        leader = eng.generate("lead", prompts[0], _greedy(5))
        first = asyncio.ensure_future(leader.__anext__())
        follower = asyncio.ensure_future(_run(eng, "follow", prompts[1], _greedy(5)))
        for _ in range(200):  # until the follower is parked behind the leader
            if eng.core.scheduler.joined:
                break
            await asyncio.sleep(0.005)
        parked = {k: [s.request_id for s in v] for k, v in eng.core.scheduler.joined.items()}
        await eng.abort("lead")
        await first
        await leader.aclose()
        toks, _ = await follower
        return parked, toks, eng.core.scheduler

    ref = asyncio.run(_with_engine(alone))
    parked, toks, sched = asyncio.run(_with_engine(go, max_num_batched_tokens=512,
                                                   long_prefill_token_threshold=32))
    assert parked == {"lead": ["follow"]}
    assert toks == ref[1]
    assert sched.joined == {} and not sched.inflight.owner


def test_a_waiting_request_aborted_leaves_no_trace() -> None:
    """Aborted while it waits on another request's computation: it ends at once, and the
    scheduler has nothing left to do once the other finishes (no spinning core loop)."""
    shared = _prompt(480, 60)
    prompts = [shared + _prompt(30, 61), shared + _prompt(30, 62)]

    async def go(eng):
        leader = asyncio.ensure_future(_run(eng, "lead", prompts[0], _greedy(3)))
        follower = asyncio.ensure_future(_run(eng, "follow", prompts[1], _greedy(3)))
        for _ in range(200):
            if eng.core.scheduler.joined:
                break
            await asyncio.sleep(0.005)
        parked = {k: [s.request_id for s in v] for k, v in eng.core.scheduler.joined.items()}
        await eng.abort("follow")
        _, last = await follower
        await leader
        return parked, last.finish_reason, eng.core.scheduler

    parked, reason, sched = asyncio.run(_with_engine(go, max_num_batched_tokens=512,
                                                     long_prefill_token_threshold=32))
    assert parked == {"lead": ["follow"]} and reason == "abort"
    assert sched.joined == {} and not sched.has_work()


def test_joined_tokens_count_each_hit_once_when_the_leader_hands_over() -> None:
    """Two requests wait on a leader that is aborted mid-prefill: the first of them takes
    over the head and the other waits again, now on it. `prefix_joined_tokens` counts what
    the waits added to their prefix hits (here all of it: nothing was cached before), once,
    not once per wait."""
    shared = _prompt(480, 70)
    prompts = [shared + _prompt(30, 71 + i) for i in range(3)]

    async def go(eng):
        leader = eng.generate("lead", prompts[0], _greedy(3))
        first = asyncio.ensure_future(leader.__anext__())
        followers = [asyncio.ensure_future(_run(eng, f"f{i}", prompts[i], _greedy(3)))
                     for i in (1, 2)]
        sched = eng.core.scheduler
        for _ in range(400):  # until both are parked behind the leader
            if sum(len(v) for v in list(sched.joined.values())) == 2:
                break
            await asyncio.sleep(0.005)
        parked = {k: [s.request_id for s in v] for k, v in sched.joined.items()}
        await eng.abort("lead")
        await first
        await leader.aclose()
        outs = [last for _, last in await asyncio.gather(*followers)]
        return parked, outs, sched.stats

    parked, outs, stats = asyncio.run(_with_engine(go, max_num_batched_tokens=512,
                                                   long_prefill_token_threshold=32))
    assert parked == {"lead": ["f1", "f2"]}
    cached = [o.num_cached_tokens for o in outs]
    assert cached[1] == 480  # f2 hit the whole head: f1 (or the leader) computed it
    assert stats.prefix_joined_tokens == sum(cached)
