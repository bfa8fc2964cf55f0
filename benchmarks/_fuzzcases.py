"""The requests benchmarks/harden_fuzz.py sends, how it counts their answers, and the
sentinel streams that must keep succeeding beside them.

A `Case` is one request to one target (the router, the prefill engine, the decode
engine): method, path, body bytes, odd headers, and how its `kv_transfer_params` are
signed (none, with the cluster token, a wrong token, an hour old, or sent to the router
with its operator key). `cases` draws them from tests/fuzzing.py's strategies.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from _rawhttp import Result, send
from agentserve.api.kv_transfer import AUTH_HEADER, RELEASE, sign
from tests.fuzzing import ENDPOINTS, GENERATE, bodies, kv_params, odd_headers, raw_bodies

OPERATOR_HEADER = "x-agentserve-operator-key"
TARGETS = ("router", "prefill", "decode")
KINDS = ("json",) * 5 + ("kv",) * 3 + ("raw", "headers", "other")
SIGNS = ("none", "valid", "forged", "stale", "operator")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu the quick brown fox jumps over a lazy dog").split()
KEEP = 10  # samples kept of each kind of failure


def words(n: int, seed: int) -> str:
    """`n` random words: a prompt no engine has cached (over the router's P/D threshold
    at n >= ~260 with the tiny tokenizer)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(slots=True)
class Case:
    target: str
    method: str
    path: str
    body: bytes | None
    api: str
    extra: dict[str, bytes] = field(default_factory=dict)  # odd headers, sent last
    signing: str = "none"  # SIGNS, or "release" (a signed /v1/kv_transfer/release)
    signed: Any = None  # what the signature covers

    def headers(self, token: str, operator: str) -> dict[str, bytes | str]:
        """The request's headers, its signature computed now (signatures expire)."""
        h: dict[str, bytes | str] = {}
        if self.body is not None:
            h["Content-Type"] = "application/json"
        try:
            if self.signing == "valid":
                h[AUTH_HEADER] = sign(token, self.signed)
            elif self.signing == "forged":
                h[AUTH_HEADER] = sign("not-the-" + token, self.signed)
            elif self.signing == "stale":
                h[AUTH_HEADER] = sign(token, self.signed, now=1_000_000_000)
            elif self.signing == "release":
                h[AUTH_HEADER] = sign(token, self.signed, RELEASE)
        except (TypeError, ValueError):  # params no JSON canonical form holds: unsigned
            pass
        if self.signing == "operator":
            h[OPERATOR_HEADER] = operator
        h.update(self.extra)
        return h


def _lengthen(body: dict[str, Any], path: str, seed: int) -> None:
    text = words(300, seed)
    if path == "/v1/completions":
        body["prompt"] = text
    elif path == "/v1/responses":
        body["input"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]


def _other(draw: st.DrawFn, target: str) -> Case:
    """Routes beside the APIs: wrong methods, unknown and odd paths, admin, release."""
    opts: list[tuple[str, str, bytes | None]] = [
        ("GET", "/v1/models", None), ("GET", "/health", None), ("GET", "/metrics", None),
        ("POST", "/v1/models", b"{}"), ("GET", "/v1/completions", None),
        ("PUT", "/v1/chat/completions", b"{}"), ("GET", "/nope", None),
        ("GET", "/v1/../../etc/passwd", None), ("GET", "/v1/models?x=" + "a" * 9000, None),
        ("DELETE", "/v1/messages", None), ("OPTIONS", "/v1/completions", None),
        ("HEAD", "/v1/models", None), ("GET", "/%ff%fe", None)]
    if target == "router":
        opts += [("POST", "/admin/endpoints", b'{"url": "http://10.255.255.1:1"}'),
                 ("DELETE", "/admin/endpoints?url=http://127.0.0.1:1", None),
                 ("POST", "/admin/reload", b"")]
    rid = draw(st.one_of(st.text(max_size=8), st.integers(), st.none()))
    opts.append(("POST", "/v1/kv_transfer/release", json.dumps({"remote_request_id": rid}).encode()))
    method, path, body = draw(st.sampled_from(opts))
    release = "release" in path
    signing = draw(st.sampled_from(["none", "forged", "release"])) if release else "none"
    extra = draw(odd_headers()) if draw(st.booleans()) else {}
    return Case(target, method, path, body, f"{method} {path.split('?')[0][:40]}", extra,
                signing, {"remote_request_id": rid} if release else None)


