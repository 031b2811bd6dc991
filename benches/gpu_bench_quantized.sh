#!/usr/bin/env bash
# Device side of the H200 quantized-decode benchmark (the `run` tool, from the repository root,
# carry [".gpu-bench"]):
#
#   bash benches/gpu_bench_quantized.sh            # qwen3-8b, 4-bit and 8-bit
#   SHAPE=qwen3-0.6b BITS="4" RUNS=5 KVS="flat paged" bash benches/gpu_bench_quantized.sh
#
# .gpu-bench/ (staged by `WITH_CONVERT=1 benches/prepare_gpu.sh`) holds the sm_90 CUDA libmlx
# payload, llm_bench, the `convert` example and the mlx 0.32.2 (cp312) + mlx-lm 0.32.2 wheels
# (benches/gpu_bench.sh says how they are laid out). On the device: `convert random qwen3 DIR
# --preset 8b --dtype bf16` writes a random bf16 checkpoint, `convert quantize DIR DIR-qB --bits B`
# (affine, groups of 64, mlx-lm's layout and layer choice) quantizes it for each B in $BITS, and
# llm_bench times our decode against mlx-lm's on each (bf16 compute, a 128-token prompt, 128 new
# tokens, $RUNS alternating runs, for each KV cache of ours in $KVS; mlx-lm's is its KVCache) and
# prints the floor: quantized bytes read per token (packed weights, scales and biases; the
# untied embedding table excluded) over the copy bandwidth it measures.
# Logs and JSON go to $OUT (the run tool's return folder; /tmp/gpu-out when unset).
set -uo pipefail
ROOT=$PWD
G=${GPU_STAGE:-$ROOT/.gpu-bench}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-bench}
W=${WORK:-/tmp/qbench}
SHAPE=${SHAPE:-qwen3-8b}
BITS=${BITS:-4 8}
RUNS=${RUNS:-9}
KVS=${KVS:-flat}
GEN=${GEN:-128}
mkdir -p "$OUT" "$R/mlx/lib" "$W"
{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
  head -2 /etc/os-release; nproc; free -g | head -2; df -h /tmp | tail -1; python3 --version
} 2>&1 | tee "$OUT/env.log"
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do python3 -m zipfile -e "$w" "$R" || exit 3; done
BIN=$W/bin
mkdir -p "$BIN"
for b in llm_bench convert; do
  if [ -f "$G/$b.xz" ]; then xz -dc "$G/$b.xz" > "$BIN/$b"; else cp -f "$G/$b" "$BIN/$b"; fi || { echo "no $b in $G" | tee -a "$OUT/env.log"; exit 3; }
  chmod +x "$BIN/$b"
done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R
export MLX_LM_PYTHON=python3 PYTHONUNBUFFERED=1
{ ldd "$BIN/llm_bench" "$BIN/convert" | grep -E 'libmlx|not found'; python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())"; } 2>&1 | tee -a "$OUT/env.log"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
SMI=$!
LOG=$OUT/bench.log
rc=0
family=${SHAPE%-*} preset=${SHAPE##*-}
D=$W/$SHAPE-bf16
t0=$(date +%s)
echo "== convert random $family $D --preset $preset --dtype bf16" | tee -a "$LOG"
"$BIN/convert" random "$family" "$D" --preset "$preset" --dtype bf16 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || { kill $SMI; exit 1; }
echo "created in $(( $(date +%s) - t0 )) s; $(du -sh "$D" | cut -f1)" | tee -a "$LOG"
for bits in $BITS; do
  Q=$W/$SHAPE-q$bits
  t0=$(date +%s)
  echo "== convert quantize $D $Q --bits $bits" | tee -a "$LOG"
  "$BIN/convert" quantize "$D" "$Q" --bits "$bits" --json > "$OUT/quantize-q$bits.json" 2>>"$LOG" || { rc=1; continue; }
  echo "quantized in $(( $(date +%s) - t0 )) s; $(du -sh "$Q" | cut -f1)" | tee -a "$LOG"
done
# every bit width with the first KV cache, then with the next (what a short call gets through first)
for kv in $KVS; do
  for bits in $BITS; do
    Q=$W/$SHAPE-q$bits
    [ -d "$Q" ] || continue
    echo "== $SHAPE q$bits, KV $kv" | tee -a "$LOG"
    "$BIN/llm_bench" --model "$Q" --dtype bf16 --runs "$RUNS" --prompts 128 --gen "$GEN" --kv "$kv" --bandwidth \
      --script "$ROOT/benches/mlx_lm_bench.py" --json "$OUT/$SHAPE-q$bits-$kv.json" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
[ -n "${KEEP:-}" ] || rm -rf "$W"/"$SHAPE"-*
kill $SMI 2>/dev/null
exit $rc
