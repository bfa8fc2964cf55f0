#!/usr/bin/env python3
"""Fuzz a whole P/D cluster: one bad request fails only itself, and nothing crashes or leaks.

Starts `agentserve up --topology 1P1D` (a prefill and a decode engine with KV transfer on,
and the router; the built-in tiny model) and sends `--requests` fuzzed requests, drawn
as hypothesis examples (generate phase only, no database, seeded), to the router and
straight to both engines, `--concurrency` at a time so that they overlap: every
generation API (/v1/completions, /v1/chat/completions, /v1/messages, /v1/responses) and
/v1/messages/count_tokens, /tokenize, /detokenize, /v1/models, plus the internal and
admin paths. Bodies come from tests/fuzzing.py: random field values, malformed
`kv_transfer_params` (unsigned, signed with the cluster token, forged, stale, or sent
with the router's operator key; mutated from a real prefill leg's answer), broken bytes
(not UTF-8, cut short, nested deep, huge numbers, not an object, empty), odd headers
(auth, request ids, the cluster's x-agentserve-* headers, content types and encodings),
streaming and not. Meanwhile sentinel threads keep well-formed streams going through the
router (P/D legs: prompts over its 256-token threshold) and at the decode engine: each
must succeed.

Checks at the end: no 5xx and no 5xx-type error event in a 200 stream; no hang (a read
silent for 30 s, or 60 s for the whole exchange: max_tokens is capped at 48 by
--max-tokens-limit); no connection dropped without an answer; no process restarted
(the --state file's counts and pids); every sentinel request served; each engine idle
with `vllm:kv_cache_usage_perc` 0. Writes JSON (`--out`), prints a table, exits 1 on any
failure. `make test` runs it small (tests/test_harden_suites.py).

    python benchmarks/harden_fuzz.py [--requests 10000] [--seed 0] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hseed  # noqa: E402

from _cluster import UpCluster, run_suite, wait_idle  # noqa: E402
from _fuzzcases import Case, Recorder, Sentinel, cases, prefill_leg  # noqa: E402
from _rawhttp import send  # noqa: E402

ENGINE_ARGS = ("--kv-cache-tokens 16384 --max-model-len 2048 --max-tokens-limit 48 "
               "--kv-transfer-timeout 10")
TIMEOUT_S, DEADLINE_S = 30.0, 60.0  # a silent read; a whole exchange (then: a hang)


def drive(strategy: Any, n: int, seed: int, submit: Any, sent: Any) -> None:
    """Run `strategy` as hypothesis examples, each handed to `submit`, until `sent()` is
    `n` (hypothesis may stop a run early; bounded at 20 runs)."""
    for attempt in range(20):
        left = n - sent()
        if left <= 0:
            return

        @settings(max_examples=left, phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @hseed(seed + attempt)
        @given(strategy)
        def run(case: Case) -> None:
            if sent() < n:
                submit(case)

        run()


def fuzz(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    token, operator = secrets.token_hex(16), secrets.token_hex(16)
    cluster = UpCluster(work, "1P1D", ENGINE_ARGS, env={
        "AGENTSERVE_KV_TRANSFER_TOKEN": token, "AGENTSERVE_OPERATOR_KEY": operator})
    t0 = time.monotonic()
    cluster.start()
    try:
        targets = {"router": cluster.first["router"],
                   "prefill": cluster.engines("prefill")[0]["url"],
                   "decode": cluster.engines("decode")[0]["url"]}
        base_params = prefill_leg(targets["prefill"], token)
        print(f"cluster up in {time.monotonic() - t0:.0f} s: {targets}; a real prefill leg's "
              f"params: {sorted(base_params)}", flush=True)
        rec = Recorder()
        sentinel = Sentinel(targets, TIMEOUT_S, DEADLINE_S)
        sentinel.start()
        slots = threading.BoundedSemaphore(args.concurrency)
        t_fuzz = time.monotonic()

        def one(case: Case) -> None:
            try:
                res = send(targets[case.target], case.method, case.path,
                           case.headers(token, operator), case.body, TIMEOUT_S, DEADLINE_S)
                rec.add(case, res)
            finally:
                slots.release()

        with ThreadPoolExecutor(args.concurrency) as pool:
            def submit(case: Case) -> None:
                slots.acquire()
                rec.submitted += 1
                pool.submit(one, case)
                if rec.submitted % 500 == 0:
                    print(f"  {rec.submitted} sent, {rec.summary()}", flush=True)

            drive(cases(base_params), args.requests, args.seed, submit, lambda: rec.submitted)
        fuzz_s = time.monotonic() - t_fuzz
        sentinel.stop()
        idle = wait_idle([targets["prefill"], targets["decode"]], timeout=60)
        restarts = cluster.restarts()
    finally:
        cluster.stop()
    kv_leaked = [u for u, m in idle.items() if "error" in m or any(m.values())]
    crashed = bool(restarts["restarted"] or restarts["replaced"] or not restarts["up_alive"])
    out = {"requests": rec.submitted, "seed": args.seed, "concurrency": args.concurrency,
           "wall_s": round(time.monotonic() - t0, 1), "fuzz_s": round(fuzz_s, 1),
           **rec.report(), "sentinel": sentinel.report(), "processes": restarts,
           "crashes": int(crashed), "kv_after": idle, "kv_leaked": kv_leaked}
    out["ok"] = not (out["status_5xx"] or out["stream_5xx"] or out["hangs"] or out["dropped"]
                     or crashed or out["sentinel"]["failed"] or kv_leaked)
    return out


def table(r: dict[str, Any]) -> str:
    classes = ("2xx", "4xx", "5xx", "hang", "dropped")
    lines = [f"{'target':8} {'api':34} " + " ".join(f"{c:>7}" for c in classes)]
    for target, apis in sorted(r["by_target_api"].items()):
        for api, counts in sorted(apis.items()):
            lines.append(f"{target:8} {api[:34]:34} "
                         + " ".join(f"{counts.get(c, 0):>7}" for c in classes))
    s = r["sentinel"]
    lines += [
        f"requests {r['requests']} in {r['fuzz_s']} s (wall {r['wall_s']} s, "
        f"{r['concurrency']} in flight); 5xx {r['status_5xx']}, 5xx error events in 200 "
        f"streams {r['stream_5xx']}, hangs {r['hangs']}, dropped {r['dropped']}, "
        f"crashes {r['crashes']} {r['processes']}",
        f"sentinel requests ok {s['ok']}, failed {s['failed']}",
        "KV after: " + ", ".join(f"{u}: {m}" for u, m in r["kv_after"].items()),
        "PASS" if r["ok"] else "FAIL"]
    for key in ("first_5xx", "first_stream_5xx", "first_hangs", "first_dropped"):
        for item in r[key][:3]:
            lines.append(f"  {key}: {json.dumps(item)[:600]}")
    for item in s["first_failures"][:3]:
        lines.append(f"  sentinel failure: {json.dumps(item)[:600]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000, help="fuzzed requests in all")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    ap.add_argument("--concurrency", type=int, default=4, help="fuzzed requests in flight")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/harden_fuzz.json")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the cluster's state and logs here (default: a temporary folder)")
    return run_suite(ap.parse_args(), fuzz, table, "harden-fuzz-")


if __name__ == "__main__":
    sys.exit(main())
