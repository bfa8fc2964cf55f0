#!/usr/bin/env bash
# Install AIPerf (the peer benchmark of the WORKLOAD-1 cross-check) into a cached venv outside
# the clone. Idempotent: a stamp file records a complete install.
#
# aiperf 0.13.0's required dependencies (METADATA, checked with `pip download --no-deps`) do not
# include torch: only its `optuna`/`botorch` extras do, and we install none. If a later version
# ever pulls torch, the CPU wheel (torch==2.13.0+cpu, on disk here) must go in first so pip does
# not fetch a multi-GB CUDA build: set AIPERF_PREINSTALL_TORCH=1 to do that.
set -euo pipefail
VERSION=0.13.0
VENV="${1:-${AGENTSERVE_AIPERF_VENV:-$HOME/.cache/agentserve/aiperf-venv}}"
STAMP="$VENV/.agentserve-ok-$VERSION"
if [ -f "$STAMP" ]; then exit 0; fi
echo "installing aiperf==$VERSION into $VENV (one time, ~1-2 minutes)"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
# pip's exit status survives the filter (pipefail); the filter drops this machine's noise about
# missing local index folders.
pipq() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pipq install -q --upgrade pip
if [ "${AIPERF_PREINSTALL_TORCH:-0}" = "1" ]; then
  pipq install -q "torch==2.13.0"  # the local CPU wheel, never a CUDA build
fi
pipq install -q "aiperf==$VERSION"
# A CUDA torch must never have come in as a transitive dependency.
if "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('torch') else 1)"; then
  "$VENV/bin/python" -c "import torch, sys; v = torch.__version__; print('torch', v, file=sys.stderr); sys.exit(0 if '+cpu' in v else 'aiperf venv pulled a non-CPU torch: ' + v)"
fi
"$VENV/bin/aiperf" --version >/dev/null
"$VENV/bin/python" -c "import aiperf, sys; print('aiperf installed', file=sys.stderr)"
touch "$STAMP"
