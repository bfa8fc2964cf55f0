"""Malformed P/D transfer parameters on an engine with KV transfer on (issue HARDEN-1, D1
and D2), at the engine level: the HTTP edge answers them with a 400, but whatever reaches
the core must not raise inside its step, where it failed every running request ("engine
step failed") and left the bad one unanswered, holding shutdown.

Beside three streams, each malformed request is computed locally (nothing to pull, no
peer contacted), the streams' tokens are those they get alone, and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from agentserve.engine.core.engine import AsyncEngine
from tests.conftest import TEST_DEVICE
from tests.engine.core.isolation import assert_clean, collect, run_engine

KW = dict(model=None, kv_cache_tokens=8192, block_size=16, max_model_len=1024, max_num_seqs=16,
          max_num_batched_tokens=512, seed=0, check_invariants=True, device=TEST_DEVICE,
          role="decode", kv_transfer_token="s3cret")
STREAMS = {f"s{i}": list(range(40 + 9 * i, 120 + 9 * i)) for i in range(3)}
BAD_PROMPT = list(range(200, 264))
GOOD_HASH = "00" * 16

# The repro first; then one broken field at a time.
BAD = {
    "d1_repro": {"remote_port": "abc", "remote_block_hashes": [1]},
    "port_not_int": {"remote_port": "abc", "remote_block_hashes": [GOOD_HASH]},
    "port_out_of_range": {"remote_port": 70000},
    "port_bool": {"remote_port": True},
    "hash_not_hex": {"remote_block_hashes": ["zz"]},
    "hashes_not_a_list": {"remote_block_hashes": "abcd"},
    "host_not_str": {"remote_host": 127},
    "no_request_id": {"remote_request_id": None},
}


def _params(fields: dict) -> dict:
    base = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
            "remote_port": 1, "remote_request_id": "x", "remote_block_hashes": [GOOD_HASH]}
    return {**base, **fields}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    async def body(eng: AsyncEngine) -> dict[str, list[int]]:
        return {rid: (await collect(eng, rid, p))[0] for rid, p in STREAMS.items()}
    return run_engine(body, **KW)[0]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_malformed_transfer_params_fail_nobody(reference, role: str) -> None:
    """D1: each malformed request beside three streams: the streams are unchanged, the bad
    one ends too (computed locally), and the engine pulls from and releases to nobody."""
    async def body(eng: AsyncEngine) -> dict[str, tuple]:
        alone_bad, _ = await collect(eng, "plain", BAD_PROMPT)
        seen: dict[str, tuple] = {}
        for name, fields in BAD.items():
            streams = [asyncio.create_task(collect(eng, f"{name}-{rid}", p))
                       for rid, p in STREAMS.items()]
            await asyncio.sleep(0.05)  # (the streams are running when it comes)
            bad = await collect(eng, name, BAD_PROMPT, kv_transfer=_params(fields))
            outs = await asyncio.gather(*streams)
            seen[name] = ({rid: toks for rid, (toks, _) in zip(STREAMS, outs)},
                          [last.error for _, last in outs], bad, alone_bad)
        return seen

    seen, eng = run_engine(body, **{**KW, "role": role})
    for name, (streams, errors, (toks, last), alone_bad) in seen.items():
        assert errors == [None] * 3, (name, errors)
        assert streams == reference, name
        assert last.finished and last.error is None and toks == alone_bad, (name, last)
    t = eng.stats().transfer
    assert t["pulls"] == 0 and t["pull_failures"] == 0 and t["pulls_in_flight"] == 0


def test_malformed_transfer_params_contact_no_peer() -> None:
    """A malformed request names a listener we own: the engine neither pulls from it nor
    sends it a release."""
    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(8)
        lsn.settimeout(0.5)
        port = lsn.getsockname()[1]
        bad = {"remote_port": port, "remote_block_hashes": ["zz"]}

        async def body(eng: AsyncEngine):
            out = await collect(eng, "bad", BAD_PROMPT, kv_transfer=_params(bad))
            await asyncio.sleep(0.5)  # (a release goes out on the kv-pull thread)
            return out

        (_, last), _ = run_engine(body, **KW)
        assert last.error is None
        with pytest.raises(TimeoutError):
            lsn.accept()


def test_a_malformed_request_is_answered_and_does_not_hold_shutdown() -> None:
    """D2: the bad request gets its answer at once, is counted nowhere afterwards, and
    shutdown with a generous drain timeout returns promptly."""
    async def go():
        eng = AsyncEngine.from_args(**KW)
        await eng.start()
        streams = [asyncio.create_task(collect(eng, rid, p)) for rid, p in STREAMS.items()]
        await asyncio.sleep(0.05)
        bads = [asyncio.wait_for(collect(eng, f"bad{i}", BAD_PROMPT[i:],
                                         kv_transfer=_params(BAD["d1_repro"])), 30)
                for i in range(5)]
        outs = await asyncio.gather(*bads, *streams)
        await asyncio.sleep(0.05)
        assert_clean(eng)
        stats = eng.stats()
        t0 = time.monotonic()
        await eng.shutdown(drain_timeout=30)
        return outs, stats, time.monotonic() - t0

    outs, stats, took = asyncio.run(go())
    assert all(last.finished and last.error is None for _, last in outs)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert took < 12  # (at most the core's stop; no request to drain)
