#!/usr/bin/env bash
# The CPU (f32) side of BENCHMARKS.md: every family's small random checkpoint through llm_bench
# against mlx-lm, one after the other (run it on a quiet machine: nothing else compiling).
#
#   bash benches/cpu_bench.sh [SHAPES...]   # default: all below; logs and JSON in $OUT
#
# Needs the mlx-lm venv of benches/setup_mlx_lm.sh (MLX_LM_PYTHON, default /tmp/mlxlm/bin/python).
# PEER_BLAS=same (default): mlx-lm gets our BLAS router + OpenBLAS preloaded, the same BLAS as ours;
# PEER_BLAS=openblas: OpenBLAS alone (a stock mlx-lm with OpenBLAS). See llm_bench --peer-blas.
# PROMPTS=128,2048 GEN=128: the benchmark issue's own sizes for every shape (the defaults below are
# shorter so that a pass takes minutes on 2 cores; this one takes about half an hour).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/target/cpu-bench}
PY=${MLX_LM_PYTHON:-/tmp/mlxlm/bin/python}
C=$HOME/.cache/mlx-models/bench
B=$ROOT/target/release/llm_bench
RUNS=${RUNS:-3}
PEER_BLAS=${PEER_BLAS:-same}
mkdir -p "$OUT"
[ -x "$B" ] || (cd "$ROOT" && cargo build --release -p mlx-models-bench) || exit 1
SHAPES=("$@"); [ ${#SHAPES[@]} -gt 0 ] || SHAPES=(qwen3-small qwen3-small:paged qwen3_5-small qwen3_5-moe-small gemma4-small lfm2-small lfm2-moe-small qwen3-0.6b)
rc=0
for s in "${SHAPES[@]}"; do
  name=${s%%:*}; kv=flat; [ "$s" = "${s#*:}" ] || kv=${s#*:}
  case $name in
    gemma4-*) prompts=640,1024 ;;   # past the 512-token sliding window
    qwen3-0.6b) prompts=128 ;;      # 2.4 GB of f32 weights: 2048-token prefills take minutes a request
    *) prompts=128,512 ;;
  esac
  gen=64; [ "$name" = qwen3-0.6b ] && gen=32
  prompts=${PROMPTS:-$prompts} gen=${GEN:-$gen}
  [ -d "$C/$name-f32" ] || "$B" --create-random "$name" --dtype f32 >/dev/null || { rc=1; continue; }
  echo "== $s (kv $kv, prompts $prompts, gen $gen, $RUNS runs, peer BLAS $PEER_BLAS) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/cpu-bench.log"
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$B" --model "$C/$name-f32" --dtype f32 --kv "$kv" --runs "$RUNS" --gen "$gen" \
      --prompts "$prompts" --peer-blas "$PEER_BLAS" --python "$PY" --json "$OUT/$name-$kv.json" 2>&1 | grep -v '^run \|warm-up' | tee -a "$OUT/cpu-bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit $rc
