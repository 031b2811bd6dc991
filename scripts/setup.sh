#!/usr/bin/env bash
# One-time machine set-up, safe to re-run (the README's two commands call it).
# Building needs only a C++ compiler, python3 with pip (to fetch the MLX wheel) and cargo.
# On Debian/Ubuntu as root it also installs OpenBLAS, which makes f32 matmul on MLX-CPU 12-19x
# faster than the reference BLAS bundled in the wheel (mlx-sys's build script picks it up).
set -euo pipefail
need() { command -v "$1" >/dev/null 2>&1; }
if [ "$(uname -s)" = Linux ]; then
  missing=()
  [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || missing+=(libopenblas0-pthread)
  need g++ || missing+=(g++)
  need python3 || missing+=(python3 python3-pip)
  if [ ${#missing[@]} -gt 0 ]; then
    if need apt-get && [ "$(id -u)" = 0 ]; then
      echo "setup: installing ${missing[*]}" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      echo "setup: please install ${missing[*]} (continuing; OpenBLAS is optional)" >&2
    fi
  fi
fi
python3 -m pip --version >/dev/null 2>&1 || { echo "setup: python3 -m pip is required to fetch the MLX wheel (or set MLX_DIR)" >&2; exit 1; }
need cargo || { echo "setup: cargo (rustup) is required" >&2; exit 1; }
