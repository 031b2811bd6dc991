#!/usr/bin/env bash
# One-query attention on CUDA, libmlx's cuDNN path against its vector kernel, on the pair of
# gpu_spec_bench.sh (run it first on the same device: its pair in /tmp/spec-pair, its runtime in
# MLXRT). libmlx 0.32 sends one query over a slice of a buffer of a multiple of 256 positions to
# cuDNN once there are 256 keys, building a graph per buffer size at its first use.
#
#   STAGE=DIR [ALT="NAME.."] bash crates/speculative/benches/gpu_attention_ab.sh
#
# Variants: the staged `generate` / `spec_trace` as they are; the same with
# MLX_CUDA_USE_CUDNN_SDPA=0 (no cuDNN attention at all); each NAME of ALT, another build staged
# as NAME(.xz) (generate) and spec_trace_NAME(.xz). Per variant: `spec_trace` at K = 7 over
# prompts of 32, 332 and 632 ids in one process (`--prompt-step 300`; the cycles where each run's
# history first passes 256 keys or starts, in OUT/xtrace_VARIANT.log), then a 1500-id prompt with
# 256 new tokens, plain and K = 7, in fresh `generate` processes (decode tok/s, a hash of the
# tokens: equal everywhere).
set -uo pipefail
G=${STAGE:?STAGE: the staged folder}; OUT=${OUT:-/tmp/gpu-out}; P=${PAIR_DIR:-/tmp/spec-pair}
export LD_LIBRARY_PATH=${MLXRT:-/tmp/mlxrt-spec}/mlx/lib
mkdir -p "$OUT"
for b in generate spec_trace ${ALT:-}; do
  for f in $b $([ "$b" = generate ] || [ "$b" = spec_trace ] || echo "spec_trace_$b"); do
    [ ! -f "$G/$f.xz" ] || xz -dkf "$G/$f.xz" 2>/dev/null
    [ -f "$G/$f" ] || { echo "$f not staged in $G" >&2; exit 2; }
    chmod +x "$G/$f"
  done
done
variants=(default MLX_CUDA_USE_CUDNN_SDPA=0 ${ALT:-})
# the variant's environment and binaries: "VARS GENERATE SPEC_TRACE"
pick() {
  case $1 in
    default) echo "- generate spec_trace" ;;
    *=*) echo "$1 generate spec_trace" ;;
    *) echo "- $1 spec_trace_$1" ;;
  esac
}
for e in "${variants[@]}"; do
  read -r v _ t <<< "$(pick "$e")"; [ "$v" = - ] && v=
  env $v "$G/$t" --model "$P/target" --draft "$P/draft" --depth 7 --new 256 --runs 3 --prompt 32 --prompt-step 300 --warm-up > "$OUT/xtrace_$e.log" 2>&1
  echo "trace [$e]: $(grep -E '^(prompt of|run [0-9]:|run [0-9] spec)|cycle at (257|265|333|341|633|641):' "$OUT/xtrace_$e.log" | cut -c1-150 | tr '\n' ' ')"
done
IDS=$(python3 -c "import random; random.seed(5); print(','.join(str(random.randrange(1000, 150000)) for _ in range(1500)))")
for e in "${variants[@]}"; do
  read -r v g _ <<< "$(pick "$e")"; [ "$v" = - ] && v=
  for a in "" "--draft-model $P/draft --draft-tokens 7"; do
    r=$(env $v "$G/$g" --model "$P/target" --prompt-ids "$IDS" --max-new-tokens 256 --temperature 0 --kv flat --json $a | tail -1)
    echo "long1500 [$e] ${a:+K7} $(echo "$r" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); p=d["performance"]; print(round(p["decode_tokens_per_sec"], 1), "ttft", round(p["ttft_ms"]), "ms", (d.get("speculative") or {}).get("accepted_mean"), hash(tuple(d["token_ids"])))')"
  done
done
