#!/usr/bin/env bash
# Device side of the training benchmark (benches/train_bench.py) on an H200 or H100, bf16: ours
# against mlx-lm's trainer, full fine-tune and LoRA, on a SmolLM2-135M-shaped model with random
# weights (mlx-lm's initialisation; the device has no model files).
#
# Stage (here): bash benches/prepare_gpu_train.sh STAGE, a folder holding the CUDA libmlx payload of
# scripts/gpu/prepare.sh (libmlx.so.xz, include.tar.xz, cudalibs.tar.xz), the mlx 0.32.2 cp312
# and mlx-lm 0.32.2 wheels, the train_bench example (release, stripped, xz), this script,
# benches/train_bench.py and the model's config.json. Device (the run tool, carry STAGE):
#   GPU_STAGE=STAGE bash STAGE/gpu_train_bench.sh
# BATCH, SEQ, STEPS, WARMUP (default 8, 512, 10, 3) size the run; EXTRA=1 also runs our full
# fine-tune with the full logits and with gradient checkpointing.
set -uo pipefail
G=${GPU_STAGE:?GPU_STAGE: the staged folder}
ROOT=${ROOT:-$PWD}   # the repository root (the run tool starts there)
R=${MLXRT:-/tmp/mlxrt-train}
mkdir -p "$R/mlx/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do python3 -m zipfile -e "$w" "$R" || exit 3; done
BIN=$G/train_bench
if [ -f "$G/train_bench.xz" ]; then BIN=$R/train_bench; xz -dc "$G/train_bench.xz" > "$BIN" && chmod +x "$BIN" || exit 3; fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())"
python3 "$G/train_bench.py" --random "$G/config.json" --dtype bf16 --bin "$BIN" \
    --lib-dir "$R/mlx/lib" --batch-size "${BATCH:-8}" --seq-len "${SEQ:-512}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
    $([ "${EXTRA:-0}" = 1 ] || echo --no-extra)