def cases(base: dict[str, Any]) -> st.SearchStrategy[Case]:
    """Fuzzed requests; `base`: the decode-leg params of a real prefill leg (mutated)."""
    @st.composite
    def one(draw: st.DrawFn) -> Case:
        target, kind = draw(st.sampled_from(TARGETS)), draw(st.sampled_from(KINDS))
        if kind == "other":
            return _other(draw, target)
        path = draw(st.sampled_from(GENERATE if kind == "kv" else list(ENDPOINTS)))
        if kind == "raw":
            return Case(target, "POST", path, draw(raw_bodies(path)), path)
        body = draw(bodies(path))
        if path in GENERATE and draw(st.integers(0, 7)) == 0:
            _lengthen(body, path, draw(st.integers(0, 2**32)))  # long: a P/D split
        if path in GENERATE and draw(st.integers(0, 2)) == 0:
            body["stream"] = True
        signing, params = "none", None
        if kind == "kv":
            params, signing = draw(kv_params(base)), draw(st.sampled_from(SIGNS))
            if signing in ("valid", "operator") and isinstance(params, dict) \
                    and params.get("remote_host") not in LOOPBACK:
                # a trusted caller's pull: kept on this machine (no real network waits)
                params["remote_host"] = "127.0.0.1"
            body["kv_transfer_params"] = params
        extra = draw(odd_headers()) if kind == "headers" else {}
        return Case(target, "POST", path, json.dumps(body).encode(), path, extra, signing, params)
    return one()


def _sample(case: Case, res: Result) -> dict[str, Any]:
    return {"target": case.target, "method": case.method, "path": case.path,
            "status": res.status, "error": res.error, "signing": case.signing,
            "headers": {k: repr(v)[:80] for k, v in case.extra.items()},
            "request": (case.body or b"")[:400].decode("utf-8", "replace"),
            "response": res.body[:500].decode("utf-8", "replace"),
            "stream_errors": res.stream_errors[:2], "elapsed_s": round(res.elapsed, 2)}


