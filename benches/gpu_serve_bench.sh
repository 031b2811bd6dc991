#!/usr/bin/env bash
# Device side of the serving benchmark (the `run` tool): mlx-serve against mlx_lm.server on a
# random Qwen3-8B-shaped bf16 checkpoint with a whole-vocabulary word-level tokenizer
# (benches/word_tokenizer.py), at 1/8/32/64 concurrent streams (benches/serve_bench.py).
#
#   stage (here): bash benches/prepare_serve_gpu.sh      # -> $STAGE (default .gpu-serve/)
#   run tool:     carry [".gpu-bench", ".gpu-serve"], command: bash .gpu-serve/gpu_serve_bench.sh
# (the stage may sit deeper in the tree: the repository root is the first parent holding
# scripts/gpu/unpack_payload.sh)
#
# .gpu-bench/ is benches/prepare_gpu.sh's stage (CUDA libmlx payload, llm_bench for
# --create-random, the mlx and mlx-lm 0.32.2 wheels). Env: SHAPE (qwen3-8b), MAX_TOKENS (64),
# CONCURRENCY (1,8,32,64), WHICH (ours,mlx_lm), OUT (/tmp/gpu-out; $OUT/serve.json).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$HERE; until [ -f "$ROOT/scripts/gpu/unpack_payload.sh" ] || [ "$ROOT" = / ]; do ROOT=$(dirname "$ROOT"); done
G=${GPU_STAGE:-$ROOT/.gpu-bench}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-serve}
SHAPE=${SHAPE:-qwen3-8b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.log"
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do python3 -m zipfile -e "$w" "$R" || exit 3; done
export LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R PYTHONUNBUFFERED=1
BIN=$HERE/mlx-serve
[ -f "$BIN.xz" ] && { xz -dc "$BIN.xz" > "$BIN" && chmod +x "$BIN"; }
ldd "$BIN" | grep -E 'libmlx|not found' | tee -a "$OUT/env.log"
t0=$(date +%s)
D=$("$G/llm_bench" --create-random "$SHAPE" --dtype bf16 2>>"$OUT/env.log") || exit 4
python3 "$HERE/word_tokenizer.py" "$D" | tee -a "$OUT/env.log"
echo "checkpoint $D in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.log"
python3 "$HERE/serve_bench.py" --model "$D" --ours "$BIN" --mlx-lm-python python3 \
  --concurrency "${CONCURRENCY:-1,8,32,64}" --max-tokens "${MAX_TOKENS:-64}" --which "${WHICH:-ours,mlx_lm}" \
  --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log"
rc=${PIPESTATUS[0]}
rm -rf "$D"
exit $rc
