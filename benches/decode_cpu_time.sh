#!/usr/bin/env bash
# CPU time (all threads, from `perf stat`'s task-clock) per decoded token of decode_profile: the
# difference of two runs at GEN1 and GEN2 new tokens, each 3 rounds of a pipelined and a
# synchronous decode of that many tokens (so 6 * (GEN2 - GEN1) tokens apart). Unlike wall time it
# hardly moves when other processes share the cores, so builds compare on a busy machine.
#
#   bash benches/decode_cpu_time.sh DECODE_PROFILE MODEL_DIR [DTYPE] [GEN1] [GEN2]
#
# e.g. target/release/decode_profile with a converted 4-bit SmolLM2 (README: mlx-convert).
set -euo pipefail
bin=${1:?decode_profile binary}
model=${2:?model directory}
dtype=${3:-bf16}
g1=${4:-16}
g2=${5:-48}
command -v perf >/dev/null || { echo "perf is not installed" >&2; exit 1; }
run() {
  perf stat -x, -e task-clock -- "$bin" --model "$model" --dtype "$dtype" --prompt 32 --gen "$1" 2>&1 >/dev/null |
    awk -F, '/task-clock/ {print $1}'
}
a=$(run "$g1")
b=$(run "$g2")
awk -v a="$a" -v b="$b" -v n=$((6 * (g2 - g1))) -v bin="$bin" -v d="$dtype" \
  'BEGIN { printf "%s (%s): %.2f ms CPU per token (all threads)\n", bin, d, (b - a) / n }'
