"""P/D disaggregation between two real engines (in-process servers on the tiny model).

The test client plays the router: prefill leg (max_tokens=1, stream=false,
do_remote_decode) on P, decode leg with the returned kv_transfer_params on D.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conftest import TEST_DEVICE, ServerThread

TOKEN = "s3cret"  # the cluster's --kv-transfer-token; this test client signs as the router does
KW = dict(model=None, kv_cache_tokens=8192, block_size=16, max_model_len=1024, max_num_seqs=16,
          max_num_batched_tokens=512, seed=0, check_invariants=True, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[ServerThread, ServerThread]]:
    p = ServerThread(role="prefill", kv_transfer_timeout=30.0, kv_transfer_token=TOKEN, **KW).start()
    d = ServerThread(role="decode", kv_transfer_token=TOKEN, **KW).start()
    yield p, d
    p.close()
    d.close()


def signed(params: dict[str, Any], purpose: str = "kv_transfer_params") -> dict[str, str]:
    """The headers of a request carrying ``params``, signed as the router signs them."""
    from agentserve.api.kv_transfer import signed_headers

    return {"Content-Type": "application/json", **signed_headers(TOKEN, params, purpose)}


def post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    """POST as the router would: kv_transfer_params (and release calls) signed."""
    headers = {"Content-Type": "application/json"}
    if "kv_transfer_params" in body:
        headers = signed(body["kv_transfer_params"])
    elif path.endswith("/kv_transfer/release"):
        headers = signed(body, "release")
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def prefill_leg(p: ServerThread, body: dict[str, Any], path: str = "/v1/completions") -> dict:
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    out = post(p.url, leg, path)
    assert out["kv_transfer_params"]["do_remote_prefill"] is True
    return out["kv_transfer_params"]


def disagg(p: ServerThread, d: ServerThread, body: dict[str, Any], path: str = "/v1/completions") -> dict:
    params = prefill_leg(p, body, path)
    return post(d.url, {**body, "kv_transfer_params": params}, path)


def transfer(s: ServerThread) -> dict[str, Any]:
    return s.engine.stats().transfer


def wait_clean(*servers: ServerThread, timeout: float = 10.0) -> None:
    """Idle, no pins held, no blocks referenced (only cached-free ones)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.engine.core.remote.num_pinned == 0 and s.engine.core.kv.pool.num_used_blocks == 0
               and not s.engine.core.scheduler.pulling for s in servers):
            return
        time.sleep(0.05)
    raise AssertionError([(transfer(s), s.engine.core.kv.pool.num_used_blocks) for s in servers])


def block_bytes(s: ServerThread) -> int:
    k = s.engine.core.remote.k
    return 2 * k.shape[0] * k[0, 0].numel() * k.element_size()


def test_greedy_identical_aggregated_and_pd(pd: tuple[ServerThread, ServerThread]) -> None:
    p, d = pd
    rng = random.Random(7)
    lengths = [1, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 400] + [rng.randint(2, 600) for _ in range(8)]
    for n in lengths:
        prompt = [rng.randint(3, 500) for _ in range(n)]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
        ref = post(p.url, body)["choices"][0]["text"]  # aggregated path on an identical engine
        got = disagg(p, d, body)
        assert got["choices"][0]["text"] == ref, f"prompt of {n} tokens"
        assert got["usage"]["prompt_tokens"] == n
    assert transfer(d)["pull_failures"] == 0
    assert transfer(d)["pulls"] >= 10
    wait_clean(p, d)


def test_sampling_controls_survive_the_split(pd: tuple[ServerThread, ServerThread]) -> None:
    """min_tokens above the prefill leg's single token, penalties and bias: same answer
    aggregated and disaggregated (greedy)."""
    p, d = pd
    body = {"prompt": list(range(30, 330)), "max_tokens": 12, "temperature": 0, "min_tokens": 8,
            "repetition_penalty": 1.3, "logit_bias": {"7": 3.0}, "ignore_eos": True}
    assert disagg(p, d, body)["choices"][0]["text"] == post(d.url, body)["choices"][0]["text"]


