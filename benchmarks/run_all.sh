#!/usr/bin/env bash
# `make bench`: every benchmark script, one after another (never in parallel: 2 cores).
# Each writes JSON under bench-out/ and prints its table. Takes ~30-40 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p bench-out
run() { echo; echo "=== $* ==="; "$PY" "$@"; }
run benchmarks/engine_vs_vllm.py --out bench-out/engine_vs_vllm.json
run benchmarks/sched_overhead.py --out bench-out/sched_overhead.json
run benchmarks/replay_client.py --out bench-out/replay_client.json
run benchmarks/aiperf_crosscheck.py --out bench-out/aiperf_crosscheck.json
run benchmarks/router_decision_latency.py
run benchmarks/router_index_memory.py
run benchmarks/router_captured_reuse.py
run benchmarks/kvtier_micro.py
run benchmarks/kvtier_sessions.py
