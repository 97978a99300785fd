#!/usr/bin/env bash
# Runs a sanitizer build of the `trainmem` CLI over a spread of catalog models and recipes
# (every value of every knob appears, every model runs several recipes) plus the listing
# commands and a model directory with a checkpoint. Each run must exit 0 with nothing on
# stderr: with ASAN_OPTIONS=abort_on_error=1 and UBSAN_OPTIONS=halt_on_error=1 any sanitizer
# report (leaks included) fails the run. `make test-sanitize` calls it with build-fuzz/trainmem.
#
#   tests/fuzz/sanitize_cli.sh build-fuzz/trainmem
set -uo pipefail

BIN="${1:?usage: sanitize_cli.sh path/to/sanitized/trainmem}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# Eight recipes that together cover every knob value (seq kept short: the cost of a run is the
# number of ops, which does not depend on seq; short seq keeps the ASan build quick).
RECIPES=(
  "--batch 2 --seq 128"
  "--seq 64 --precision fp32 --optimizer sgd --attention eager --gpu cpu"
  "--seq 64 --precision fp16-mixed --optimizer adamw-fused --checkpointing full --allocator expandable"
  "--seq 64 --precision bf16-master --optimizer adamw-8bit --loss fused --gpu a100-40gb"
  "--seq 32 --precision bf16-true --optimizer adafactor --attention flash --gpu a100-40gb"
  "--seq 32 --precision fp16-true --grad-accum 2 --checkpointing full --attention eager --loss fused"
  "--batch 3 --seq 17 --optimizer adafactor --allocator expandable --gpu t4-16gb --json --timeline"
  "--seq 1024 --checkpointing full --loss fused --json"
)

runs=0
fails=0
check() {  # check LABEL ARGS...: run, expect exit 0 and an empty stderr
  local label="$1"
  shift
  runs=$((runs + 1))
  if ! "$BIN" "$@" >"$TMP/out" 2>"$TMP/err" || [ -s "$TMP/err" ]; then
    fails=$((fails + 1))
    echo "FAIL: $label: trainmem $*"
    head -c 2000 "$TMP/err" | sed 's/^/    /'
    return
  fi
  case " $* " in
    *" --json "*) python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$TMP/out" ||
                    { fails=$((fails + 1)); echo "FAIL: $label: output is not JSON"; } ;;
  esac
}

check "models" models
check "models --json" models --json
check "gpus" gpus
check "gpus --json" gpus --json

models=$("$BIN" models --json | python3 -c 'import json,sys; print(" ".join(m["name"] for m in json.load(sys.stdin)))')
k=0
for m in $models; do
  # Four recipes per model, shifted by one each model, so every (model, knob) pair is common.
  for j in 0 1 2 3; do
    r="${RECIPES[$(((k + 2 * j) % ${#RECIPES[@]}))]}"
    # shellcheck disable=SC2086
    check "$m" estimate "$m" $r
  done
  k=$((k + 1))
done
for r in "${RECIPES[@]}"; do
  # shellcheck disable=SC2086
  check "qwen3-0.6b, all recipes" estimate qwen3-0.6b $r
done

# A config path, a model directory with a checkpoint (the architecture's count in two tensors,
# its data a sparse file), an HF id.
mkdir -p "$TMP/model"
cp "$ROOT/data/models/gemma-2-2b.json" "$TMP/model/config.json"
python3 - "$TMP/model/model.safetensors" <<'EOF'
import json, struct, sys
embed, rest = 256000 * 2304, 2614341888 - 256000 * 2304  # gemma-2-2b: 2,614,341,888 parameters
h = json.dumps({"__metadata__": {"format": "pt"},
                "model.embed_tokens.weight": {"dtype": "BF16", "shape": [256000, 2304], "data_offsets": [0, 2 * embed]},
                "rest": {"dtype": "BF16", "shape": [rest], "data_offsets": [2 * embed, 2 * (embed + rest)]}}).encode()
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    f.truncate(8 + len(h) + 2 * (embed + rest))
EOF
check "config path" estimate "$TMP/model/config.json" --seq 64 --json
check "model directory" estimate "$TMP/model" --seq 64
check "hf id" estimate "Qwen/Qwen3-4B" --seq 64 --json

echo "sanitize_cli.sh: $runs runs, $fails failed ($BIN)"
[ "$fails" -eq 0 ]
