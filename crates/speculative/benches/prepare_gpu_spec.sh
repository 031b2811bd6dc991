#!/usr/bin/env bash
# Stage the GPU speculative benchmark for the device machine (the `run` tool, carry [".dev/spec"]):
#
#   bash crates/speculative/benches/prepare_gpu_spec.sh [DIR]    # under the repository root; default .dev/spec
#
# DIR gets the CUDA libmlx payload (scripts/gpu/stage_payload.sh: the mlx-cuda-13 wheel's libmlx
# trimmed to sm_90), the mlx 0.32.2 cp312 and mlx-lm 0.32.2 wheels, the release `generate`
# example, the speculative identity tests (`identity`, run first by gpu_spec_bench.sh) and the
# benches named in PROBES (`PROBES="spec_trace"` for TRACE=1, `verify_probe` for GROWTH=1 or
# CHECKS=1; one of them fits what a call carries, one next to the mlx-lm wheels with IDENTITY=0,
# both only with MLX_LM=0, which leaves the
# wheels and mlx-lm's run out; MLX_LM=core stages only mlx.core, without mlx-lm), stripped and xz'd (built here against the CPU libmlx;
# they run with the CUDA one swapped in). Nothing staged is committed. Then on the device:
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
rm -f "$S"/*.whl
# MLX_LM=0: no wheels; MLX_LM=core: only mlx.core (mlx-core.tar.xz: the wheel's top-level files,
# for scripts/gpu/qmm_probe.py under CHECKS=1; no mlx-lm run)
rm -f "$S/mlx-core.tar.xz"
case "${MLX_LM:-1}" in 0) wheels=() ;; core) wheels=(mlx==0.32.2) ;; *) wheels=(mlx==0.32.2 mlx-lm==0.32.2) ;; esac
[ ${#wheels[@]} = 0 ] || python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
  --python-version 312 -d "$S" "${wheels[@]}"
if [ "${MLX_LM:-1}" = core ]; then
  t=$(mktemp -d)
  python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("mlx/") and n.count("/") == 1])' "$S"/mlx-0.32.2-*.whl "$t" || exit 1
  tar -C "$t" -cJf "$S/mlx-core.tar.xz.part" mlx && mv "$S/mlx-core.tar.xz.part" "$S/mlx-core.tar.xz" || exit 1
  rm -rf "$t" "$S"/*.whl
fi
PROBES=${PROBES:-}   # e.g. "spec_trace verify_probe": benches staged next to generate
(cd "$ROOT" && cargo build --release -p mlx-models --example generate) || exit 1
strip -o "$S/generate" "$ROOT/target/release/examples/generate"
rm -f "$S"/verify_probe.xz "$S"/spec_trace.xz
for b in $PROBES; do
  (cd "$ROOT" && cargo build --release -p mlx-models-bench --bin "$b") || exit 1
  strip -o "$S/$b" "$ROOT/target/release/$b"
done
xz -T2 -6 -f "$S/generate" $(for b in $PROBES; do echo "$S/$b"; done)
# the speculative identity tests (tiny checkpoints of the repository: stage_tests.sh records their
# path); IDENTITY=0 leaves them out (room for PROBES next to the mlx-lm wheels)
rm -f "$S/identity.xz"
[ "${IDENTITY:-1}" = 0 ] || (cd "$ROOT" && STAGE=$NAME PKG=mlx-speculative bash scripts/gpu/stage_tests.sh identity > /dev/null) || exit 1
# a `run` call carries the working tree and this folder: 64 MiB in all
# (counted as a tar archive: each file rounded up to 512 bytes plus a 512-byte header; a call
# with 66.66 MB of plain sizes, 67.27 so counted, was refused, one with 67.08 so counted went)
tarred() { python3 -c 'import os, sys; print(sum(512 + -(-os.path.getsize(f) // 512) * 512 for f in sys.stdin.read().split("\0") if f))'; }
tree=$(cd "$ROOT" && git ls-files -z | tarred)
staged=$(find "$S" -type f -print0 | tarred)
echo "$S: $staged bytes; with the tracked tree $((tree + staged)) of 67108864"
[ $((tree + staged)) -le 67108864 ] || { echo "over the 64 MiB a call carries: stage fewer PROBES" >&2; exit 1; }
