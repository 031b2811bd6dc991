#!/usr/bin/env bash
# Prepare a run of the mlx-array GPU checks on an NVIDIA H200 (or H100: any sm_90 GPU).
#
#   scripts/gpu/prepare.sh            # fetch + trim the CUDA libmlx, build gpu_check, stage .gpu/
#   scripts/gpu/prepare.sh --no-build # stage the runtime only (reuse .gpu/gpu_check)
#   scripts/gpu/prepare.sh --payload  # only make (or refresh) the cached payload of steps 1-2
#                                     # (scripts/gpu/stage_payload.sh copies it from there)
#
# What it does (see ../../README or shared notes "CUDA wheels" for the why):
#  1. downloads the PyPI wheel mlx-cuda-13==$MLX_VERSION with pip into a cache outside the repo
#     ($MLX_CUDA_CACHE, default ~/.cache/mlx-sys/mlx-cuda-13-$MLX_VERSION) and unpacks it there;
#  2. fixes the epilogue race of libmlx's JIT-compiled qmm_sm80 kernel (patch_libmlx.py: the
#     embedded source gains `cp_async_wait<0>(); __syncthreads();` before the epilogue), then
#     trims libmlx.so's CUDA fat binaries to sm_$SM SASS (fatbin_keep.py; 62 MiB of kernels for
#     7 targets -> 8.5 MiB for one) and xz-compresses it (~14 MiB), and packs mlx/include (the
#     CCCL/CUTLASS headers NVRTC needs for MLX's JIT kernels), mlx_cuda_13.libs (bundled
#     BLAS/LAPACK/gfortran) and the crt/ headers of the PyPI package nvidia-cuda-crt (mma.h's,
#     missing from the GPU image) as tar.xz: the device machine takes at most 64 MiB of files per call;
#  3. builds `cargo build --release -p mlx-array --example gpu_check` here, against the CPU libmlx
#     of mlx-sys (the same C++ API: the binary runs with the CUDA libmlx.so swapped in through
#     LD_LIBRARY_PATH), and copies it stripped into .gpu/;
#  4. stages everything in .gpu/ (git-ignored through .git/info/exclude, never committed).
#
# Then on the device machine (the `run` tool, carry [".gpu"]): bash scripts/gpu/run.sh
# Nothing here is committed: the wheel's files are third-party binaries.
set -euo pipefail

MLX_VERSION=${MLX_VERSION:-0.32.2}
SM=${SM:-90}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
CACHE=${MLX_CUDA_CACHE:-$HOME/.cache/mlx-sys/mlx-cuda-13-$MLX_VERSION}
STAGE=$ROOT/.gpu
BUILD=1
PAYLOAD_ONLY=0
for a in "$@"; do
  case $a in
    --no-build) BUILD=0 ;;
    --payload) PAYLOAD_ONLY=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $a" >&2; exit 2 ;;
  esac
done
mib() { echo "$(( ($(stat -c %s "$1") + 524287) / 1048576 )) MiB"; }

