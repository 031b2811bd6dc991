#!/bin/bash
# Training throughput, two builds of the train_bench example against mlx-lm's trainer, alternating:
# each round runs BEFORE, AFTER and mlx-lm (benches/train_bench.py --mlx-lm-run), full fine-tune
# then LoRA rank 8, one JSON line each (tokens/s, tokens per CPU second, peak memory), with the
# load average first. The model is written once in f32 (as benches/train_bench.py does).
#
#   BEFORE=bin1 AFTER=bin2 MODEL=~/.cache/mlx-models/SmolLM2-135M-Instruct PY=/tmp/mlxlm/bin/python \
#       [ROUNDS=3] [STEPS=5] [WARMUP=1] [BATCH=2] [SEQ=64] [BEFORE_ARGS="--cpu-fusion off"] bash benches/train_ab.sh
#
# (PY: a python with mlx-lm 0.32.2; the binaries run with mlx-sys's CPU libmlx, mlx-lm with the
# same OpenBLAS behind mlx-sys's BLAS router, as benches/train_bench.py arranges.)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BEFORE:?BEFORE=path of the first train_bench binary}" "${AFTER:?AFTER=path of the second}" "${MODEL:?MODEL=checkpoint directory}" "${PY:?PY=python with mlx-lm}"
ROUNDS=${ROUNDS:-3} STEPS=${STEPS:-5} WARMUP=${WARMUP:-1} BATCH=${BATCH:-2} SEQ=${SEQ:-64}
LIB=$HOME/.cache/mlx-sys/mlx-cpu-0.32.2/mlx
ROUTER=$(ls "$LIB"/../mlx_cpu.libs/libmlx-models-blas-route-*.so | head -1)
F32=$(mktemp -d)
trap 'rm -rf "$F32"' EXIT
"$PY" -c "import sys; sys.path.insert(0, 'benches'); import train_bench as t; t.write_model(sys.argv[1], sys.argv[2], 'f32')" "$MODEL" "$F32/model"
C="--batch-size $BATCH --seq-len $SEQ --steps $STEPS --warmup $WARMUP"
load() { cut -d' ' -f1-3 /proc/loadavg; }
for round in $(seq "$ROUNDS"); do
  for mode in full lora; do
    L=""
    [ "$mode" = lora ] && L="--lora-rank 8"
    # shellcheck disable=SC2086
    echo "round $round $(load) before $(LD_LIBRARY_PATH="$LIB/lib" "$BEFORE" --model "$F32/model" $C $L ${BEFORE_ARGS:-})"
    # shellcheck disable=SC2086
    echo "round $round $(load) after $(LD_LIBRARY_PATH="$LIB/lib" "$AFTER" --model "$F32/model" $C $L ${AFTER_ARGS:-})"
    # shellcheck disable=SC2086
    echo "round $round $(load) mlx-lm $(LD_PRELOAD="$ROUTER /usr/lib/x86_64-linux-gnu/libopenblas.so.0" "$PY" benches/train_bench.py --mlx-lm-run $mode --model-f32 "$F32/model" $C | tail -1)"
  done
done
