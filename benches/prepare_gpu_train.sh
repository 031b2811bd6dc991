#!/usr/bin/env bash
# Stage the device side of the training benchmark (benches/gpu_train_bench.sh) in STAGE (default
# .gpu-train/ of this checkout, git-ignored via .git/info/exclude, never committed): the CUDA
# libmlx payload (scripts/gpu/stage_payload.sh), the mlx 0.32.2 cp312 and mlx-lm 0.32.2 wheels,
# the train_bench example (release, stripped, xz), benches/train_bench.py, gpu_train_bench.sh and
# SmolLM2-135M's config.json (CONFIG, default ~/.cache/mlx-models/SmolLM2-135M-Instruct/config.json).
#   TRAIN_BENCH_BIN=path   use that build of train_bench instead of building
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
NAME=${1:-.gpu-train}
. "$ROOT/scripts/gpu/stage_payload.sh"
stage_payload "$NAME"
BIN=${TRAIN_BENCH_BIN:-}
if [ -z "$BIN" ]; then
  (cd "$ROOT" && cargo build --release -p mlx-training --example train_bench)
  BIN=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/examples/train_bench
fi
cp -f "$BIN" "$S/train_bench" && strip --strip-unneeded "$S/train_bench" && xz -T2 -6 -f "$S/train_bench"
cp -f "$ROOT/benches/train_bench.py" "$ROOT/benches/gpu_train_bench.sh" "$S/"
cp -f "${CONFIG:-$HOME/.cache/mlx-models/SmolLM2-135M-Instruct/config.json}" "$S/config.json"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 -d "$S" mlx==0.32.2 mlx-lm==0.32.2
du -ch "$S"/* | tail -1
