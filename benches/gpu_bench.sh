#!/usr/bin/env bash
# Device side of the H200 benchmark (the `run` tool, carry [".gpu-bench"]):
#
#   bash benches/gpu_bench.sh [SHAPES...]     # default: qwen3-0.6b qwen3-8b
#
# .gpu-bench/ (staged by benches/prepare_gpu.sh) holds the sm_90-trimmed CUDA libmlx of
# mlx-cuda-13 0.32.2 (scripts/gpu/prepare.sh's payload), the llm_bench binary built here against
# the CPU libmlx (same C++ API), and the mlx 0.32.2 (cp312) + mlx-lm 0.32.2 wheels. Layout made
# under $R (as the wheels install it, so the Python extension and our binary load the same
# libmlx.so): $R/mlx/{lib/libmlx.so,include,*.py,core*.so}, $R/mlx_lm, $R/mlx_cuda_13.libs,
# $R/nvidia -> the image's venv nvidia/ (cu13, cudnn, nccl). mlx-lm's other needs (numpy,
# transformers, ...) are on the image. Random bf16 checkpoints are created on the device.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G=${GPU_STAGE:-$ROOT/.gpu-bench}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-bench}
SHAPES=("$@"); [ ${#SHAPES[@]} -gt 0 ] || SHAPES=(qwen3-0.6b qwen3-8b)
RUNS=${RUNS:-5}   # KV=flat|paged: passed to llm_bench --kv
# PROFILE=1: after each shape's benchmark, decode_profile (staged next to llm_bench) with a flat and
# a paged cache: where a decode step's host time goes, and what the paged cache costs.
mkdir -p "$OUT" "$R/mlx/lib"
{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
  head -2 /etc/os-release; nproc; free -g | head -2; python3 --version
} 2>&1 | tee "$OUT/env.log"
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do python3 -m zipfile -e "$w" "$R" || exit 3; done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R
export MLX_LM_PYTHON=python3 PYTHONUNBUFFERED=1
B=$G/llm_bench
{ ldd "$B" | grep -E 'libmlx|not found'; python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())"; } 2>&1 | tee -a "$OUT/env.log"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
SMI=$!
rc=0
for s in "${SHAPES[@]}"; do
  echo "== $s" | tee -a "$OUT/bench.log"
  D=$("$B" --create-random "$s" --dtype bf16 2>>"$OUT/bench.log") || { rc=1; continue; }
  du -sh "$D" | tee -a "$OUT/bench.log"
  [ -z "${NOBENCH:-}" ] || continue   # NOBENCH=1: unpack and create only (keeps the checkpoint)
  for b in ${BINS:-llm_bench}; do  # BINS="llm_bench llm_bench_x": also time other builds (experiments)
    echo "== $s with $b" | tee -a "$OUT/bench.log"
    "$G/$b" --model "$D" --dtype bf16 --runs "$RUNS" ${KV:+--kv "$KV"} --bandwidth --script "$ROOT/benches/mlx_lm_bench.py" \
         --json "$OUT/$s.$b.json" 2>&1 | tee -a "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  if [ -n "${PROFILE:-}" ] && [ -x "$G/decode_profile" ]; then
    for kv in flat paged; do
      echo "== $s decode_profile --kv $kv" | tee -a "$OUT/bench.log"
      "$G/decode_profile" --model "$D" --dtype bf16 --prompt 128 --gen 128 --kv "$kv" 2>&1 | tail -4 | tee -a "$OUT/bench.log"
    done
  fi
  [ -n "${KEEP:-}" ] || rm -rf "$D"   # KEEP=1: leave it for benches/gpu_profile.sh
done
kill $SMI 2>/dev/null
exit $rc
