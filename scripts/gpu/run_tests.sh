#!/usr/bin/env bash
# On the H200 (the `run` tool, carry [".gpu-tests"], from the repository root): unpack the CUDA
# libmlx staged by scripts/gpu/stage_tests.sh and run each staged test binary against it.
#   bash scripts/gpu/run_tests.sh [-- TEST-ARGS...]   # e.g. -- --test-threads 2
set -uo pipefail
G=.gpu-tests
R=${MLXRT:-/tmp/mlxrt-tests}
mkdir -p "$R/mlx/lib"
xz -dc "$G/libmlx.so.xz" > "$R/mlx/lib/libmlx.so" || exit 3
for t in include cudalibs; do tar -C "$R" -xJf "$G/$t.tar.xz" || exit 3; done
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
[ -d "$SP/nvidia/cu13/lib" ] || for d in /opt/torch/.venv/lib/python3*/site-packages; do [ -d "$d/nvidia/cu13/lib" ] && SP=$d; done
ln -sfn "$SP/nvidia" "$R/nvidia"
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
