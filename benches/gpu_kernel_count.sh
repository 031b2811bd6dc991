#!/usr/bin/env bash
# Kernels launched per decode token, by kernel name, ours (decode_profile) against mlx-lm
# (mlx_lm_decode_profile.py), on the device (the `run` tool, carry [".gpu-bench"]), after
# `NOBENCH=1 KEEP=1 bash benches/gpu_bench.sh SHAPE` (runtime unpacked, checkpoint kept):
#
#   bash benches/gpu_kernel_count.sh SHAPE
#
# Profiles with Nsight Compute at two generation lengths (G1, G2); the difference in
# each kernel's instance count divided by the extra tokens is its launches per decode token
# (prefill, warm-up and set-up cancel out).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G=${GPU_STAGE:-$ROOT/.gpu-bench}
R=${MLXRT:-/tmp/mlxrt-bench}
OUT=${OUT:-/tmp/gpu-out}
S=${1:?shape}
G1=${G1:-2} G2=${G2:-4}
D=$HOME/.cache/mlx-models/bench/$S-bf16
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib PYTHONPATH=$R
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/NVIDIA-Nsight-Compute*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 3; }
mkdir -p "$OUT"
# One CSV row per kernel launch (ncu replays each kernel once for its duration: slow, so the
# generation lengths are short).
for g in $G1 $G2; do
  "$NCU" --csv --metrics gpu__time_duration.sum "$G/decode_profile" --model "$D" --dtype bf16 --prompt 16 --gen $g --kv flat > "$OUT/ours-$g.csv" 2> /dev/null
  "$NCU" --csv --metrics gpu__time_duration.sum python3 "$ROOT/benches/mlx_lm_decode_profile.py" "$D" --prompt 16 --gen $g > "$OUT/mlxlm-$g.csv" 2> /dev/null
done
# decode_profile runs 3 rounds of two loops (pipelined, sync), mlx_lm_decode_profile.py 3 rounds.
python3 - "$OUT" "$G1" "$G2" <<'PY'
import csv, sys, collections
out, g1, g2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def counts(side, g):
    c = collections.Counter()
    lines = [l for l in open(f"{out}/{side}-{g}.csv", errors="replace") if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            c[r["Kernel Name"][:90]] += 1
    return c
tokens = {"ours": 6 * (g2 - g1), "mlxlm": 3 * (g2 - g1)}
per = {}
for side in ("ours", "mlxlm"):
    a, b = counts(side, g1), counts(side, g2)
    per[side] = {k: (b[k] - a[k]) / tokens[side] for k in set(a) | set(b)}
    print(f"{side}: {sum(per[side].values()):.1f} kernels per decode token ({sum(b.values())} launches at gen {g2})")
names = sorted(set(per["ours"]) | set(per["mlxlm"]), key=lambda k: -abs(per["ours"].get(k, 0) - per["mlxlm"].get(k, 0)))
print("per token: ours  mlx-lm  kernel")
for k in names[:40]:
    o, m = per["ours"].get(k, 0), per["mlxlm"].get(k, 0)
    if abs(o - m) >= 0.5 or o + m >= 20:
        print(f"{o:9.1f} {m:7.1f}  {k}")
PY
