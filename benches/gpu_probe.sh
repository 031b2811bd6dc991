#!/usr/bin/env bash
# Device-side checks next to gpu_bench.sh (the `run` tool, carry [".gpu-bench"], staged with
# logits_probe): bf16 vs f32 logits of ours and mlx-lm on the H200, and peak memory with the
# fused projections on and off.
#
#   bash benches/gpu_probe.sh logits SHAPE        # last-position logits, bf16 and f32, both sides
#   bash benches/gpu_probe.sh fuse SHAPE [ARGS]   # llm_bench --fuse auto, then --fuse off
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G=${GPU_STAGE:-$ROOT/.gpu-bench}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-bench}
what=$1 s=$2; shift 2
KEEP=1 NOBENCH=1 OUT=$OUT bash "$ROOT/benches/gpu_bench.sh" "$s" >/dev/null 2>&1 || { echo "unpack/create failed"; tail -5 "$OUT/bench.log"; exit 1; }
export LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R MLX_LM_PYTHON=python3 PYTHONUNBUFFERED=1
D=$HOME/.cache/mlx-models/bench/$s-bf16
case $what in
  logits)
    for d in f32 bf16; do
      "$G/logits_probe" --model "$D" --dtype "$d" --prompt 128 --out "$OUT/ours-$d.f32"
      python3 "$ROOT/benches/mlx_lm_bench.py" "$D" --dtype "$d" --prompt 128 --logits "$OUT/mlx_lm-$d.f32"
    done
    (cd "$OUT" && python3 "$ROOT/benches/compare_logits.py" ours-f32.f32 mlx_lm-f32.f32 ours-bf16.f32 mlx_lm-bf16.f32) ;;
  fuse)
    for f in auto off; do
      echo "== $s --fuse $f"
      "$G/llm_bench" --model "$D" --dtype bf16 --fuse "$f" --script "$ROOT/benches/mlx_lm_bench.py" "$@" 2>&1 | grep -E '^\|'
    done ;;
esac
