#!/usr/bin/env bash
# Runs the libFuzzer targets of tests/fuzz: first replays every saved reproducer in
# regressions/<target>/, then fuzzes each target for a while, one after the other.
#
#   tests/fuzz/run_long.sh                      # the long campaign: 600 s per target
#   tests/fuzz/run_long.sh -S -t 20             # what `make fuzz-smoke` runs
#   tests/fuzz/run_long.sh -t 3600 fuzz_config  # one target, an hour
#   TRAINMEM_FUZZ_SKIP_KNOWN=1 tests/fuzz/run_long.sh   # step around the known findings
#                                                       # (Note [Known findings], fuzz_common.h)
#
# Options: -t SECONDS per target (default 600), -j JOBS parallel libFuzzer workers per target
# (default 1), -B skip the build (default: `make fuzz-build` first), -S smoke: start from the
# committed seeds only, in a scratch corpus (a grown corpus of thousands of inputs takes most
# of a short run just to load).
#
# What it keeps, under build-fuzz/ (never in the repo):
#   corpus/<target>/     the grown corpus, seeded from tests/fuzz/corpus/<target>/; kept between
#                        runs, so a later campaign starts where this one stopped
#   artifacts/<target>/  crash-*, leak-*, timeout-*, oom-* inputs: each one is a finding. Copy a
#                        minimized one (fuzz_x -minimize_crash=1 -runs=10000 FILE) into
#                        tests/fuzz/regressions/<target>/ with a name that says what it is.
#   logs/<target>.log    the libFuzzer log; the summary below reads its final stats.
#
# Exit status: 0 when every regression input passes and no target found anything.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BUILD="${FUZZ_BUILD:-build-fuzz}"
SECONDS_PER_TARGET=600
JOBS=1
DO_BUILD=1
SMOKE=0
while getopts "t:j:BS" opt; do
  case "$opt" in
    t) SECONDS_PER_TARGET="$OPTARG" ;;
    j) JOBS="$OPTARG" ;;
    B) DO_BUILD=0 ;;
    S) SMOKE=1 ;;
    *) sed -n '2,25p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(fuzz_config fuzz_safetensors fuzz_recipe fuzz_cli)

if [ "$DO_BUILD" = 1 ]; then
  make --no-print-directory fuzz-build FUZZ_BUILD="$BUILD" || exit 1
fi
# Absolute paths from here on: fuzz_cli works in a scratch directory of its own.
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
FUZZ="$ROOT/tests/fuzz"

# Per-target flags: a dictionary, an input size that fits the format, stderr closed for the
# CLI (it prints one error line per bad input; libFuzzer keeps its own copy of stderr).
flags_for() {
  case "$1" in
    fuzz_config) echo "-dict=$FUZZ/dict/config.dict -max_len=4096" ;;
    fuzz_safetensors) echo "-dict=$FUZZ/dict/safetensors.dict -max_len=4096" ;;
    fuzz_recipe) echo "-max_len=512" ;;
    fuzz_cli) echo "-dict=$FUZZ/dict/cli.dict -max_len=512 -close_fd_mask=2" ;;
  esac
}

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

status=0
summary=()
for t in "${TARGETS[@]}"; do
  bin="$BUILD/tests/fuzz/$t"
  if [ ! -x "$bin" ]; then
    echo "run_long.sh: $bin is not built" >&2
    exit 1
  fi
  # 1. regressions: each saved reproducer must now run clean (known findings included: the
  #    skip switch is for exploring, not for replay).
  reg_total=0
  reg_fail=0
  if [ -d "$FUZZ/regressions/$t" ]; then
    for f in "$FUZZ/regressions/$t"/*; do
      [ -f "$f" ] || continue
      reg_total=$((reg_total + 1))
      if ! env -u TRAINMEM_FUZZ_SKIP_KNOWN "$bin" $(flags_for "$t") -runs=1 "$f" >"$BUILD/last-regression.log" 2>&1; then
        reg_fail=$((reg_fail + 1))
        echo "REGRESSION FAILS: $t ${f#"$ROOT"/}  (log: $BUILD/last-regression.log)"
        grep -m3 -E "ERROR|FINDING|runtime error|terminate" "$BUILD/last-regression.log" | sed 's/^/    /'
      fi
    done
  fi
  [ "$reg_fail" -gt 0 ] && status=1

  # 2. fuzzing
  corpus="$BUILD/corpus/$t"
  if [ "$SMOKE" = 1 ]; then
    corpus="$BUILD/smoke-corpus/$t"
    rm -rf "$corpus"
  fi
  mkdir -p "$corpus" "$BUILD/artifacts/$t" "$BUILD/logs"
  before=$(ls "$BUILD/artifacts/$t" | wc -l)
  log="$BUILD/logs/$t.log"
  echo "== $t: ${SECONDS_PER_TARGET}s, $JOBS job(s), log $log"
  fork=()
  [ "$JOBS" -gt 1 ] && fork=(-fork="$JOBS" -ignore_crashes=1)
  "$bin" $(flags_for "$t") "${fork[@]}" -max_total_time="$SECONDS_PER_TARGET" -timeout=20 \
    -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$t/" \
    "$corpus" "$FUZZ/corpus/$t" >"$log" 2>&1
  rc=$?
  after=$(ls "$BUILD/artifacts/$t" | wc -l)
  execs=$(grep -m1 -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$')
  [ -z "$execs" ] && execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
  corpus_size=$(ls "$corpus" | wc -l)
  new=$((after - before))
  if [ "$rc" -ne 0 ] || [ "$new" -gt 0 ]; then
    status=1
    echo "   FOUND something (exit $rc, $new new artifact(s) in $BUILD/artifacts/$t/):"
    grep -m5 -E "ERROR: |FUZZ FINDING|runtime error|terminate called|SUMMARY" "$log" | sed 's/^/    /'
  fi
  summary+=("$(printf '%-17s %12s execs  %-10s corpus %5s  regressions %d/%d pass  new artifacts %d  exit %d' \
    "$t" "${execs:-?}" "${cov:-cov: ?}" "$corpus_size" $((reg_total - reg_fail)) "$reg_total" "$new" "$rc")")
done

echo
echo "fuzz summary (${SECONDS_PER_TARGET}s per target):"
printf '  %s\n' "${summary[@]}"
exit $status
