#!/usr/bin/env bash
# Create the mlx-lm venv for llm_bench's other side, outside the repo:
#   bash benches/setup_mlx_lm.sh [VENV]        # default /tmp/mlxlm (reused if it already works)
# then llm_bench finds /tmp/mlxlm/bin/python itself (or pass --python VENV/bin/python).
# mlx-lm 0.32.2 with the CPU build of MLX 0.32.2 (the libmlx our mlx-sys links); mlx 0.32.4 as a
# fallback if 0.32.2 does not resolve. The PyPI mlx-cpu wheel bundles reference BLAS: llm_bench
# LD_PRELOADs the system OpenBLAS into the child (apt-get install libopenblas0-pthread).
set -euo pipefail
V=${1:-/tmp/mlxlm}
check() { "$V/bin/python" -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__)' 2>/dev/null; }
if [ -x "$V/bin/python" ] && check; then echo "reusing $V"; exit 0; fi
python3 -m venv "$V"
"$V/bin/python" -m pip install -q --upgrade pip
"$V/bin/python" -m pip install -q mlx-lm==0.32.2 'mlx[cpu]==0.32.2' ||
  "$V/bin/python" -m pip install -q mlx-lm==0.32.2 'mlx[cpu]==0.32.4'
check
[ -e /usr/lib/x86_64-linux-gnu/libopenblas.so.0 ] || echo "note: no system OpenBLAS; mlx-lm f32 will use the wheel's reference BLAS (~15x slower)" >&2