def test_chat_with_tools_on_both_legs(pd: tuple[ServerThread, ServerThread]) -> None:
    p, d = pd
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "weather in Paris? " * 20}], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200,
            "temperature": 0}
    ref = post(p.url, body, "/v1/chat/completions")["choices"][0]
    got = disagg(p, d, body, "/v1/chat/completions")["choices"][0]
    assert got["finish_reason"] == ref["finish_reason"] == "tool_calls"
    fn = [c["function"] for c in got["message"]["tool_calls"]]
    assert fn == [c["function"] for c in ref["message"]["tool_calls"]]
    assert fn[0]["name"] == "get_weather"


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"max_tokens": 6, "temperature": 0, "system": "You are terse.",
                      "messages": [{"role": "user", "content": "fix the bug " * 40}]}),
    ("/v1/responses", {"max_output_tokens": 6, "temperature": 0, "instructions": "Be terse.",
                       "input": "run the tests " * 40}),
])
def test_agent_apis_split_into_legs(pd: tuple[ServerThread, ServerThread], path: str,
                                    body: dict[str, Any]) -> None:
    """Anthropic Messages and Responses requests carry kv_transfer_params like chat's: the
    prefill leg answers with the params, the decode leg pulls the prompt and answers as
    the aggregated engine does (greedy)."""
    p, d = pd
    pulls = transfer(d)["pulls"]
    ref = post(p.url, body, path)
    got = disagg(p, d, body, path)
    text = (lambda r: r["content"][0]["text"]) if path == "/v1/messages" else \
        (lambda r: r["output"][0]["content"][0]["text"])
    assert text(got) == text(ref)
    assert transfer(d)["pulls"] == pulls + 1 and transfer(d)["pull_failures"] == 0
    wait_clean(p, d)


def test_only_missing_blocks_are_pulled(pd: tuple[ServerThread, ServerThread]) -> None:
    p, d = pd
    rng = random.Random(11)
    base = [rng.randint(3, 500) for _ in range(160)]  # 10 full blocks
    disagg(p, d, {"prompt": base + [7], "max_tokens": 2, "temperature": 0})
    before = transfer(d)
    grown = base + [rng.randint(3, 500) for _ in range(80)]  # 240 tokens: 14 full blocks usable
    disagg(p, d, {"prompt": grown, "max_tokens": 2, "temperature": 0})
    after = transfer(d)
    pulled = after["blocks_pulled"] - before["blocks_pulled"]
    assert pulled == (len(grown) - 1) // 16 - 10  # the 10 shared blocks stay local
    assert after["bytes_received"] - before["bytes_received"] == pulled * block_bytes(d)
    wait_clean(p, d)


