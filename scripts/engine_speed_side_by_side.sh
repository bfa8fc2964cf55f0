#!/usr/bin/env bash
# ENGINE-1's decode speed for several commits side by side on one machine (run 10 on the lent
# H200): each commit's own benchmarks/engine_speed.py on its own src/, in alternating rounds,
# so a machine's drift or a noisy window cannot pass for a change between commits.
#
#   scripts/engine_speed_side_by_side.sh prepare 649559f HEAD   # here: trees in bench-out/side/
#   OUT=/tmp/out ROUNDS=3 STEADY=1 scripts/engine_speed_side_by_side.sh run   # there (carry
#                                                    # bench-out/side, and .whl for the wheels)
#
# `run` prints one line a round and commit; results.tgz in $OUT holds every JSON and log (it is
# rewritten after each round, so a run stopped early returns what it had: the device tool
# brings back at most 8 files). STEADY=1 adds one 512-step batch-128 window per commit;
# NO_WHEELS=1 uses the Python as it is (here, PYTHON=.venv/bin/python DEV=cpu for a dry run).
set -u
SIDE=bench-out/side
case ${1:-} in
  prepare)
    shift
    rm -rf "$SIDE" && mkdir -p "$SIDE"
    for c in "$@"; do
      sha=$(git rev-parse --short "$c") || exit 1
      mkdir -p "$SIDE/$sha" && git archive "$sha" src benchmarks/engine_speed.py | tar -x -C "$SIDE/$sha"
      echo "$SIDE/$sha"
    done ;;
  run)
    OUT=${OUT:?set OUT}; DEV=${DEV:-cuda}; PRESET=${PRESET:-small}; DTYPE=${DTYPE:-bfloat16}
    ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-32,128}; PY=${PYTHON:-python3}
    R=$(mktemp -d); mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    SITE=""
    if [[ -z ${NO_WHEELS:-} ]] && compgen -G ".whl/*.whl" >/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
      SITE=/tmp/site:
    fi
    lscpu | grep "Model name"; nvidia-smi -L 2>/dev/null
    speed() {  # speed COMMIT NAME ARGS...: one engine_speed run, one line
      local c=$1 name=$2; shift 2
      local s=$(date +%s) one=()
      # one window each, as scripts before --repeats measured (they do not know the flag)
      grep -q -- "--repeats" "$SIDE/$c/benchmarks/engine_speed.py" && one=(--repeats 1)
      PYTHONPATH=${SITE}$PWD/$SIDE/$c/src timeout 120 "$PY" "$SIDE/$c/benchmarks/engine_speed.py" \
        --preset "$PRESET" --device "$DEV" --dtype "$DTYPE" --out "$R/${c}_$name.json" "${one[@]}" "$@" \
        > "$R/${c}_$name.log" 2>&1
      echo "$name $c rc=$? $(( $(date +%s) - s ))s $("$PY" -c "import json, sys
d = json.load(open(sys.argv[1])); print({k: round(v) for k, v in d['decode_tok_s'].items()})" \
        "$R/${c}_$name.json" 2>/dev/null)"
    }
    COMMITS=$(ls "$SIDE")
    for r in $(seq 1 "$ROUNDS"); do
      for c in $COMMITS; do speed "$c" "r$r" --batches "$BATCHES"; done
      tar czf "$OUT/results.tgz" -C "$R" .
    done
    if [[ -n ${STEADY:-} ]]; then
      for c in $COMMITS; do speed "$c" steady --batches 128 --steps 512; done
    fi
    tar czf "$OUT/results.tgz" -C "$R" . && rm -r "$R" ;;
  *) echo "usage: $0 prepare COMMIT... | run" >&2; exit 2 ;;
esac
