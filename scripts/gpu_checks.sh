#!/usr/bin/env bash
# The GPU checks of ENGINE-1, KVTIER-1, PD-1 and SIM-1, as one script for a machine with an NVIDIA GPU
# and a Python that already has torch with CUDA (the project's tests never need one).
#
#   OUT=/tmp/gpu-out scripts/gpu_checks.sh            # from the repository root
#
# Packages torch's image lacks can come as wheels in .whl/ (installed into /tmp/site first;
# keep .whl/ out of git). On the lent H200 image (Python 3.12, torch 2.11) these were missing:
# msgspec pyzmq cbor2 llguidance openai httpx2 httpcore2 truststore jiter pydantic
# pydantic_core annotated-types typing-inspection sniffio anyio h11 idna pytest-asyncio
# pytest-timeout, and for the Messages tests anthropic docstring_parser opentelemetry-api
# typing_extensions, at the versions pyproject.toml and .venv pin
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VER`).
# Each step has its own time limit and the whole run a budget (GPU_CHECKS_BUDGET_S, default
# 420 s): a step that would start past the budget is skipped, so what ran always comes back.
# Writes to $OUT: gpu_checks.log (everything) and results.tgz (the benchmarks' JSON, pytest's
# junit XML; in $OUT/r until the end, so that a run stopped early still returns them: the
# device tool brings back at most 8 files).
set -u
OUT=${OUT:-bench-out/gpu}
BUDGET=${GPU_CHECKS_BUDGET_S:-420}
PY=${PYTHON:-python3}
DEV=${GPU_CHECKS_DEVICE:-cuda}  # cpu: a dry run of the script itself on a machine without a GPU
mkdir -p "$OUT/r"
LOG="$OUT/gpu_checks.log"
R="$OUT/r"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [[ -z ${GPU_CHECKS_NO_WHEELS:-} ]] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
  export PYTHONPATH=/tmp/site:${PWD}/src
else
  export PYTHONPATH=${PWD}/src${PYTHONPATH:+:$PYTHONPATH}
fi

step() {  # step NAME LIMIT_S CMD...: run one check, log its exit status and seconds
  local name=$1 limit=$2; shift 2
  local now=$(( $(date +%s) - T0 ))
  if (( now + 10 > BUDGET )); then
    echo "=== $name: SKIPPED (budget: ${now}s of ${BUDGET}s used)" | tee -a "$LOG"
    return
  fi
  (( limit > BUDGET - now )) && limit=$(( BUDGET - now ))
  echo "=== $name (limit ${limit}s, at ${now}s)" | tee -a "$LOG"
  local s=$(date +%s)
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$LOG"
}

step env 30 bash -c "nvidia-smi -L; nproc; $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())' && $PY -c 'import openai, msgspec, zmq, llguidance, cbor2, agentserve.cli'"

# SIM-1: one DEP16 rank's GEMMs of GLM-5.2 (random FP8 weights, ~66 GB) at decode loads and
# prefill chunks against the step model's roofline and efficiency factors.
if [[ $DEV == cuda ]]; then
  step sim-gpu-rank 150 "$PY" benchmarks/sim_gpu_rank.py --device cuda --out "$R/sim_gpu_rank.json"
else
  step sim-gpu-rank 120 "$PY" benchmarks/sim_gpu_rank.py --device cpu --scale 32 --layers 2 \
    --decode 16 --prefill 64 --reps 2 --out "$R/sim_gpu_rank.json"
fi

# Correctness on CUDA: the engine core against the dense reference, the OpenAI server
# (sampling, seeds, penalties, tools, bad input), CPU/disk tiers (pinned host memory,
# side-stream copies, restore == recompute), P/D between two CUDA engines, and the staged
# transfer path with CUDA caches on both ends.
step pytest-cuda 180 env AGENTSERVE_TEST_DEVICE=$DEV "$PY" -m pytest -q -p no:cacheprovider \
  --junitxml="$R/pytest_cuda.xml" -o addopts="" \
  tests/engine/core/test_engine.py tests/engine/http/test_server.py tests/engine/model/test_sampling.py \
  tests/engine/model/test_tools.py tests/engine/http/test_bad_input.py tests/engine/core/test_tiered.py \
  tests/engine/core/test_writeback.py tests/engine/http/test_messages.py tests/engine/http/test_responses.py \
  tests/kv/remote/test_pd_engine.py tests/kv/remote/test_transfer_wire.py

# ENGINE-1: prefill and decode tok/s on CUDA, small preset in bf16 (and tiny in fp32).
step engine-speed-small-bf16 90 "$PY" benchmarks/engine_speed.py --preset small --device $DEV \
  --dtype bfloat16 --batches 1,8,32,128 --out "$R/engine_speed_small_cuda_bf16.json"
step engine-speed-tiny-fp32 60 "$PY" benchmarks/engine_speed.py --preset tiny --device $DEV \
  --dtype float32 --batches 1,8,32,128 --out "$R/engine_speed_tiny_cuda_fp32.json"

# SIM-1: the small-scale check (simulator vs `agentserve bench` on 2 engines behind our router)
# with both engines on the GPU: the profile is calibrated on them, same code; one run at c4
# and c8, 30 s stages. On this 16-core host the engines, router and client do not share 2 cores.
if [[ $DEV == cuda ]]; then
  step sim-vs-bench-cuda 300 "$PY" benchmarks/sim_vs_bench.py --engine-args="--device cuda" \
    --repeats 1 --stage 30 --out "$R/sim_vs_bench_cuda.json"
  # ... and where its c8 lean sits: the bench's own steps against that GPU profile, with the
  # arrival split (run 11: most of it in the steady decode steps' tail, 2-3 ms an arrival)
  if [[ -f $R/sim_vs_bench_cuda_profile.json ]]; then
    step sim-step-audit-cuda 90 "$PY" benchmarks/sim_step_audit.py --concurrency 8 --stage 30 \
      --engine-args="--device cuda" --cpu-profile "$R/sim_vs_bench_cuda_profile.json" \
      --out "$R/sim_step_audit_cuda_c8.json"
  fi
fi

# KVTIER-1: restore vs recompute of a 16K prefix, cold start on a warm disk tier, store
# overhead, with the CPU tier in pinned memory.
step kvtier-micro-small-bf16 100 "$PY" benchmarks/kvtier_micro.py --preset small --device $DEV \
  --dtype bfloat16 --prefix 16384 --out "$R/kvtier_micro_small_cuda_bf16.json"
step kvtier-micro-tiny-fp32 80 "$PY" benchmarks/kvtier_micro.py --preset tiny --device $DEV \
  --dtype float32 --prefix 16384 --out "$R/kvtier_micro_tiny_cuda_fp32.json"
step kvtier-micro-tiny-fp32-256 60 "$PY" benchmarks/kvtier_micro.py --preset tiny --device $DEV \
  --dtype float32 --prefix 16384 --offload-block-tokens 256 --only restore \
  --out "$R/kvtier_micro_tiny_cuda_fp32_256.json"

# PD-1: the staged (device) transfer path with CUDA caches on both ends, over loopback.
step pd-transfer-cuda 80 "$PY" benchmarks/pd_transfer.py --device $DEV --rounds 5 \
  --out "$R/pd_transfer_cuda.json"

# A profile of one restore, where a session brought one (bench-out/ is ignored by git).
if [[ -f bench-out/prof_restore.py ]]; then
  step restore-profile 60 "$PY" bench-out/prof_restore.py $DEV float32
fi

tar czf "$OUT/results.tgz" -C "$R" . && rm -r "$R"
echo "=== done in $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
grep -E "passed|failed|error" "$LOG" | tail -3
