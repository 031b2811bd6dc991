#!/usr/bin/env bash
# Before/after on the CPU: this tree's benches/cpu_bench.sh against the same script of another
# commit, alternating shape by shape (so both sides see the same machine state), then the change of
# each ratio (ours / mlx-lm) from BASE to this tree. Run it on a quiet machine.
#
#   BASE=9bfd085 RUNS=5 bash benches/ab_cpu.sh [SHAPES...]     # default: cpu_bench.sh's shapes
#
# BASE is checked out in a worktree ($WT, default /tmp/ab-base) and built there with its own target
# directory; logs and JSON go to $OUT/{head,base} (default target/ab-cpu).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE:?set BASE to the commit to compare with}
WT=${WT:-/tmp/ab-base}
OUT=${OUT:-$ROOT/target/ab-cpu}
export RUNS=${RUNS:-5}
SHAPES=("$@"); [ ${#SHAPES[@]} -gt 0 ] || SHAPES=(qwen3-small qwen3-small:paged qwen3_5-small qwen3_5-moe-small gemma4-small lfm2-small lfm2-moe-small qwen3-0.6b)
[ -d "$WT" ] || git -C "$ROOT" worktree add --detach "$WT" "$BASE" || exit 1
[ "$(git -C "$WT" rev-parse HEAD)" = "$(git -C "$ROOT" rev-parse "$BASE^{commit}")" ] || { echo "$WT is not at $BASE" >&2; exit 1; }
(cd "$WT" && CARGO_TARGET_DIR="$WT-target" cargo build --release -p mlx-models-bench) || exit 1
ln -sfn "$WT-target" "$WT/target"
(cd "$ROOT" && cargo build --release -p mlx-models-bench) || exit 1
for s in "${SHAPES[@]}"; do
  OUT=$OUT/head bash "$ROOT/benches/cpu_bench.sh" "$s"
  OUT=$OUT/base bash "$WT/benches/cpu_bench.sh" "$s"
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics as st, sys
out = sys.argv[1]
def ratio(f, i, key):
    d = json.load(open(f))
    return st.median(r[key] for r in d["ours"][i]) / st.median(r[key] for r in d["mlx_lm"][i])
print("| checkpoint | metric | ratio here | ratio at BASE | change |\n|---|---|---|---|---|")
for h in sorted(glob.glob(f"{out}/head/*.json")):
    b = h.replace("/head/", "/base/")
    if not os.path.exists(b):
        continue
    for i, (p, g) in enumerate(json.load(open(h))["requests"]):
        for key, lab in [("prefill_tps", f"prefill {p}")] + ([("decode_tps", "decode")] if g > 1 else []):
            rh, rb = ratio(h, i, key), ratio(b, i, key)
            print(f"| {os.path.basename(h)[:-5]} | {lab} | {rh:.2f} | {rb:.2f} | {100 * (rh / rb - 1):+.0f}% |")
PY
