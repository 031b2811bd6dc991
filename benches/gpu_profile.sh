#!/usr/bin/env bash
# Per-kernel GPU time of our decode step, with Nsight Compute (device side; run after
# `KEEP=1 bash benches/gpu_bench.sh qwen3-8b`, which unpacks the runtime under $MLXRT and leaves
# the random checkpoint in ~/.cache/mlx-models/bench/qwen3-8b-bf16).
#
#   bash benches/gpu_profile.sh [BIN] [LAYERS...]   # default: llm_bench, 2 and 4 layers
#
# ncu serialises and times every kernel, so it profiles a copy of the checkpoint cut to LAYERS
# layers (config.json edited, safetensors symlinked; the extra layers' tensors are ignored):
# the per-layer kernels are the same as in the full model, and the time of one full decode
# step is then head + LAYERS-layer kernels scaled to num_hidden_layers (see
# benches/ncu_summary.py). Output: $OUT/ncu-<BIN>.csv and a summary on stdout.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G=${GPU_STAGE:-$ROOT/.gpu-bench}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-bench}
BIN=${1:-llm_bench}
shift || true
LAYERS=("$@"); [ ${#LAYERS[@]} -gt 0 ] || LAYERS=(2 4)
SRC=${SRC:-$HOME/.cache/mlx-models/bench/qwen3-8b-bf16}
export LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 3; }
LOGS=()
for L in "${LAYERS[@]}"; do
  D=/tmp/ncu-ckpt-$L
  mkdir -p "$D" "$OUT"
  for f in "$SRC"/*; do [ "$(basename "$f")" = config.json ] || ln -sfn "$f" "$D/"; done
  python3 - "$SRC/config.json" "$D/config.json" "$L" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = int(sys.argv[3])
json.dump(c, open(sys.argv[2], "w"))
PY
  # --gen 6: the summary takes the last 3 decode steps.
  "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu-$BIN-$L.csv" \
    "$G/$BIN" --model "$D" --dtype bf16 --runs 1 --gen 6 --prompts 16 --no-mlx-lm > "$OUT/ncu-$BIN-$L.stdout" 2>&1
  echo "ncu $BIN $L layers rc=$?"; tail -2 "$OUT/ncu-$BIN-$L.stdout"
  LOGS+=("$OUT/ncu-$BIN-$L.csv:$L")
done
FULL=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$SRC/config.json")
python3 "$ROOT/benches/ncu_summary.py" "$FULL" "${LOGS[@]}"
