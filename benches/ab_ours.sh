#!/usr/bin/env bash
# Before/after on the CPU, our side only: this tree's llm_bench against BASE's, alternating run by
# run (HEAD, BASE, HEAD, BASE, ...) on the same random checkpoints, so drift of the machine between
# runs falls on both sides alike; then, per shape and metric, the median of HEAD / BASE over the
# pairs of runs next to each other. Compare ab_cpu.sh, whose ratios of ratios against mlx-lm also
# carry mlx-lm's own run-to-run swings. Run it on a quiet machine.
#
#   BASE=9bfd085 PAIRS=7 bash benches/ab_ours.sh [SHAPES...]   # default: cpu_bench.sh's shapes
#
# BASE is checked out and built as ab_cpu.sh does ($WT, default /tmp/ab-base); JSON of every run
# goes to $OUT/{head,base} (default target/ab-ours).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE:?set BASE to the commit to compare with}
WT=${WT:-/tmp/ab-base}
OUT=${OUT:-$ROOT/target/ab-ours}
PAIRS=${PAIRS:-7}
C=$HOME/.cache/mlx-models/bench
SHAPES=("$@"); [ ${#SHAPES[@]} -gt 0 ] || SHAPES=(qwen3-small qwen3-small:paged qwen3_5-small qwen3_5-moe-small gemma4-small lfm2-small lfm2-moe-small qwen3-0.6b)
[ -d "$WT" ] || git -C "$ROOT" worktree add --detach "$WT" "$BASE" || exit 1
[ "$(git -C "$WT" rev-parse HEAD)" = "$(git -C "$ROOT" rev-parse "$BASE^{commit}")" ] || { echo "$WT is not at $BASE" >&2; exit 1; }
(cd "$WT" && CARGO_TARGET_DIR="$WT-target" cargo build --release -p mlx-models-bench) || exit 1
(cd "$ROOT" && cargo build --release -p mlx-models-bench) || exit 1
mkdir -p "$OUT/head" "$OUT/base"
for s in "${SHAPES[@]}"; do
  name=${s%%:*}; kv=flat; [ "$s" = "${s#*:}" ] || kv=${s#*:}
  case $name in
    gemma4-*) prompts=640,1024 ;;
    qwen3-0.6b) prompts=128 ;;
    *) prompts=128,512 ;;
  esac
  gen=64; [ "$name" = qwen3-0.6b ] && gen=32
  [ -d "$C/$name-f32" ] || "$ROOT/target/release/llm_bench" --create-random "$name" --dtype f32 >/dev/null || exit 1
  echo "== $s (kv $kv, prompts $prompts, gen $gen, $PAIRS pairs) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  for i in $(seq "$PAIRS"); do
    for side in head base; do
      b=$ROOT/target/release/llm_bench; [ $side = base ] && b=$WT-target/release/llm_bench
      env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$b" --model "$C/$name-f32" --dtype f32 --kv "$kv" --runs 1 \
        --gen "$gen" --prompts "$prompts" --no-mlx-lm --json "$OUT/$side/$name-$kv-$i.json" >/dev/null 2>&1 || { echo "$side run $i of $s failed" >&2; exit 1; }
    done
  done
done
python3 - "$OUT" "$PAIRS" "${SHAPES[@]}" <<'PY'
import json, statistics as st, sys
out, pairs, shapes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| checkpoint | metric | HEAD (median) | BASE (median) | HEAD / BASE, median of pairs (min-max) |")
print("|---|---|---|---|---|")
for s in shapes:
    name, kv = (s.split(":") + ["flat"])[:2]
    runs = {side: [json.load(open(f"{out}/{side}/{name}-{kv}-{i}.json")) for i in range(1, pairs + 1)] for side in ("head", "base")}
    reqs = runs["head"][0]["requests"]
    for ri, (prompt, gen) in enumerate(reqs):
        for key, label in (("prefill_tps", f"prefill {prompt}"), ("decode_tps", "decode")):
            if key == "decode_tps" and gen <= 1:
                continue
            h = [r["ours"][ri][0][key] for r in runs["head"]]
            b = [r["ours"][ri][0][key] for r in runs["base"]]
            q = [x / y for x, y in zip(h, b)]
            print(f"| {name}-{kv} | {label} | {st.median(h):.1f} | {st.median(b):.1f} | {st.median(q):.3f} ({min(q):.2f}-{max(q):.2f}) |")
PY
