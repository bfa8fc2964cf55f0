"""The router's own bookkeeping (router/ledger.py), shared with the simulator's router."""

from __future__ import annotations

from agentserve.router.config import EndpointConfig, Options
from agentserve.router.endpoints import Endpoint
from agentserve.router.ledger import MIN_LEARN_TOKENS, Ledger


def _ledger(n: int = 2, **opts) -> tuple[Ledger, list[Endpoint]]:
    eps = [Endpoint(EndpointConfig(url=f"http://e{i}")) for i in range(n)]
    return Ledger({ep.url: ep for ep in eps}, Options(**opts)), eps


def test_book_then_finish_leaves_nothing_behind() -> None:
    led, (a, _) = _ledger()
    assert led.book(a, 3000, 3100, "s", 0.0) == 0
    assert led.book(a, 500, 600, None, 0.1) == 3000  # the prefill queued ahead of it
    assert (a.inflight, a.inflight_tokens, a.pending_prefill) == (2, 3700, 3500)
    assert led.liveness.busy("s")
    led.first_byte(a.url, 3000, 0, 0.0, 2.0)
    led.first_byte(a.url, 500, 3000, 0.1, 2.0)
    led.finish(a.url, 3100, "s", 2.5)
    led.finish(a.url, 600, None, 2.5)
    assert (a.inflight, a.inflight_tokens, a.pending_prefill) == (0, 0, 0)
    assert not led.liveness.busy("s")
    assert a.active["s"] == 2.5  # the session's pause starts when its turn ended


def test_first_byte_learns_prefill_speed_only_from_real_work() -> None:
    led, (a, b) = _ledger()
    led.first_byte(a.url, MIN_LEARN_TOKENS - 1, 0, 0.0, 1.0)  # mostly overhead: not learned
    led.first_byte(a.url, 4000, 0, None, 1.0)  # send time unknown: not learned
    assert a.prefill_tok_s == 0.0  # (0: not learned yet)
    led.first_byte(b.url, 3000, 1000, 0.0, 2.0)  # 4,000 tokens in 2 s
    assert b.prefill_tok_s == 2000.0
    led.first_byte("http://gone", 4000, 0, 0.0, 1.0)  # an endpoint that left: ignored


def test_a_session_lives_where_its_latest_turn_went() -> None:
    led, (a, b) = _ledger()
    led.book(a, 100, 100, "s", 0.0)
    led.finish(a.url, 100, "s", 1.0)
    led.book(b, 100, 100, "s", 2.0)  # it moved
    assert led.sessions["s"] == b.url and "s" not in a.active and "s" in b.active
    led.finish(a.url, 100, "s", 3.0)  # a late finish on the old endpoint does not pull it back
    assert "s" not in a.active
    led.forget(b.url)
    assert "s" not in led.sessions


def test_sessions_are_bounded() -> None:
    led, (a, b) = _ledger(session_entries=2)
    for i, ep in enumerate((a, b, a)):
        led.book(ep, 10, 10, f"s{i}", float(i))
    assert list(led.sessions) == ["s1", "s2"]
    assert "s0" not in a.active  # the forgotten session no longer counts as live there