def test_decode_legs_sharing_a_prefix_pull_it_once(pd: tuple[ServerThread, ServerThread],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two decode legs over one prefix at once (a sub-agent group): the second waits for the
    first's pull and then finds the shared blocks on its device, pulling only its own tail;
    the answers are the aggregated path's."""
    p, d = pd
    rng = random.Random(23)
    shared = [rng.randint(3, 500) for _ in range(160)]  # 10 full blocks
    bodies = [{"prompt": shared + [rng.randint(3, 500) for _ in range(40)], "max_tokens": 4,
               "temperature": 0} for _ in range(2)]  # 12 full blocks each, 10 shared
    refs = [post(p.url, b)["choices"][0]["text"] for b in bodies]
    params = [prefill_leg(p, b) for b in bodies]
    backend = d.engine.core.remote.backend
    pull = backend.pull_into

    def slow_pull(*args):  # a slow link: the first pull is still running when the second leg comes
        time.sleep(0.5)
        return pull(*args)
    monkeypatch.setattr(backend, "pull_into", slow_pull)
    before = transfer(d)
    got: list[Any] = [None, None]

    def leg(i: int) -> None:
        got[i] = post(d.url, {**bodies[i], "kv_transfer_params": params[i]})
    threads = [threading.Thread(target=leg, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    after = transfer(d)
    assert [g["choices"][0]["text"] for g in got] == refs
    assert after["blocks_pulled"] - before["blocks_pulled"] == 12 + 2  # the shared 10 once
    assert after["blocks_joined"] - before["blocks_joined"] == 10
    assert after["bytes_received"] - before["bytes_received"] == 14 * block_bytes(d)
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * 16
    assert d.engine.core.scheduler.joined == {}
    wait_clean(p, d)


def test_prefill_engine_counts_prompt_tokens(pd: tuple[ServerThread, ServerThread]) -> None:
    p, _ = pd
    before = p.engine.stats().prompt_tokens
    params = prefill_leg(p, {"prompt": list(range(10, 90)), "temperature": 0})
    assert p.engine.stats().prompt_tokens - before == 80
    p.engine.core.remote.release(params["remote_request_id"])  # nobody will pull it
    body = urllib.request.urlopen(p.url + "/metrics").read().decode()
    assert "vllm:prompt_tokens_total" in body and "agentserve:kv_transfer_sent_bytes" in body


def _truncating_server(nbytes: int) -> tuple[int, threading.Thread]:
    """A fake prefill transfer server that dies after sending part of a payload."""
    from agentserve.kv.remote.auth import server_handshake
    from agentserve.kv.remote.frames import recv_header, send_frame

    lst = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lst.accept()
        with conn, lst:
            server_handshake(conn, TOKEN, time.monotonic() + 5)
            recv_header(conn)
            send_frame(conn, {"ok": True, "nbytes": nbytes, "shape": [nbytes // 4], "dtype": "float32",
                              "sum": 0})
            conn.sendall(b"\0" * (nbytes // 3))  # then the "engine" dies

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lst.getsockname()[1], t


def pinned_sums(p: ServerThread, rid: str, timeout: float = 10.0) -> list[int]:
    """The block sums the prefill engine took off the pull path after pinning ``rid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pin = p.engine.core.remote.pins.get(rid)
        if pin is not None and pin.sums is not None:
            return pin.sums
        time.sleep(0.01)
    raise AssertionError(f"no pinned sums for {rid}")


def test_pins_are_checksummed_once_off_the_pull_path(pd: tuple[ServerThread, ServerThread]) -> None:
    from agentserve.kv.remote.frames import block_sums

    p, d = pd
    prompt = [random.Random(7).randint(3, 500) for _ in range(200)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    ref = post(p.url, body)["choices"][0]["text"]
    params = prefill_leg(p, body)
    rid = params["remote_request_id"]
    sums = pinned_sums(p, rid)
    remote = p.engine.core.remote
    pin = remote.pins[rid]
    assert len(sums) == len(pin.hashes) == len(params["remote_block_hashes"]) == 200 // 16
    assert sums == block_sums(remote.k, remote.v, [b.block_id for b in pin.blocks[:len(sums)]])
    assert remote.pinned_sums(rid, [1, 3]) == [sums[1], sums[3]]
    assert remote.pinned_sums(rid, [len(sums)]) is None  # out of range: the server sums itself
    fails = transfer(d)["pull_failures"]
    assert post(d.url, {**body, "kv_transfer_params": params})["choices"][0]["text"] == ref
    assert transfer(d)["pull_failures"] == fails
    wait_clean(p, d)


@pytest.mark.parametrize("fault", ["dies_mid_transfer", "refused", "hash_mismatch",
                                   "corrupted_pinned_sum"])
def test_failed_pull_recomputes(pd: tuple[ServerThread, ServerThread], fault: str) -> None:
    p, d = pd
    prompt = [random.Random(fault).randint(3, 500) for _ in range(300)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    ref = post(p.url, body)["choices"][0]["text"]
    params = prefill_leg(p, body)
    if fault == "corrupted_pinned_sum":  # the decode side sums what it gets: a mismatch
        pinned_sums(p, params["remote_request_id"])[5] ^= 1 << 33
    elif fault == "dies_mid_transfer":
        params["remote_port"], _ = _truncating_server(1 << 20)
    elif fault == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            params["remote_port"] = s.getsockname()[1]  # nobody listens there
    else:
        params["remote_block_hashes"][3] = "00" * 32
    fails = transfer(d)["pull_failures"]
    got = post(d.url, {**body, "kv_transfer_params": params})
    assert got["choices"][0]["text"] == ref
    if fault != "hash_mismatch":
        assert transfer(d)["pull_failures"] == fails + 1
    p.engine.core.remote.release(params["remote_request_id"])  # the fake peers never released it
    p.engine.core.inbox.put(None)
    wait_clean(p, d)


def test_abort_during_pull_leaks_nothing(pd: tuple[ServerThread, ServerThread]) -> None:
    p, d = pd
    import http.client

    for n in (700, 900):
        prompt = [random.Random(n).randint(3, 500) for _ in range(n)]
        body = {"prompt": prompt, "max_tokens": 50, "temperature": 0, "stream": True}
        params = prefill_leg(p, body)
        conn = http.client.HTTPConnection(d.url.removeprefix("http://"), timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({**body, "kv_transfer_params": params}),
                     signed(params))
        conn.sock.close()  # client gone while the pull runs (or just after)
        conn.close()
    wait_clean(p, d, timeout=15)


def test_unpulled_pins_expire() -> None:
    p = ServerThread(role="prefill", kv_transfer_timeout=0.5, kv_transfer_token=TOKEN, **KW).start()
    try:
        prefill_leg(p, {"prompt": list(range(5, 100)), "temperature": 0})
        assert p.engine.core.remote.num_pinned == 1
        wait_clean(p, timeout=5)
        assert transfer(p)["pins_expired"] == 1
    finally:
        p.close()


def test_bad_token_is_refused(pd: tuple[ServerThread, ServerThread]) -> None:
    from agentserve.kv.remote.backend import PullSpec
    from agentserve.kv.remote.frames import TransferError
    from agentserve.kv.remote.wire import TcpBackend

    p, _ = pd
    spec = PullSpec("127.0.0.1", p.engine.core.remote.port, "nope", [0], [b"x"])
    k = torch.zeros(1, 4, 16, 1, 8)
    with pytest.raises(TransferError, match="token"):
        TcpBackend("wrong").pull_into(spec, k, k.clone(), [0])


def test_release_endpoint_frees_pins_at_once(pd: tuple[ServerThread, ServerThread]) -> None:
    """What the router calls when its client left between the legs (timeout here: 30 s)."""
    p, _ = pd
    before = transfer(p)["pins_released"]
    params = prefill_leg(p, {"prompt": list(range(40, 140)), "temperature": 0})
    assert p.engine.core.remote.num_pinned == 1
    out = post(p.url, {"remote_request_id": params["remote_request_id"]}, "/v1/kv_transfer/release")
    assert out == {"released": params["remote_request_id"]}
    wait_clean(p, timeout=3)
    assert transfer(p)["pins_released"] == before + 1
    post(p.url, {"remote_request_id": "unknown"}, "/v1/kv_transfer/release")  # a no-op


@pytest.mark.parametrize("prompt_len", [60, 900])
def test_prefill_leg_whose_client_left_frees_its_pins(pd: tuple[ServerThread, ServerThread],
                                                      prompt_len: int) -> None:
    """The router's client left while the prefill leg ran: the params never reach anyone,
    so the engine frees the pins at once (before: they waited the 30 s timeout here)."""
    import http.client

    p, _ = pd
    wait_clean(p)
    before = transfer(p)["pins_released"]
    leg = {"prompt": list(range(5, 5 + prompt_len)), "max_tokens": 1, "temperature": 0,
           "kv_transfer_params": {"do_remote_decode": True}}
    conn = http.client.HTTPConnection("127.0.0.1", int(p.url.rsplit(":", 1)[1]), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(leg), signed(leg["kv_transfer_params"]))
    conn.sock.shutdown(socket.SHUT_RDWR)  # gone before the engine answers
    conn.close()
    deadline = time.monotonic() + 10
    while transfer(p)["pins_released"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert transfer(p)["pins_released"] == before + 1
    wait_clean(p, timeout=5)


def test_pulled_blocks_reach_a_write_back_tier_when_evicted(pd: tuple[ServerThread, ServerThread]) -> None:
    """A decode engine with a small device pool and a write-back CPU tier: each pull's
    allocation evicts the previous request's blocks, which are stored as they go; a later
    local request for the first prompt restores them and gives the reference tokens."""
    p, _ = pd
    d = ServerThread(role="decode", kv_transfer_token=TOKEN,
                     **{**KW, "kv_cache_tokens": 512, "max_model_len": 512,
                        "kv_cpu_gib": 0.01, "kv_store_on": "evict"}).start()
    try:
        rng = random.Random(11)
        x, y = ([rng.randint(3, 500) for _ in range(n)] for n in (300, 400))
        body = {"prompt": x, "max_tokens": 6, "temperature": 0}
        ref = post(p.url, body)["choices"][0]["text"]
        assert disagg(p, d, body)["choices"][0]["text"] == ref
        disagg(p, d, {"prompt": y, "max_tokens": 6, "temperature": 0})  # evicts x on d
        tiers = d.engine.stats().tiers
        assert tiers["store_blocks"]["cpu"] > 0 and transfer(d)["pull_failures"] == 0
        again = post(d.url, body)  # aggregated on d: x's prefix comes back from the CPU tier
        assert again["choices"][0]["text"] == ref
        details = again["usage"]["prompt_tokens_details"]
        assert details["cached_tokens_by_tier"]["cpu"] > 0
        wait_clean(d)
    finally:
        d.close()


def evicted_on_tiered_decode(p: ServerThread, seed: int) -> tuple[ServerThread, list[int], list[int], int]:
    """A small decode engine with a write-back CPU tier, after a decode leg of prompt x and
    one of y that evicted part of x from its device: (engine, x, more tokens, x's blocks the
    device still holds). Pulls have run, so the pull throughput is measured."""
    d = ServerThread(role="decode", kv_transfer_token=TOKEN,
                     **{**KW, "kv_cache_tokens": 512, "max_model_len": 512,
                        "kv_cpu_gib": 0.01, "kv_store_on": "evict"}).start()
    try:
        rng = random.Random(seed)
        x, y, more = ([rng.randint(3, 500) for _ in range(n)] for n in (300, 400, 100))
        disagg(p, d, {"prompt": x, "max_tokens": 6, "temperature": 0})
        disagg(p, d, {"prompt": y, "max_tokens": 6, "temperature": 0})  # evicts x on d
        hashes: list[bytes] = []
        d.engine.core.kv.hasher.extend(hashes, x)
        held = sum(h in d.engine.core.kv.pool.cached for h in hashes[:len(x) // 16])
        assert held < len(x) // 16  # the device lost some of x: its CPU tier has them
        assert d.engine.core.remote.pull_bw  # measured by the pulls above
    except BaseException:
        d.close()
        raise
    return d, x, more, held


@pytest.mark.parametrize("restore_fails", [False, True])
def test_decode_leg_restores_its_own_tier_hit_and_pulls_only_the_rest(
        pd: tuple[ServerThread, ServerThread], restore_fails: bool) -> None:
    """A decode engine whose CPU tier holds the front of a decode leg's prompt restores it
    locally (restoring is estimated faster than pulling) and pulls from the prefill engine
    only the blocks past it; if that restore fails, it pulls them too."""
    p, _ = pd
    d, x, more, held = evicted_on_tiered_decode(p, 12)
    try:
        shared = len(x) // 16  # x's full blocks; the next one holds x's outputs on d
        before, tiers0 = transfer(d), d.engine.stats().tiers
        d.engine.core.remote.pull_bw = 1e6  # a slow network: restoring is faster
        if restore_fails:
            def broken(*_: Any) -> list:
                raise RuntimeError("simulated restore failure")
            d.engine.core.tiers._load_job = broken  # type: ignore[method-assign]
        body = {"prompt": x + more, "max_tokens": 6, "temperature": 0}
        ref = post(p.url, body)["choices"][0]["text"]
        out = disagg(p, d, body)
        assert out["choices"][0]["text"] == ref
        after, tiers1 = transfer(d), d.engine.stats().tiers
        restored = tiers1["restore_blocks"]["cpu"] - tiers0["restore_blocks"]["cpu"]
        pulled = after["blocks_pulled"] - before["blocks_pulled"]
        usable = (len(x) + len(more) - 1) // 16
        assert tiers1["restore_failures"] - tiers0["restore_failures"] == restore_fails
        if restore_fails:
            assert restored == 0 and pulled == usable - held
        else:
            assert restored == shared - held and pulled == usable - shared
        assert after["pull_failures"] == before["pull_failures"]
        details = out["usage"]["prompt_tokens_details"]
        by = {"gpu": held * 16, "cpu": restored * 16, "remote": pulled * 16}
        assert details["cached_tokens_by_tier"] == {t: n for t, n in by.items() if n or t == "gpu"}
        assert details["cached_tokens"] == (held + restored + pulled) * 16
        assert tiers1["decisions"]["pull"] == tiers0["decisions"]["pull"]
        wait_clean(p, d)
    finally:
        d.close()


def test_decode_leg_pulls_its_tier_hit_when_pulling_is_faster(
        pd: tuple[ServerThread, ServerThread]) -> None:
    """With the measured restore bandwidth far below the measured pull throughput, a decode
    leg leaves its CPU tier hit alone and pulls everything past its device hit; the choice
    and both estimates are in the metrics."""
    p, _ = pd
    d, x, more, held = evicted_on_tiered_decode(p, 13)
    try:
        d.engine.core.tiers.est.bw["cpu"] = 1e3  # a restore estimated far slower than a pull
        before, tiers0 = transfer(d), d.engine.stats().tiers
        body = {"prompt": x + more, "max_tokens": 6, "temperature": 0}
        ref = post(p.url, body)["choices"][0]["text"]
        out = disagg(p, d, body)
        assert out["choices"][0]["text"] == ref
        after, tiers1 = transfer(d), d.engine.stats().tiers
        usable = (len(x) + len(more) - 1) // 16
        assert tiers1["restore_blocks"]["cpu"] == tiers0["restore_blocks"]["cpu"]
        assert after["blocks_pulled"] - before["blocks_pulled"] == usable - held
        assert tiers1["decisions"]["pull"] == tiers0["decisions"]["pull"] + 1
        assert tiers1["decisions"]["restore"] == tiers0["decisions"]["restore"]
        assert 0 < tiers1["last_pull_estimate_s"] < tiers1["last_restore_estimate_s"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"] == {
            "gpu": held * 16, "remote": (usable - held) * 16}
        with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'agentserve:kv_restore_decisions_total{choice="pull",model_name=' in text
        assert "agentserve:kv_transfer_pull_bandwidth_bytes_per_second{" in text
        wait_clean(p, d)
    finally:
        d.close()


def test_concurrent_sessions_restore_pull_and_abort_on_a_small_decode_engine(
        pd: tuple[ServerThread, ServerThread]) -> None:
    """Six growing sessions at once, through a decode engine whose device holds about two
    prompts: decode legs restore from its write-back CPU tier, pull the rest, are aborted and
    (3-5 times in a run here) preempted; every finished answer equals the aggregated one and
    nothing leaks."""
    import concurrent.futures
    import http.client

    p, _ = pd
    d = ServerThread(role="decode", kv_transfer_token=TOKEN,
                     **{**KW, "kv_cache_tokens": 576, "max_model_len": 512,
                        "kv_cpu_gib": 0.02, "kv_store_on": "evict"}).start()
    try:
        def session(i: int) -> int:
            rng = random.Random(100 + i)
            prompt, done = [rng.randint(3, 500) for _ in range(120)], 0
            for turn in range(5):
                prompt += [rng.randint(3, 500) for _ in range(rng.randint(20, 60))]
                body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
                if (i + turn) % 4 == 3:  # this leg's client leaves at once
                    params = prefill_leg(p, body)
                    conn = http.client.HTTPConnection(d.url.removeprefix("http://"), timeout=10)
                    conn.request("POST", "/v1/completions",
                                 json.dumps({**body, "stream": True, "kv_transfer_params": params}),
                                 signed(params))
                    conn.sock.close()
                    conn.close()
                    continue
                ref = post(p.url, body)["choices"][0]["text"]
                assert disagg(p, d, body)["choices"][0]["text"] == ref, (i, turn)
                done += 1
            return done

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            assert sum(ex.map(session, range(6))) == 23
        t, x = d.engine.stats().tiers, transfer(d)
        assert t["restore_blocks"]["cpu"] > 0 and x["blocks_pulled"] > 0
        assert x["pull_failures"] == 0 and t["restore_outcome"]["failed"] == 0
        wait_clean(p, d, timeout=15)
    finally:
        d.close()