# 0. keep .gpu/ out of git (info/exclude, not .gitignore: it is a local staging folder)
EXCL=$(git -C "$ROOT" rev-parse --git-path info/exclude)
case $EXCL in /*) ;; *) EXCL=$ROOT/$EXCL ;; esac
mkdir -p "$(dirname "$EXCL")"
grep -qxF '/.gpu/' "$EXCL" 2>/dev/null || echo '/.gpu/' >> "$EXCL"

# 1. the wheel, unpacked once into the cache
W=$CACHE/wheel
if [ ! -f "$W/mlx/lib/libmlx.so" ]; then
  echo "== downloading mlx-cuda-13==$MLX_VERSION into $CACHE"
  mkdir -p "$CACHE"
  TMP=$(mktemp -d "$CACHE/tmp.XXXXXX")
  # --platform: the wheel is manylinux_2_35; name it so pip fetches it on an older glibc too
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
    -d "$TMP" "mlx-cuda-13==$MLX_VERSION"
  python3 -m zipfile -e "$TMP"/mlx_cuda_13-*.whl "$TMP/wheel"
  rm -f "$TMP"/mlx_cuda_13-*.whl
  rm -rf "$W"; mv "$TMP/wheel" "$W"; rmdir "$TMP"
fi
[ -d "$W/mlx_cuda_13.libs" ] && [ -d "$W/mlx/include/cccl" ] || { echo "unexpected wheel layout in $W" >&2; exit 1; }

# 2. patched, trimmed + compressed payload, cached (redone when patch_libmlx.py or
#    fatbin_keep.py changes): patch_libmlx.py fixes the epilogue race of the JIT-compiled
#    qmm_sm80 kernel (quantized products of 8 or more bf16/f16 rows)
P=$CACHE/payload-sm$SM
if [ ! -f "$P/libmlx.so.xz" ] || [ "$HERE/fatbin_keep.py" -nt "$P/libmlx.so.xz" ] || [ "$HERE/patch_libmlx.py" -nt "$P/libmlx.so.xz" ]; then
  echo "== patching libmlx.so, trimming it to sm_$SM and compressing (xz -9, a minute or two)"
  mkdir -p "$P"
  python3 "$HERE/patch_libmlx.py" "$W/mlx/lib/libmlx.so" "$P/libmlx.patched.so"
  python3 "$HERE/fatbin_keep.py" "$P/libmlx.patched.so" "$P/libmlx.so" "$SM"
  rm -f "$P/libmlx.patched.so"
  xz -9 -T2 -c "$P/libmlx.so" > "$P/libmlx.so.xz.tmp" && mv "$P/libmlx.so.xz.tmp" "$P/libmlx.so.xz"
  rm -f "$P/libmlx.so"
  tar -C "$W" -cJf "$P/include.tar.xz" mlx/include
  tar -C "$W" -cJf "$P/cudalibs.tar.xz" mlx_cuda_13.libs
  (cd "$W/mlx/lib" && sha256sum libmlx.so) > "$P/libmlx.so.orig.sha256"
fi

# the CUDA crt/ headers (nvidia-cuda-crt, not in the GPU image's venv), which NVRTC needs for
# MLX's kernels that include mma.h
if [ ! -f "$P/crt.tar.xz" ]; then
  TMP=$(mktemp -d "$CACHE/tmp.XXXXXX")
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$TMP" "nvidia-cuda-crt==13.0.*"
  python3 -m zipfile -e "$TMP"/nvidia_cuda_crt-*.whl "$TMP/crt"
  tar -C "$TMP/crt" -cJf "$TMP/crt.tar.xz" nvidia/cu13/include/crt
  mv "$TMP/crt.tar.xz" "$P/crt.tar.xz"
  rm -rf "$TMP"
fi
[ "$PAYLOAD_ONLY" = 0 ] || exit 0

mkdir -p "$STAGE"
for f in libmlx.so.xz include.tar.xz cudalibs.tar.xz crt.tar.xz; do cp -f "$P/$f" "$STAGE/$f"; done
echo "sm_$SM mlx-cuda-13==$MLX_VERSION" > "$STAGE/RUNTIME"

# 3. the test binary, built here against the CPU libmlx (GPU_CHECK_BIN=path: use that build)
if [ -n "${GPU_CHECK_BIN:-}" ]; then
  cp -f "$GPU_CHECK_BIN" "$STAGE/gpu_check"
  strip --strip-unneeded "$STAGE/gpu_check"
elif [ "$BUILD" = 1 ]; then
  echo "== cargo build --release -p mlx-array --example gpu_check"
  EXE=$(cd "$ROOT" && cargo build --release -p mlx-array --example gpu_check --message-format=json-render-diagnostics \
        | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_check" and m.get("executable"):
        print(m["executable"])')
  [ -n "$EXE" ] || { echo "no gpu_check executable from cargo" >&2; exit 1; }
  cp -f "$EXE" "$STAGE/gpu_check"
  strip --strip-unneeded "$STAGE/gpu_check"
fi
[ -x "$STAGE/gpu_check" ] || { echo "$STAGE/gpu_check is missing: run without --no-build" >&2; exit 1; }

# 4. what will travel
echo "== staged in $STAGE:"
total=0
for f in "$STAGE"/*; do
  printf '  %-18s %s\n' "$(basename "$f")" "$(mib "$f")"
  total=$(( total + $(stat -c %s "$f") ))
done
echo "  total              $(( (total + 524287) / 1048576 )) MiB (the device takes 64 MiB per call, working tree included)"
[ "$total" -lt $(( 56 * 1048576 )) ] || { echo "too big to carry" >&2; exit 1; }
echo "next: run tool with carry [\".gpu\"], command: bash scripts/gpu/run.sh"
