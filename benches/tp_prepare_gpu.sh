#!/usr/bin/env bash
# Stage the multi-GPU tensor-parallel benchmark (benches/tp_gpu_bench.sh) in .gpu-tp/ (git-ignored
# via .git/info/exclude, never committed): the CUDA libmlx payload of scripts/gpu/prepare.sh, the
# release builds of llm_bench (random checkpoints), the `launch` and `generate` examples
# (stripped, xz) and the mlx 0.32.2 cp312 + mlx-lm 0.32.2 wheels.
# Then: run tool, kind nvidia-h200-x8 (or -x2/-x4), carry [".gpu-tp"], command:
#   bash benches/tp_gpu_bench.sh
# Not run yet: no multi-GPU machine has been lent since this was written.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
. "$ROOT/scripts/gpu/stage_payload.sh"
stage_payload .gpu-tp
(cd "$ROOT" && cargo build --release -p mlx-models-bench && cargo build --release -p mlx-models --example launch --example generate)
T=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release
cp -f "$T/llm_bench" "$S/llm_bench"
cp -f "$T/examples/launch" "$S/launch"
cp -f "$T/examples/generate" "$S/generate"
for b in llm_bench launch generate; do strip --strip-unneeded "$S/$b" && xz -T2 -6 -f "$S/$b"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 -d "$S" mlx==0.32.2 mlx-lm==0.32.2
du -ch "$S"/* | tail -1
