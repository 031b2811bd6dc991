#!/usr/bin/env bash
# On the H200 (the `run` tool, carry [".gpu-tests"], from the repository root): unpack the CUDA
# libmlx staged by scripts/gpu/stage_tests.sh and run each staged test binary against it.
#   bash scripts/gpu/run_tests.sh [-- TEST-ARGS...]   # e.g. -- --test-threads 2
#   MLX_ENABLE_TF32=0 MLX_MODELS_TEST_DTYPE=f32 bash scripts/gpu/run_tests.sh -- matches_transformers last_position match_reference matches_reference
#       # the reference parity checks in f32, TF32 off (the GPU default, the fixtures' bf16,
#       # rounds 0.1-0.8 relative away from the f32 references, on the CPU too; TF32 matmuls
#       # 1e-3 to 0.5). match_reference, matches_reference: Harrier and generate.rs's greedy checks.
set -uo pipefail
G=${GPU_STAGE:-.gpu-tests}   # GPU_STAGE=.gpu-bench: binaries staged next to the benchmark
R=${MLXRT:-/tmp/mlxrt-tests}
. scripts/gpu/unpack_payload.sh
unpack_payload "$G" "$R" || exit 3
# The binaries look for fixtures under the path they were built in (CARGO_MANIFEST_DIR).
ROOT=$(cat "$G/manifest_dir_root")
if [ ! -e "$ROOT/crates" ]; then mkdir -p "$(dirname "$ROOT")" && ln -sfn "$PWD" "$ROOT"; fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib
[ "${1:-}" = "--" ] && shift
rc=0
for x in "$G"/*.xz; do
  case $x in */libmlx.so.xz|*/include.tar.xz|*/cudalibs.tar.xz) continue ;; esac
  t=$(basename "$x" .xz)
  xz -dc "$x" > "/tmp/$t" && chmod +x "/tmp/$t"
  echo "== $t"
  "/tmp/$t" "$@" > "/tmp/$t.log" 2>&1
  st=$?
  grep -E "^test |test result|panicked|assertion|left:|right:" "/tmp/$t.log"
  [ "$st" = 0 ] || rc=1
done
exit $rc
