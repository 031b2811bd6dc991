#!/usr/bin/env bash
# CPU speculative-decoding figures, ours against mlx-lm's speculative_generate_step on the same
# pairs in the same run (draft_pair.py: greedy, medians of interleaved runs):
#   smollm2     SmolLM2-135M 4-bit drafting for SmolLM2-135M f32 (real weights; the pair nobody
#               built to agree);
#   deep        SmolLM2-135M f32 drafting for SmolLM2 with EXTRA more layers whose output
#               projections are scaled by 0.02 (make_pairs.py deep: high agreement);
#   useless     a random SmolLM2-shaped model drafting for SmolLM2-135M f32 (never agrees).
#
#   bash crates/speculative/benches/cpu_spec_bench.sh [OUT_DIR]
# Needs: the release `generate` example (cargo build --release -p mlx-models --example generate),
# SmolLM2 f32 in SRC (what the chat example fetches; default ~/.cache/mlx-models/SmolLM2-135M-Instruct),
# its 4-bit quantization in Q4 (default /tmp/smollm2-q4: `convert quantize SRC Q4 --bits 4`), and
# mlx-lm in PY (default: the venv of benches/setup_mlx_lm.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${1:-/tmp/spec-bench}
SRC=${SRC:-$HOME/.cache/mlx-models/SmolLM2-135M-Instruct}
Q4=${Q4:-/tmp/smollm2-q4}
PY=${PY:-/tmp/mlxlm/bin/python}
EXTRA=${EXTRA:-60}
TOKENS=${TOKENS:-64}
RUNS=${RUNS:-3}
B=$(dirname "$0")
mkdir -p "$OUT"
[ -d "$OUT/deep" ] || "$PY" "$B/make_pairs.py" deep "$SRC" "$OUT/deep" --extra "$EXTRA"
[ -d "$OUT/random" ] || "$PY" "$B/make_pairs.py" random "$SRC" "$OUT/random" --seed 1
for pair in "smollm2 $SRC $Q4 3" "deep $OUT/deep $SRC 6" "useless $SRC $OUT/random 3"; do
  set -- $pair
  echo "== $1: target $2, draft $3, K $4"
  "$PY" "$B/draft_pair.py" --target "$2" --draft "$3" --tokens "$TOKENS" --draft-tokens "$4" --runs "$RUNS" | tee "$OUT/$1.json"
done
