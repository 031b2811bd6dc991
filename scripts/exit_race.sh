#!/usr/bin/env bash
# The exit race behind hangs and crashes at process exit: `exit_race` returns from main while MLX
# still computes queued f32 matmuls (OpenBLAS). Runs it RUNS times each way, alternating, beside
# two busy loops of its own, and counts clean exits, hangs (killed after 10 s) and crashes.
#
#   scripts/exit_race.sh [RUNS]     # default 200
#
# `--no-wait` bypasses mlx_array::async_eval's exit wait (mlx_array::wait_for_queued_work_at_exit):
# without it some exits hang in OpenBLAS's gotoblas_quit or crash; with it none should.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${1:-200}
(cd "$ROOT" && cargo build --release -p mlx-array --example exit_race >/dev/null 2>&1) || { echo "build failed" >&2; exit 2; }
BIN=$ROOT/target/release/examples/exit_race
LIB=$(ls -d "$HOME"/.cache/mlx-sys/mlx-cpu-*/mlx/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
busy() { while :; do :; done; }
busy & B1=$!
busy & B2=$!
trap 'kill $B1 $B2 2>/dev/null' EXIT
declare -A clean hang crash
for mode in wait no-wait; do clean[$mode]=0; hang[$mode]=0; crash[$mode]=0; done
for i in $(seq 1 "$RUNS"); do
  for mode in wait no-wait; do
    args=(); [ "$mode" = no-wait ] && args=(--no-wait)
    timeout -k 2 10 "$BIN" "${args[@]}" >/dev/null 2>&1
    case $? in
      0) clean[$mode]=$((clean[$mode] + 1)) ;;
      124|137) hang[$mode]=$((hang[$mode] + 1)) ;;
      *) crash[$mode]=$((crash[$mode] + 1)) ;;
    esac
  done
done
for mode in wait no-wait; do
  echo "exit_race $mode: $RUNS runs, ${clean[$mode]} clean, ${hang[$mode]} hangs, ${crash[$mode]} crashes"
done
[ "${hang[wait]}" = 0 ] && [ "${crash[wait]}" = 0 ]
