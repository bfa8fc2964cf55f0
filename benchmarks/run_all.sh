#!/usr/bin/env bash
# `make bench`: every benchmark script, one after another (never in parallel: 2 cores).
# Each writes JSON under bench-out/ and prints its table. Takes about an hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p bench-out
run() { echo; echo "=== $* ==="; "$PY" "$@"; }
run benchmarks/box_speed.py --out bench-out/box_speed.json  # how steady the box is, first (5 min)
run benchmarks/engine_vs_vllm.py --out bench-out/engine_vs_vllm.json
run benchmarks/vllm_request_path.py --out bench-out/vllm_request_path.json
run benchmarks/sched_overhead.py --out bench-out/sched_overhead.json
run benchmarks/replay_client.py --out bench-out/replay_client.json
run benchmarks/aiperf_crosscheck.py --out bench-out/aiperf_crosscheck.json
run benchmarks/router_decision_latency.py
run benchmarks/router_index_memory.py
run benchmarks/router_captured_reuse.py
run benchmarks/kvtier_micro.py
run benchmarks/kvtier_sessions.py
WEKA=../shared/traces/weka-cc-sample.jsonl.gz  # the full sample when present, else the bundled mini
run benchmarks/kvtier_pause_signal.py $( [ -f "$WEKA" ] && echo --trace "$WEKA" ) \
    --out bench-out/kvtier_pause_signal.json
run benchmarks/pd_transfer.py --out bench-out/pd_transfer.json
run benchmarks/pd_itl.py --out bench-out/pd_itl.json
run benchmarks/pd_ttft.py --out bench-out/pd_ttft.json
run benchmarks/engine_speed.py --out bench-out/engine_speed.json
run benchmarks/serve_overhead.py --out bench-out/serve_overhead.json
run benchmarks/long_prompt_stall.py --out bench-out/long_prompt_stall.json
run benchmarks/harden_fuzz.py --out bench-out/harden_fuzz.json     # 10,000 fuzzed requests (~10 min)
run benchmarks/harden_soak.py --out bench-out/harden_soak.json     # 30 min of mixed load
run benchmarks/harden_chaos.py --out bench-out/harden_chaos.json   # 2P1D, a kill -9 every 30 s for 10 min (~11 min)
run benchmarks/sim_speed.py --out bench-out/sim_speed.json
run benchmarks/sim_calibration.py --duration 900 --out bench-out/sim_calibration.json
run benchmarks/sim_published.py --duration 900 --out bench-out/sim_published.json
run benchmarks/sim_decode_locality.py --duration 900 --seeds 2 --out bench-out/sim_decode_locality.json
run benchmarks/sim_clients.py --duration 900 --out bench-out/sim_clients.json
run benchmarks/sim_vs_bench.py --out bench-out/sim_vs_bench.json
