#!/usr/bin/env bash
# Stage the GPU speculative benchmark for the device machine (the `run` tool, carry [".dev/spec"]):
#
#   bash crates/speculative/benches/prepare_gpu_spec.sh [DIR]    # under the repository root; default .dev/spec
#
# DIR gets the CUDA libmlx payload (scripts/gpu/stage_payload.sh: the mlx-cuda-13 wheel's libmlx
# trimmed to sm_90), the mlx 0.32.2 cp312 and mlx-lm 0.32.2 wheels, and the release `generate`
# example and the `verify_probe` and `spec_trace` benches, stripped and xz'd (built here against the CPU libmlx; they run
# with the CUDA one swapped in). Nothing staged is committed. Then on the device:
#   STAGE=DIR NEW=384 bash crates/speculative/benches/gpu_spec_bench.sh 3 5 7
#   xz -dkf DIR/verify_probe.xz && LD_LIBRARY_PATH=/tmp/mlxrt-spec/mlx/lib \
#     DIR/verify_probe --model /tmp/spec-pair/draft --prompt 384 --rows 1,2,8 --modes off --forward-only
#   PYTHONPATH=/tmp/mlxrt-spec LD_LIBRARY_PATH=/tmp/mlxrt-spec/mlx/lib \
#     python3 crates/speculative/benches/cuda_attention_probe.py    # after gpu_spec_bench.sh
#   xz -dkf DIR/spec_trace.xz && LD_LIBRARY_PATH=/tmp/mlxrt-spec/mlx/lib \
#     DIR/spec_trace --model /tmp/spec-pair/target --draft /tmp/spec-pair/draft --depth 7 [--adaptive]
set -euo pipefail
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
NAME=${1:-.dev/spec}
. "$ROOT/scripts/gpu/stage_payload.sh"
stage_payload "$NAME"
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
  --python-version 312 -d "$S" mlx==0.32.2 mlx-lm==0.32.2
(cd "$ROOT" && cargo build --release -p mlx-models --example generate && cargo build --release -p mlx-models-bench --bin verify_probe --bin spec_trace)
strip -o "$S/generate" "$ROOT/target/release/examples/generate"
strip -o "$S/verify_probe" "$ROOT/target/release/verify_probe"
strip -o "$S/spec_trace" "$ROOT/target/release/spec_trace"
xz -T2 -6 -f "$S/generate" "$S/verify_probe" "$S/spec_trace"
du -sh "$S"
