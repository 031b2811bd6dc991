#!/usr/bin/env bash
# Stage the device side of the serving benchmark in $STAGE (default .gpu-serve/ at the repository
# root, git-ignored via .git/info/exclude): mlx-serve (release, stripped, xz), serve_bench.py,
# word_tokenizer.py and gpu_serve_bench.sh. Needs benches/prepare_gpu.sh's .gpu-bench/ as well.
#   MLX_SERVE_BIN=path   use that mlx-serve build instead of building
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
S=${STAGE:-$ROOT/.gpu-serve}
if [ "$(dirname "$S")" = "$ROOT" ]; then   # a top-level stage: keep it out of git
  excl=$(git -C "$ROOT" rev-parse --git-path info/exclude); case $excl in /*) ;; *) excl=$ROOT/$excl ;; esac
  n=/$(basename "$S")/; grep -qxF "$n" "$excl" || echo "$n" >> "$excl"
fi
BIN=${MLX_SERVE_BIN:-}
if [ -z "$BIN" ]; then
  (cd "$ROOT" && cargo build --release -p mlx-server)
  BIN=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/mlx-serve
fi
mkdir -p "$S"
cp -f "$BIN" "$S/mlx-serve" && strip --strip-unneeded "$S/mlx-serve" && xz -T2 -6 -f "$S/mlx-serve"
cp -f "$ROOT"/benches/{serve_bench.py,word_tokenizer.py,gpu_serve_bench.sh} "$S/"
du -ch "$S"/* | tail -1
