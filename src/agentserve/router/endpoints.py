"""Backend endpoints: what the router knows about each, and the loops that keep it fresh.

Three sources, each with its own clock:
- *router-known* load (`inflight`, `inflight_tokens`, `pending_prefill`): updated at
  decision time and when a response starts/ends, so it is never stale;
- *scraped* vLLM metrics (`/metrics` every `scrape_interval_s`, default 50 ms):
  `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
  `vllm:cache_config_info{block_size,num_gpu_blocks}`; ignored once older than
  `metrics_stale_s`;
- *health*: active `/health` checks (`healthy`: False after `eject_after_failures` failed
  checks in a row, or at once when nothing listens; the first passing check re-admits it
  and counts a recovery) and passive outlier ejection (`ejected`): `eject_after_failures`
  consecutive failures of proxied requests eject the endpoint for `eject_for_s`, after
  which the next passing health check re-admits it. Failures the request caused (4xx, or
  a 5xx whose message says the request could not be queued or scheduled) never count.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from agentserve.router.config import EndpointConfig, Options

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_WANTED = ("vllm:num_requests_waiting", "vllm:num_requests_running",
           "vllm:kv_cache_usage_perc", "vllm:cache_config_info")


@dataclass(slots=True)
class Scrape:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None


def parse_metrics(text: str) -> Scrape:
    """The few vLLM gauges the router uses, summed (counts) or averaged (usage) over ranks."""
    s, usage = Scrape(), []
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:num_requests_waiting":
            s.waiting += int(value)
        elif name == "vllm:num_requests_running":
            s.running += int(value)
        elif name == "vllm:kv_cache_usage_perc":
            usage.append(value)
        elif name == "vllm:cache_config_info":
            lab = dict(_LABEL.findall(labels))
            if lab.get("block_size", "").isdigit():
                s.block_size = int(lab["block_size"])
            if lab.get("num_gpu_blocks", "").isdigit():
                s.num_gpu_blocks = int(lab["num_gpu_blocks"])
    s.kv_usage = sum(usage) / len(usage) if usage else 0.0
    return s


@dataclass(slots=True)
class Endpoint:
    """One backend and everything the router believes about it."""

    cfg: EndpointConfig
    healthy: bool = True  # active checks: /health answers
    fails: int = 0  # proxied requests failed in a row (outlier detection)
    ejected: bool = False  # outlier-ejected: until ejected_until and a passing health check
    ejected_until: float = 0.0
    ejections: int = 0
    check_fails: int = 0  # health checks failed in a row
    recoveries: int = 0  # times a passing check followed failed ones (the engine may be new)
    scrape: Scrape = field(default_factory=Scrape)
    scraped_at: float = 0.0
    models: list[str] = field(default_factory=list)
    max_model_len: int | None = None  # from /v1/models (vLLM's card field); None: unknown
    models_at: float = 0.0  # when /v1/models was last read
    inflight: int = 0
    inflight_tokens: int = 0
    pending_prefill: int = 0
    events_seen: int = 0
    last_event_ts: float = 0.0
    prefill_tok_s: float = 0.0  # learned from time to first byte (0: not yet, use the default)
    active: OrderedDict[str, float] = field(default_factory=OrderedDict)  # session -> last seen
    recent_n: float = 0.0  # decayed count of requests routed here, as of `recent_at`
    recent_at: float = 0.0

    def recent_requests(self, now: float, tau_s: float) -> float:
        """Requests routed here, each weighted exp(-age / tau_s)."""
        if not self.recent_n:
            return 0.0
        return self.recent_n * math.exp(-max(0.0, now - self.recent_at) / tau_s)

    def count_request(self, now: float, tau_s: float) -> None:
        self.recent_n = self.recent_requests(now, tau_s) + 1.0
        self.recent_at = now

    def active_sessions(self, now: float, window_s: float,
                        busy: Callable[[str], bool] | None = None) -> int:
        """Live sessions here: last active within `window_s`, or `busy` (in flight).

        A session is touched when its request is routed here and when it ends; the oldest
        are pruned, except that one still in flight is re-touched and kept (a long
        request is not a pause)."""
        a = self.active
        for _ in range(len(a)):
            s, t = next(iter(a.items()))
            if now - t <= window_s:
                break
            if busy is not None and busy(s):
                a[s] = now
                a.move_to_end(s)
            else:
                del a[s]
        return len(a)

    def learn_prefill(self, tokens: int, seconds: float, alpha: float = 0.2) -> None:
        """Fold one observation (uncached tokens ahead + own, time to first byte) into
        the prefill speed estimate (EWMA).

        Once there is an estimate, one observation may lower it freely but raise it at
        most 2x: the tokens are the router's prediction, and a prompt the engine found
        cached anyway (a tier the index did not show, a prefix shared with another
        session) answers in milliseconds, which read as 50-100x the real speed and made
        a busy engine look idle; and an observation with work queued ahead may find part
        of that work done before it arrived.
        """
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        if self.prefill_tok_s:
            rate = min(rate, 2 * self.prefill_tok_s)
        self.prefill_tok_s = rate if not self.prefill_tok_s else \
            (1 - alpha) * self.prefill_tok_s + alpha * rate

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def block_size(self) -> int | None:
        return self.cfg.block_size or self.scrape.block_size

    def available(self, now: float | None = None) -> bool:
        """Takes traffic: its health checks pass and it is not outlier-ejected."""
        return self.healthy and not self.ejected

    def fresh(self, stale_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self.scraped_at <= stale_s

    def record_success(self) -> None:
        self.fails = 0

    def record_failure(self, opts: Options, now: float | None = None) -> bool:
        """Count a failed proxied request; True when it ejected the endpoint."""
        self.fails += 1
        if self.fails >= opts.eject_after_failures and not self.ejected:
            now = time.monotonic() if now is None else now
            self.ejected = True
            self.ejected_until = now + opts.eject_for_s
            self.ejections += 1
            return True
        return False

    def record_check(self, ok: bool, refused: bool, opts: Options,
                     now: float | None = None) -> None:
        """Fold one active health check in (`refused`: nothing listens at the address)."""
        if not ok:
            self.check_fails += 1
            if refused or self.check_fails >= opts.eject_after_failures:
                self.healthy = False
            return
        if self.check_fails or not self.healthy:
            self.recoveries += 1
        self.check_fails = 0
        self.healthy = True
        now = time.monotonic() if now is None else now
        if self.ejected and now >= self.ejected_until:
            self.ejected, self.fails = False, 0

    def serves(self, model: str | None) -> bool:
        if model is None or (not self.models and self.cfg.model is None):
            return True
        return model == self.cfg.model or model in self.models


# Phrases of a 5xx answer that blame the request, not the engine (agentserve engines):
# such a failure does not count toward outlier ejection and is not retried elsewhere.
REQUEST_FAULTS = ("could not queue the request", "could not schedule the request",
                  "could not allocate KV for the request", "constraint failed")


def request_fault(status: int | None, body: bytes) -> bool:
    """The upstream answered a 5xx whose error message says the request itself failed."""
    if status is None or status < 500 or not body:
        return False
    try:
        err = msgspec.json.decode(body).get("error")
        message = err.get("message") if isinstance(err, dict) else None
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(message, str) and any(p in message for p in REQUEST_FAULTS)


MODELS_REFRESH_S = 60.0  # /v1/models is read again this often (a backend restarted with
# another model or context limit is re-learned; at once when it comes back from an ejection)


Recover = Callable[[], Awaitable[object]]  # run before a recovered endpoint takes traffic


async def check_health(ep: Endpoint, session: aiohttp.ClientSession, opts: Options,
                       on_recover: Recover | None = None) -> bool:
    """One active check: /health, and /v1/models while unknown, when the endpoint comes back
    from an ejection, and every `MODELS_REFRESH_S`. An endpoint that passes after failed
    checks (it may be a restarted engine) runs `on_recover` (the gateway rebuilds its
    index entries) before it is marked healthy."""
    refused = False
    try:
        timeout = aiohttp.ClientTimeout(total=opts.connect_timeout_s)
        async with session.get(ep.url + "/health", timeout=timeout) as r:
            ok = r.status == 200
        if ok and (not ep.models or not ep.healthy or ep.ejected or ep.check_fails
                   or time.monotonic() - ep.models_at >= MODELS_REFRESH_S):
            async with session.get(ep.url + "/v1/models", timeout=timeout) as r:
                if r.status == 200:
                    cards = (await r.json()).get("data", [])
                    ep.models = [m["id"] for m in cards]
                    lens = [m["max_model_len"] for m in cards
                            if isinstance(m.get("max_model_len"), int)]
                    ep.max_model_len = max(lens) if lens else None
                    ep.models_at = time.monotonic()
    except aiohttp.ClientConnectorError:
        ok, refused = False, True  # nothing listens there: the process is gone
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        ok = False
    if ok and on_recover is not None and (ep.check_fails or not ep.healthy):
        await on_recover()
    ep.record_check(ok, refused, opts)
    return ok


async def scrape_once(ep: Endpoint, session: aiohttp.ClientSession, opts: Options) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=max(opts.scrape_interval_s * 10, 0.5))
        async with session.get(ep.url + "/metrics", timeout=timeout) as r:
            if r.status != 200:
                return False
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False
    ep.scrape = parse_metrics(text)
    ep.scraped_at = time.monotonic()
    return True


async def poll_loop(ep: Endpoint, session: aiohttp.ClientSession, opts: Options,
                    on_recover: Recover | None = None) -> None:
    """Scrape metrics every `scrape_interval_s` and check health every `health_interval_s`."""
    next_health = 0.0
    while True:
        now = time.monotonic()
        if now >= next_health:
            await check_health(ep, session, opts, on_recover)
            next_health = now + opts.health_interval_s
        if ep.available():
            await scrape_once(ep, session, opts)
        await asyncio.sleep(opts.scrape_interval_s)


async def cancel(task: asyncio.Task | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