class Recorder:
    """Counts answers by target, API and status class; keeps the first failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submitted = 0
        self.by: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.by_signing: dict[str, Counter] = defaultdict(Counter)  # kv_transfer_params cases
        self.totals: Counter = Counter()
        self.statuses: Counter = Counter()
        self.samples: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def add(self, case: Case, res: Result) -> None:
        cls = ("hang" if res.hang else "dropped" if res.status is None
               else f"{res.status // 100}xx")
        with self.lock:
            self.by[case.target][case.api][cls] += 1
            if case.signed is not None:
                self.by_signing[f"{case.target} {case.signing}"][str(res.status)] += 1
            self.totals[cls] += 1
            self.statuses[str(res.status)] += 1
            kinds = [cls] if cls in ("5xx", "hang", "dropped") else []
            if res.status == 200 and res.server_fault:
                kinds.append("stream_5xx")
                self.totals["stream_5xx"] += 1
            elif res.stream_errors:
                self.totals["stream_4xx"] += 1  # a request's own error, found mid-stream
            for k in kinds:
                if len(self.samples[k]) < KEEP:
                    self.samples[k].append(_sample(case, res))

    def summary(self) -> str:
        with self.lock:
            return ", ".join(f"{k} {v}" for k, v in sorted(self.totals.items()))

    def report(self) -> dict[str, Any]:
        with self.lock:
            t, s = self.totals, self.samples
            return {"by_target_api": {k: {a: dict(c) for a, c in v.items()}
                                      for k, v in self.by.items()},
                    "statuses": dict(self.statuses), "status_5xx": t["5xx"],
                    "kv_params_by_signing": {k: dict(c) for k, c in sorted(self.by_signing.items())},
                    "stream_5xx": t["stream_5xx"], "stream_4xx": t["stream_4xx"],
                    "hangs": t["hang"], "dropped": t["dropped"],
                    "first_5xx": s["5xx"], "first_stream_5xx": s["stream_5xx"],
                    "first_hangs": s["hang"], "first_dropped": s["dropped"]}


class Sentinel:
    """Well-formed streams, one after another on each of three lanes, while the fuzz runs:
    a long chat through the router (a P/D split), a Messages stream through the router,
    and a completion straight at the decode engine. Every one must end well."""

    def __init__(self, targets: dict[str, str], timeout: float, deadline: float) -> None:
        self.timeout, self.deadline = timeout, deadline
        self.lanes = [(targets["router"], "/v1/chat/completions", lambda i: {
                          "messages": [{"role": "user", "content": words(300, -i)}],
                          "max_tokens": 8, "stream": True}),
                      (targets["router"], "/v1/messages", lambda i: {
                          "messages": [{"role": "user", "content": f"turn {i}"}],
                          "max_tokens": 8, "stream": True}),
                      (targets["decode"], "/v1/completions", lambda i: {
                          "prompt": f"sentinel {i}", "max_tokens": 8, "stream": True})]
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.ok, self.failures, self.failed = 0, [], 0
        self.threads = [threading.Thread(target=self._lane, args=lane, daemon=True)
                        for lane in self.lanes]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _lane(self, base: str, path: str, make: Any) -> None:
        i = 0
        while not self.done.is_set():
            i += 1
            res = send(base, "POST", path, {"Content-Type": "application/json"},
                       json.dumps(make(i)).encode(), self.timeout, self.deadline)
            good = res.status == 200 and res.done and not res.stream_errors and not res.error
            with self.lock:
                if good:
                    self.ok += 1
                else:
                    self.failed += 1
                    if len(self.failures) < KEEP:
                        self.failures.append({"url": base + path, "status": res.status,
                                              "error": res.error, "done": res.done,
                                              "stream_errors": res.stream_errors[:2],
                                              "body": res.body[:400].decode("utf-8", "replace")})
            self.done.wait(0.1)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(self.deadline + 5)

    def report(self) -> dict[str, Any]:
        with self.lock:
            return {"ok": self.ok, "failed": self.failed, "first_failures": list(self.failures)}


def prefill_leg(url: str, token: str) -> dict[str, Any]:
    """A real, signed prefill leg on `url`; its pins released at once. Returns the params a
    decode leg would carry (the fuzz's base for mutated ones)."""
    leg = {"do_remote_decode": True}
    body = {"prompt": words(300, 7), "max_tokens": 1, "stream": False, "kv_transfer_params": leg}
    res = send(url, "POST", "/v1/completions", {"Content-Type": "application/json",
                                                AUTH_HEADER: sign(token, leg)},
               json.dumps(body).encode(), 60, 120, keep=1 << 20)
    if res.status != 200:
        raise RuntimeError(f"the prefill engine refused a signed prefill leg: {res.status} "
                           f"{res.error or res.body[:300]!r}")
    params = json.loads(res.body)["kv_transfer_params"]
    release = {"remote_request_id": params["remote_request_id"]}
    send(url, "POST", "/v1/kv_transfer/release", {"Content-Type": "application/json",
         AUTH_HEADER: sign(token, release, RELEASE)}, json.dumps(release).encode(), 30, 30)
    return {**params, "do_remote_prefill": True, "do_remote_decode": False}
