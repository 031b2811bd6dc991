#!/usr/bin/env bash
# Device side of the H200 run: unpack the sm_90 CUDA libmlx staged by prepare.sh, wire it to the
# CUDA libraries of the machine's Python venv, and run the staged binaries with it.
#
#   bash scripts/gpu/run.sh                 # runs .gpu/gpu_check
#   bash scripts/gpu/run.sh -- ARGS...      # passes ARGS to gpu_check
#   MLX_GPU_RUN="cmd ..." bash scripts/gpu/run.sh   # run another command in the same environment
#
# Logs go to $OUT (the run tool's return folder; /tmp/gpu-out when unset): env.log, gpu_check.log.
# Exit status: gpu_check's (non-zero when any check failed or the runtime did not load).
#
# Layout made under $MLXRT (default /tmp/mlxrt), mirroring the wheel, because libmlx.so finds
#   - its CUDA libs through its RPATH $ORIGIN/../../nvidia/{cu13,cudnn,nccl,...}/lib
#     -> $MLXRT/nvidia, a symlink to the venv's site-packages/nvidia (cu13 = cublas, cufft,
#        cusolver, nvrtc, cudart; cudnn; nccl: all on the GPU image);
#   - its BLAS/LAPACK through $ORIGIN/../../mlx_cuda_13.libs;
#   - the CCCL headers for NVRTC at <libdir>/../include/cccl (without them every JIT kernel
#     fails: "cannot open source file cuda/std/tuple").
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
G=${GPU_STAGE:-$ROOT/.gpu}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt}
mkdir -p "$OUT" "$R/mlx/lib"
ARGS=()
if [ "${1:-}" = "--" ]; then shift; ARGS=("$@"); fi

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  head -2 /etc/os-release; ldd --version | head -1; nproc
  cat "$G/RUNTIME" 2>/dev/null
} 2>&1 | tee "$OUT/env.log"

SP=${NVIDIA_SITE:-$(python3 -c "import site; print(site.getsitepackages()[0])" 2>/dev/null)}
if [ ! -d "$SP/nvidia/cu13/lib" ]; then
  for d in /opt/torch/.venv/lib/python3*/site-packages; do [ -d "$d/nvidia/cu13/lib" ] && SP=$d; done
fi
[ -d "$SP/nvidia/cu13/lib" ] || { echo "no nvidia/cu13 in the python venv ($SP)" | tee -a "$OUT/env.log"; exit 3; }
echo "venv site-packages: $SP" | tee -a "$OUT/env.log"

t0=$(date +%s%N)
if command -v xz >/dev/null; then
  xz -dc "$G/libmlx.so.xz" > "$R/mlx/lib/libmlx.so"
else
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$G/libmlx.so.xz" "$R/mlx/lib/libmlx.so"
fi || { echo "unpacking libmlx failed" | tee -a "$OUT/env.log"; exit 3; }
for t in include cudalibs; do
  tar -C "$R" -xJf "$G/$t.tar.xz" 2>/dev/null ||
    python3 -c 'import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$G/$t.tar.xz" "$R" ||
    { echo "unpacking $t failed" | tee -a "$OUT/env.log"; exit 3; }
done
ln -sfn "$SP/nvidia" "$R/nvidia"
echo "unpacked in $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a "$OUT/env.log"

export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# MLX compiles many CUDA kernels with NVRTC on first use (10-35 s each for the gather/scatter and
# half-precision attention kernels on the H200) and caches them in MLX_PTX_CACHE_DIR. A fresh
# device machine starts with none: carry .gpu/ptx-cache.tar.xz (the $OUT/ptx-cache.tar.xz that
# an earlier run returned) to start warm.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ -f "$G/ptx-cache.tar.xz" ]; then
  tar -C "$MLX_PTX_CACHE_DIR" -xJf "$G/ptx-cache.tar.xz" && echo "PTX cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) entries carried in" | tee -a "$OUT/env.log"
fi
save_ptx_cache() {
  [ -n "$(ls -A "$MLX_PTX_CACHE_DIR" 2>/dev/null)" ] || return 0
  tar -C "$MLX_PTX_CACHE_DIR" -cf - . | xz -T0 -6 > "$OUT/ptx-cache.tar.xz"
  echo "PTX cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) entries, $(du -sh "$MLX_PTX_CACHE_DIR" | cut -f1) -> $OUT/ptx-cache.tar.xz $(du -h "$OUT/ptx-cache.tar.xz" | cut -f1)" | tee -a "$OUT/env.log"
}
trap save_ptx_cache EXIT
trap "exit 143" TERM INT
export LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  echo "== libmlx.so dependencies"
  ldd "$R/mlx/lib/libmlx.so" | grep -E 'not found|cudnn|nccl|cublas|nvrtc|cufft|cusolver|libcuda|blas|lapack'
  echo "== gpu_check resolves libmlx to:"
  ldd "$G/gpu_check" | grep -E 'libmlx|not found'
} 2>&1 | tee -a "$OUT/env.log"
if ldd "$R/mlx/lib/libmlx.so" "$G/gpu_check" | grep -q 'not found'; then
  echo "missing libraries (above)" | tee -a "$OUT/env.log"; exit 3
fi

if [ -n "${MLX_GPU_RUN:-}" ]; then
  bash -c "$MLX_GPU_RUN" 2>&1 | tee "$OUT/custom.log"
  exit "${PIPESTATUS[0]}"
fi
# gpu_check exits 0 (all passed), 1 (a check failed) or 2 (usage). Anything else means the
# process died inside MLX (an abort, a signal): resume after the check it had started, so one
# crash costs one check and not the rest of the run (one device call is all we get).
LOG=$OUT/gpu_check.log
: > "$LOG"
# GPU clocks / power / load once a second while the checks and the matmuls run.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
SMI=$!
RESUME=()
rc=0
crashed=0
for attempt in 1 2 3 4 5; do
  echo "== gpu_check ${ARGS[*]:-} ${RESUME[*]:-} (attempt $attempt)" | tee -a "$LOG"
  "$G/gpu_check" "${ARGS[@]}" "${RESUME[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "gpu_check exit status $rc" | tee -a "$LOG"
  case $rc in 0|1|2) break ;; esac
  last=$(grep '^START ' "$LOG" | tail -1 | cut -c7-)
  [ -n "$last" ] || break
  echo "CRASH       $last (exit status $rc): resuming after it" | tee -a "$LOG"
  RESUME=(--skip-through "$last")
  crashed=1
done
[ "$crashed" = 1 ] && [ "$rc" = 0 ] && rc=1
kill "$SMI" 2>/dev/null
grep -E '^(CRASH|FAIL|UNSUPPORTED)' "$LOG" > "$OUT/failures.log"
exit "$rc"
