#!/usr/bin/env bash
# The server checked with the official `openai` Python client (issue 23's client checks):
#   scripts/check_server_openai.sh [MODEL_DIR] [EMBED_MODEL_DIR]
# Defaults: the tiny Qwen3 and Harrier fixtures. Makes a venv with `openai` at $OPENAI_VENV
# (default /tmp/openai-venv; reused), builds mlx-serve (release) unless $MLX_SERVE names a binary,
# and runs scripts/check_server_openai.py with each engine, batch then sequential (extra arguments after the two directories go to it,
# e.g. --concurrency 32 --max-tokens 16).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-crates/models/tests/fixtures/tiny/qwen3}
EMBED=${2:-crates/models/tests/fixtures/tiny/qwen3_embed}
shift $(( $# > 2 ? 2 : $# ))
V=${OPENAI_VENV:-/tmp/openai-venv}
if ! { [ -x "$V/bin/python" ] && "$V/bin/python" -c 'import openai' 2>/dev/null; }; then
  python3 -m venv "$V"
  "$V/bin/python" -m pip install -q openai
fi
BIN=${MLX_SERVE:-}
if [ -z "$BIN" ]; then
  cargo build --release -p mlx-server
  BIN="${CARGO_TARGET_DIR:-target}/release/mlx-serve"
fi
"$V/bin/python" scripts/check_server_openai.py --bin "$BIN" --model "$MODEL" --embed-model "$EMBED" --engine batch "$@"
"$V/bin/python" scripts/check_server_openai.py --bin "$BIN" --model "$MODEL" --embed-model "$EMBED" --engine sequential "$@"
