#!/usr/bin/env bash
# Device side of the serving benchmark (the `run` tool): mlx-serve against mlx_lm.server on a
# random Qwen3-8B-shaped bf16 checkpoint with a whole-vocabulary word-level tokenizer
# (benches/word_tokenizer.py), at 1/8/32/64 concurrent streams (benches/serve_bench.py), and
# the device's copy bandwidth (llm_bench --bandwidth-only) for the decode floors.
#
#   stage (here): bash benches/prepare_serve_gpu.sh      # -> $STAGE (default .gpu-serve/)
#   run tool:     carry [".gpu-bench", ".gpu-serve"], command: bash .gpu-serve/gpu_serve_bench.sh
# (the stage may sit deeper in the tree: the repository root is the first parent holding
# scripts/gpu/unpack_payload.sh)
#
# .gpu-bench/ is benches/prepare_gpu.sh's stage (CUDA libmlx payload, llm_bench for
# --create-random, the mlx and mlx-lm 0.32.2 wheels). Each server's half runs under its own
# time limit, so one that stalls leaves the other's figures (and the levels it finished:
# serve_bench.py saves each level as it is measured). Env: SHAPE (qwen3-8b), MAX_TOKENS (32),
# CONCURRENCY (1,8,32,64), WARMUP (64 streams of 4 tokens, once per server), WHICH
# (ours,mlx_lm), BUDGET (seconds for both halves, 330; each half gets its share of what is left),
# OUT (/tmp/gpu-out: env.log with the copy bandwidth, serve.log with the floors and the table,
# ours.json, mlx_lm.json, server.ours and server.mlx_lm: each server's stderr).
set -uo pipefail
START=$(date +%s)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$HERE; until [ -f "$ROOT/scripts/gpu/unpack_payload.sh" ] || [ "$ROOT" = / ]; do ROOT=$(dirname "$ROOT"); done
G=${GPU_STAGE:-$ROOT/.gpu-bench}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-serve}
SHAPE=${SHAPE:-qwen3-8b}
BUDGET=${BUDGET:-330}
WHICH=${WHICH:-ours,mlx_lm}
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
# Decode floors: weight bytes / copy bandwidth at one stream; a batch of B reads the weights once.
"$G/llm_bench" --bandwidth-only 2>&1 | tee -a "$OUT/env.log"
python3 - "$D" "$OUT/env.log" <<'PY' | tee -a "$OUT/serve.log"
import glob, os, re, sys
w = sum(os.path.getsize(p) for p in glob.glob(os.path.join(sys.argv[1], "*.safetensors")))
m = re.findall(r"([0-9.]+)\s*GB/s", open(sys.argv[2]).read())
if m:
    bw = float(m[-1]) * 1e9
    print(f"weights {w / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s: floor {bw / w:.1f} tok/s at 1 stream, "
          f"{64 * bw / w:.0f} tok/s at 64 streams (weights only)")
else:
    print(f"weights {w / 1e9:.2f} GB; no bandwidth figure")
PY
IFS=, read -ra KINDS <<< "$WHICH"
rc=0; n=${#KINDS[@]}
for k in "${KINDS[@]}"; do
  left=$(( BUDGET - ($(date +%s) - START) )); share=$(( left / n )); n=$(( n - 1 ))
  [ "$share" -gt 30 ] || { echo "$k: no time left ($left s)" | tee -a "$OUT/serve.log"; rc=5; continue; }
  echo "== $k (limit $share s)" | tee -a "$OUT/serve.log"
  timeout "$share" python3 "$HERE/serve_bench.py" --model "$D" --ours "$BIN" --mlx-lm-python python3 --which "$k" \
    --concurrency "${CONCURRENCY:-1,8,32,64}" --max-tokens "${MAX_TOKENS:-32}" --warmup "${WARMUP:-64}" --warmup-tokens 4 \
    --max-batch 64 --json "$OUT/$k.json" --server-log "$OUT/server" 2>&1 | tee -a "$OUT/serve.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
ls "$OUT"/ours.json "$OUT"/mlx_lm.json 2>/dev/null | xargs -r python3 "$HERE/serve_bench.py" --table | tee -a "$OUT/serve.log"

rm -rf "$D"
exit $rc
