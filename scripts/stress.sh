#!/usr/bin/env bash
# Exit-cleanliness stress: run the release `generate` example (and the chat example on piped input)
# over the tiny fixtures of five families, flat and paged, again and again while CPU contention
# of our own making runs beside it (two busy loops, one per core), and report runs, hangs and
# crashes. Bounded: RUNS per family (default 200, split over flat / paged / chat), each run killed
# after TIMEOUT seconds (default 60) and counted as a hang.
#
#   scripts/stress.sh [RUNS] [TIMEOUT]        # summary line last; logs of failures in $OUT
#
# The environment is left as it is: no thread-count variables, no shutdown calls.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${1:-200}
TIMEOUT=${2:-60}
OUT=${OUT:-$ROOT/target/stress}
FIX=$ROOT/crates/models/tests/fixtures/tiny
mkdir -p "$OUT"
(cd "$ROOT" && cargo build --release -p mlx-models --example generate --example chat >/dev/null 2>&1) || { echo "build failed" >&2; exit 2; }
GEN=$ROOT/target/release/examples/generate
CHAT=$ROOT/target/release/examples/chat

busy() { while :; do :; done; }
busy & B1=$!
busy & B2=$!
trap 'kill $B1 $B2 2>/dev/null' EXIT

runs=0 ok=0 hangs=0 crashes=0 fails=0
declare -A per
record() { # name rc log
  runs=$((runs + 1))
  per[$1]=$(( ${per[$1]:-0} + 1 ))
  case $2 in
    0) ok=$((ok + 1)) ;;
    124|137) hangs=$((hangs + 1)); cp "$3" "$OUT/hang-$runs-$1.log" ;;
    134|135|136|139) crashes=$((crashes + 1)); cp "$3" "$OUT/crash-$runs-$1.log" ;;
    *) fails=$((fails + 1)); cp "$3" "$OUT/fail-$runs-$1-rc$2.log" ;;
  esac
}
log=$(mktemp)
start=$(date +%s)
for i in $(seq 1 "$RUNS"); do
  for fam in qwen3 lfm2 lfm2_moe qwen3_5 gemma4_text; do
    case $((i % 3)) in
      0) timeout -k 5 "$TIMEOUT" "$GEN" --model "$FIX/$fam" --prompt-ids 5,6,7,8,9 --max-new-tokens 24 --kv flat >"$log" 2>&1; rc=$? ;;
      1) timeout -k 5 "$TIMEOUT" "$GEN" --model "$FIX/$fam" --prompt-ids 5,6,7,8,9 --max-new-tokens 24 --kv paged >"$log" 2>&1; rc=$? ;;
      2) printf 'Hello there\nAnd then?\n' | timeout -k 5 "$TIMEOUT" "$CHAT" --model "$FIX/$fam" --max-new-tokens 12 >"$log" 2>&1; rc=$? ;;
    esac
    record "$fam" "$rc" "$log"
  done
  if [ $((i % 20)) = 0 ]; then
    echo "progress: $runs runs, $hangs hangs, $crashes crashes, $fails other failures ($(( $(date +%s) - start )) s)" >&2
  fi
done
rm -f "$log"
for fam in "${!per[@]}"; do printf '%s=%s ' "$fam" "${per[$fam]}"; done; echo
echo "stress: $runs runs, $ok clean, $hangs hangs, $crashes crashes, $fails other failures in $(( $(date +%s) - start )) s"
[ $((hangs + crashes + fails)) = 0 ]
