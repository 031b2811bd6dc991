#!/usr/bin/env bash
# Device side of the training benchmark (benches/train_bench.py) on the H200, bf16: ours against
# mlx-lm's trainer, full fine-tune and LoRA, on a SmolLM2-135M-shaped model with random weights
# (mlx-lm's initialisation; the device has no model files).
#
# Stage (here): a folder STAGE holding the CUDA libmlx payload of scripts/gpu/prepare.sh
# (libmlx.so.xz, include.tar.xz, cudalibs.tar.xz, as benches/prepare_gpu.sh stages them), the mlx
# 0.32.2 cp312 and mlx-lm 0.32.2 wheels, the train_bench example (release, stripped), this
# script, benches/train_bench.py and the model's config.json. Device: bash STAGE/gpu_train_bench.sh
# with GPU_STAGE=STAGE (the run tool's carry names STAGE).
set -uo pipefail
G=${GPU_STAGE:?GPU_STAGE: the staged folder}
ROOT=${ROOT:-$PWD}   # the repository root (the run tool starts there)
R=${MLXRT:-/tmp/mlxrt-train}
mkdir -p "$R/mlx/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do python3 -m zipfile -e "$w" "$R" || exit 3; done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())"
python3 "$G/train_bench.py" --random "$G/config.json" --dtype bf16 --bin "$G/train_bench" \
    --lib-dir "$R/mlx/lib" --batch-size "${BATCH:-8}" --seq-len "${SEQ:-512}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}"
