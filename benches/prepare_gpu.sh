#!/usr/bin/env bash
# Stage the H200 benchmark in .gpu-bench/ (git-ignored via .git/info/exclude, never committed):
# the CUDA libmlx payload of scripts/gpu/prepare.sh (run it first, or this runs it with
# --no-build), llm_bench (release, stripped) and the mlx 0.32.2 cp312 + mlx-lm 0.32.2 wheels.
# Then: run tool, carry [".gpu-bench"], command: bash benches/gpu_bench.sh
#   LLM_BENCH_BIN=path   use that llm_bench build instead of building
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
. "$ROOT/scripts/gpu/stage_payload.sh"
stage_payload .gpu-bench
BIN=${LLM_BENCH_BIN:-}
if [ -z "$BIN" ]; then
  (cd "$ROOT" && cargo build --release -p mlx-models-bench)
  BIN=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/llm_bench
fi
cp -f "$BIN" "$S/llm_bench" && strip --strip-unneeded "$S/llm_bench"
# WITH_CONVERT=1: also the `convert` example (xz), for benches/gpu_bench_quantized.sh
#   CONVERT_BIN=path   use that build instead of building
if [ -n "${WITH_CONVERT:-}" ]; then
  CBIN=${CONVERT_BIN:-}
  if [ -z "$CBIN" ]; then
    (cd "$ROOT" && cargo build --release -p mlx-convert --example convert)
    CBIN=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/examples/convert
  fi
  cp -f "$CBIN" "$S/convert" && strip --strip-unneeded "$S/convert" && xz -T2 -6 -f "$S/convert"
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 -d "$S" mlx==0.32.2 mlx-lm==0.32.2
du -ch "$S"/* | tail -1
