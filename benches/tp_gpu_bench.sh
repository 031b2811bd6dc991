#!/usr/bin/env bash
# Device side of the multi-GPU tensor-parallel benchmark (the `run` tool on nvidia-h200-x8 or
# -x2/-x4, carry [".gpu-tp"] staged by benches/tp_prepare_gpu.sh):
#
#   bash benches/tp_gpu_bench.sh [SHAPES...]    # default: qwen3-8b qwen3_5-moe-35b_a3b
#
# For each shape: a random bf16 checkpoint (llm_bench --create-random), then for N = 1, 2, 4, 8
# GPUs (those the machine has): our generate example (N = 1 alone, N > 1 through
# `launch --backend nccl -n N generate`), and mlx-lm's sharded generation
# (benches/mlx_lm_sharded_bench.py on N ranks with the NCCL environment mlx.launch sets), the
# same 128 prompt ids and 128 greedy tokens. Writes $OUT/tp_bench.jsonl (one line per run) and
# $OUT/tp_bench.md (prefill and decode tok/s, scaling efficiency = tps_N / (N * tps_1)).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes require.
#
# Not run yet: no multi-GPU machine has been lent since this was written.
# qwen3_5-moe-35b_a3b is the registry's Qwen3.5-35B-A3B-shaped preset (about 70 GB in bf16;
# experts split across the ranks). It has 2 KV heads, so our side runs it on 1 and 2 GPUs and
# refuses 4 and 8 ("2 KV heads, not a multiple of 4"): KV heads are not replicated across ranks.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G=${GPU_STAGE:-$ROOT/.gpu-tp}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-tp}
SHAPES=("$@"); [ ${#SHAPES[@]} -gt 0 ] || SHAPES=(qwen3-8b qwen3_5-moe-35b_a3b)
PROMPT=${PROMPT:-128}
GEN=${GEN:-128}
mkdir -p "$OUT" "$R/mlx/lib" "$R/bin"
export NCCL_NVLS_ENABLE=0
{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m; nproc; free -g | head -2; python3 --version
} 2>&1 | tee "$OUT/env.log"
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do python3 -m zipfile -e "$w" "$R" || exit 3; done
for b in llm_bench launch generate; do xz -dc "$G/$b.xz" > "$R/bin/$b" && chmod +x "$R/bin/$b" || exit 3; done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$R PYTHONUNBUFFERED=1
GPUS=$(nvidia-smi -L | wc -l)
IDS=$(python3 -c "print(','.join(str((i * 7919 + 13) % 30000 + 10) for i in range($PROMPT)))")
: > "$OUT/tp_bench.jsonl"
rc=0
for s in "${SHAPES[@]}"; do
  D=$("$R/bin/llm_bench" --create-random "$s" --dtype bf16 2>>"$OUT/bench.log") || { rc=1; continue; }
  for n in 1 2 4 8; do
    [ "$n" -le "$GPUS" ] || continue
    echo "== $s on $n GPU(s)" | tee -a "$OUT/bench.log"
    for pass in warm timed; do
      if [ "$n" = 1 ]; then
        line=$(CUDA_VISIBLE_DEVICES=0 "$R/bin/generate" --model "$D" --prompt-ids "$IDS" --max-new-tokens "$GEN" --json 2>>"$OUT/bench.log" | tail -1)
      else
        line=$("$R/bin/launch" --backend nccl -n "$n" "$R/bin/generate" -- --model "$D" --prompt-ids "$IDS" --max-new-tokens "$GEN" --json 2>>"$OUT/bench.log" | tail -1)
      fi
    done
    [ -n "$line" ] || rc=1
    echo "{\"shape\":\"$s\",\"gpus\":$n,\"impl\":\"mlx-models\",\"result\":${line:-null}}" | tee -a "$OUT/tp_bench.jsonl"
    # mlx-lm: N ranks with mlx.launch's NCCL environment, rank 0 prints
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    pids=()
    for r in $(seq 0 $((n - 1))); do
      MLX_RANK=$r MLX_WORLD_SIZE=$n NCCL_HOST_IP=127.0.0.1 NCCL_PORT=$port CUDA_VISIBLE_DEVICES=$r \
        python3 "$ROOT/benches/mlx_lm_sharded_bench.py" "$D" --prompt "$PROMPT" --gen "$GEN" > "$OUT/mlx_lm.$s.$n.rank$r.out" 2>>"$OUT/bench.log" &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    line=$(grep '^{' "$OUT/mlx_lm.$s.$n.rank0.out" | tail -1)
    echo "{\"shape\":\"$s\",\"gpus\":$n,\"impl\":\"mlx-lm\",\"result\":${line:-null}}" | tee -a "$OUT/tp_bench.jsonl"
  done
  rm -rf "$D"
done
python3 - "$OUT/tp_bench.jsonl" > "$OUT/tp_bench.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = {}
print("| shape | impl | GPUs | prefill tok/s | decode tok/s | decode scaling efficiency |")
print("|---|---|---|---|---|---|")
for r in rows:
    res = r["result"] or {}
    perf = res.get("performance", res)
    pre, dec = perf.get("prefill_tokens_per_sec", perf.get("prefill_tps")), perf.get("decode_tokens_per_sec", perf.get("decode_tps"))
    key = (r["shape"], r["impl"])
    if r["gpus"] == 1 and dec:
        base[key] = dec
    eff = f"{dec / (r['gpus'] * base[key]):.2f}" if dec and key in base else "-"
    f = lambda x: f"{x:.1f}" if x else "failed"
    print(f"| {r['shape']} | {r['impl']} | {r['gpus']} | {f(pre)} | {f(dec)} | {eff} |")
PY
cat "$OUT/tp_bench.md"
exit $rc
