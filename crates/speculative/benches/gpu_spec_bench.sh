#!/usr/bin/env bash
# Device side of the GPU speculative benchmark (the `run` tool; STAGE holds the CUDA libmlx payload
# of scripts/gpu/stage_payload.sh, the mlx 0.32.2 cp312 and mlx-lm 0.32.2 wheels, and the
# `generate` example built here, stripped, as generate.xz, or with other builds in bins*.tar.xz):
#
#   STAGE=DIR [CHECKS=1] [PAIR=0] [TF32S="1 0"] [ROUNDS=N] [NEW=N] [ADAPTIVE=K] [USELESS=K] [ENVS="A=1 B=2,C=3"] [ALT=NAME.. [ALTROUNDS=N]] [BUCKET=N] [FEWROW=MODE] [AHEAD=N,..] [TRACE=1] [OVERLAP=S] [GROWTH=1] \
#     bash crates/speculative/benches/gpu_spec_bench.sh [K...]   # default K: 5 7
#
# ADAPTIVE=K adds adaptive depth up to K with the pair's draft; USELESS=K the same with the
# pair's useless draft (gpu_pair.py), which should settle on plain decoding.
#
# AHEAD=0,2,until-verified runs each fixed-depth line once per `--draft-ahead` value (default: the
# library's).
# TRACE=1 adds `spec_trace` at the largest K (two generations in one process after the warm-up,
# per AHEAD value; every cycle in OUT/trace_kK_AHEAD.log): the second generation has no first-use costs; with USELESS=K also the useless
# draft at adaptive depth, cycle by cycle, each generation after a plain one. GROWTH=1 adds `verify_probe
# --growth` on the target in fresh processes, without and with `--prewarm` (one-row steps across
# the flat K/V growth at 256 and 512 positions).
# SHIFT=N (with TRACE=1) adds `spec_trace --runs 3 --prompt-step N` at the largest K: each run
# after the first at history lengths no earlier run had (N past the first run's last position),
# so a later run's saving over the first is no cache of repeated shapes (OUT/trace_shift.log).
# OVERLAP=S adds `spec_trace --overlap S` at the largest K: the draft's proposals and the target's
# verify forward each alone, then side by side on threads of their own for S seconds, and the
# draft beside a device-heavy and a host-heavy load (OUT/overlap.log: which of the two makes
# them take turns).
# PLAINFIRST=1 (with TRACE=1) adds `spec_trace --plain` at the largest K: a plain generation
# before each speculative one in the process, so the first speculative generation follows a
# busy GPU and host (OUT/trace_plainfirst.log): what it still loses to the second is the
# speculative path's own first use.
#
# ENVS="A=1 B=2,C=3" runs plain decoding and each fixed-depth line again per entry, with that
# entry's variables (comma-separated) set for the process: libmlx's own knobs
# (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER, MLX_CUDA_GRAPH_CACHE_SIZE),
# read at its first use, or the CUDA driver's (CUDA_MODULE_LOADING=EAGER: every kernel loaded at
# start-up instead of at its first launch).
#
# ALT="NAME.." runs plain decoding and each fixed-depth line again with each NAME.xz staged next to
# `generate.xz` (another build of it: an A/B of two commits in one run).
#
# ALTROUNDS=N (with ALT) then runs N interleaved rounds of plain decoding, the largest K and (with
# ADAPTIVE=K) adaptive depth, for `generate` and each ALT build in turn, fresh processes each
# (an A/B of two builds across the spread between processes).
#
# WARMUPS="1 8" runs each fixed-depth line again per count with `--speculative-warm-up-cycles N`
# (the warm-up's cycles at the deepest depth, one after another; default the library's).
#
# BUCKET=N runs each fixed-depth line again with `--key-bucket N` (few-query attention's keys
# padded to a multiple of N: one shape of its products per N positions).
#
# CHECKS=1 then runs `verify_probe --compare` on the tiny quantized checkpoints (when
# PROBES=verify_probe was staged), and with the mlx wheel staged scripts/gpu/qmm_probe.py
# --race RACE (default 500, 0: not run; bitwise repeatability of the bf16 products libmlx's qmm_sm80 kernel
# computes) and --only QMM_ONLY (default dense; QMM_SECS seconds, default 150; 0: not run).
# PAIR=0 stops after the identity tests (and the checks): no pair, no benchmark.
#
# FEWROW=MODE (products, attention or on) runs each of our speculative lines again with
# `--cuda-few-row-kernels MODE` (verify steps' products and/or attention by the kernels of
# crates/mlx-sys/src/cudakern).
#
# run from the repository root (scripts/gpu/unpack_payload.sh); gpu_pair.py is read next to
# this script, so both may be staged together.
#
# First, when staged, the speculative identity tests (crates/speculative/tests/identity.rs, tiny
# checkpoints; with MLX_ENABLE_TF32 1 and 0, or the values in TF32S; IDENTITY_SECS each, default 450:
# a fresh H100 took 155 s, mostly building kernels; a warm one 12 s). Then makes the pair of benches/gpu_pair.py (Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, high
# agreement), then greedy decoding of NEW tokens (default 128) after a 32-id prompt: ours plain
# and speculative with K drafts a cycle (the generate example's --json line: decode tok/s,
# accepted_mean, acceptance by position), and mlx-lm's generate_step and
# speculative_generate_step (num_draft_tokens K) on the same checkpoints in the same run.
set -uo pipefail
ROOT=$(pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
G=${STAGE:?STAGE: the staged folder}
OUT=${OUT:-/tmp/gpu-out}
R=${MLXRT:-/tmp/mlxrt-spec}
NEW=${NEW:-128}
KS=("$@"); [ ${#KS[@]} -gt 0 ] || KS=(5 7)
# builds staged together in one archive (one xz stream with a large dictionary, so a second
# build of a binary adds little: `tar -cf - generate spec_trace old | xz -9e --lzma2=dict=128MiB`)
for t in "$G"/bins*.tar.xz; do [ ! -e "$t" ] || tar -C "$G" -xJf "$t" || exit 3; done
for x in TRACE:spec_trace OVERLAP:spec_trace GROWTH:verify_probe; do
  v=${x%%:*} b=${x#*:}
  [ -z "${!v:-}" ] || [ -f "$G/$b.xz" ] || [ -f "$G/$b" ] || { echo "$v=1 needs $b staged (MLX_LM=0 PROBES=$b prepare_gpu_spec.sh)" >&2; exit 2; }
done
mkdir -p "$OUT" "$R/mlx/lib"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.log"
. "$ROOT/scripts/gpu/unpack_payload.sh"
unpack_payload "$G" "$R" || exit 3
for w in "$G"/*.whl; do [ -e "$w" ] || continue; python3 -m zipfile -e "$w" "$R" || exit 3; done
[ ! -f "$G/mlx-core.tar.xz" ] || tar -C "$R" -xJf "$G/mlx-core.tar.xz" || exit 3
xz -dkf "$G/generate.xz" 2>/dev/null; chmod +x "$G/generate"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LD_LIBRARY_PATH=$R/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
if [ -f "$G/identity.xz" ]; then
  # the speculative identity tests on this GPU (the binary finds its fixtures under the path it
  # was built in), TF32 as libmlx defaults and off
  m=$(cat "$G/manifest_dir_root"); [ -e "$m/crates" ] || { mkdir -p "$(dirname "$m")" && ln -sfn "$ROOT" "$m"; }
  xz -dkf "$G/identity.xz" 2>/dev/null; chmod +x "$G/identity"
  for tf in ${TF32S:-1 0}; do
    MLX_ENABLE_TF32=$tf timeout "${IDENTITY_SECS:-450}" "$G/identity" --test-threads 1 --nocapture > "$OUT/identity_tf32_$tf.log" 2>&1
    echo "identity tests, MLX_ENABLE_TF32=$tf: exit $?"
    grep -E "^test |test result|panicked|left:|right:|pair\(s\) failed|^target " "$OUT/identity_tf32_$tf.log" | cut -c1-400
  done 2>&1 | tee "$OUT/identity.log"
fi
if [ -n "${CHECKS:-}" ]; then
  # where the quantized targets' verify steps go wrong on CUDA: an M-row forward against M
  # one-row forwards on the tiny quantized checkpoints, then MLX's quantized products of few
  # rows against its CPU ones (scripts/gpu/qmm_probe.py, with the staged mlx wheel)
  if [ -f "$G/verify_probe.xz" ]; then
    xz -dkf "$G/verify_probe.xz" 2>/dev/null; chmod +x "$G/verify_probe"
    for f in lfm2_moe_q4 gemma4_text_moe_q4 llama_q4 qwen3_untied_q8g32; do
      echo "== $f"
      timeout 120 "$G/verify_probe" --model "$ROOT/crates/models/tests/fixtures/tiny/$f" --dtype f32 --prompt 20 --rows 2,3,4,8 --modes off --compare 2>&1 | grep -E "compare|Error"
    done 2>&1 | tee "$OUT/compare.log"
  else
    echo "verify_probe not staged: no --compare"
  fi
  if [ -d "$R/mlx/core" ] || ls "$R"/mlx/core*.so > /dev/null 2>&1; then
    [ "${RACE:-500}" = 0 ] || PYTHONPATH=$R timeout 120 python3 "$ROOT/scripts/gpu/qmm_probe.py" --race "${RACE:-500}" 2>&1 | tee "$OUT/qmm_race.log"
    if [ "${QMM_SECS:-150}" != 0 ]; then
      PYTHONPATH=$R timeout "${QMM_SECS:-150}" python3 "$ROOT/scripts/gpu/qmm_probe.py" --repeats 3 --only "${QMM_ONLY:-dense}" > "$OUT/qmm_dense.log" 2>&1
      echo "qmm_probe --only ${QMM_ONLY:-dense}: exit $?, $(grep -c finite "$OUT/qmm_dense.log") cases"; grep -E "BAD|bad case|Error" "$OUT/qmm_dense.log" | head -30
    fi
  else
    echo "the mlx wheel is not staged (MLX_LM=0): no qmm_probe"
  fi
fi
[ "${PAIR:-1}" != 0 ] || exit 0
P=/tmp/spec-pair
t0=$(date +%s)
python3 "$HERE/gpu_pair.py" "$P" || exit 4
echo "pair made in $(( $(date +%s) - t0 )) s; $(du -sh $P/target | cut -f1) target" | tee -a "$OUT/env.log"
IDS=$(python3 -c "import random; random.seed(3); print(','.join(str(random.randrange(1000, 150000)) for _ in range(32)))")
run() { env ${VARS:-} "$G/${BIN:-generate}" --model "$P/target" --prompt-ids "$IDS" --max-new-tokens "$NEW" --temperature 0 --kv flat --json "$@" | tail -1; }
{
  echo "plain $(run)"
  for k in "${KS[@]}"; do
    for a in $(echo "${AHEAD:-}" | tr , " "); do echo "draft$k-ahead$a $(run --draft-model "$P/draft" --draft-tokens "$k" --draft-ahead "$a")"; done
    [ -n "${AHEAD:-}" ] || echo "draft$k $(run --draft-model "$P/draft" --draft-tokens "$k")"
    [ -z "${FEWROW:-}" ] || echo "draft$k+$FEWROW $(run --draft-model "$P/draft" --draft-tokens "$k" --cuda-few-row-kernels "$FEWROW")"
    [ -z "${BUCKET:-}" ] || echo "draft$k+bucket$BUCKET $(run --draft-model "$P/draft" --draft-tokens "$k" --key-bucket "$BUCKET")"
    for w in ${WARMUPS:-}; do echo "draft$k+warmup$w $(run --draft-model "$P/draft" --draft-tokens "$k" --speculative-warm-up-cycles "$w")"; done
  done
  # plain decoding and each fixed depth again, labelled [$1] (under the caller's VARS or BIN)
  variant() {
    echo "plain[$1] $(run)"
    for k in "${KS[@]}"; do echo "draft$k[$1] $(run --draft-model "$P/draft" --draft-tokens "$k")"; done
  }
  for e in ${ENVS:-}; do VARS=$(echo "$e" | tr , " ") variant "$e"; done
  for b in ${ALT:-}; do
    xz -dkf "$G/$b.xz" 2>/dev/null; chmod +x "$G/$b"
    BIN=$b variant "$b"
  done
  [ -z "${ADAPTIVE:-}" ] || echo "adaptive$ADAPTIVE $(run --draft-model "$P/draft" --draft-tokens "$ADAPTIVE" --draft-depth adaptive)"
  [ -z "${USELESS:-}" ] || echo "useless-adaptive$USELESS $(run --draft-model "$P/useless" --draft-tokens "$USELESS" --draft-depth adaptive)"
  echo "plain2 $(run)"
  # ROUNDS=N: N - 1 more rounds of the useless draft (or K = the largest, once per AHEAD value)
  # against plain decoding, fresh processes each, interleaved (the spread between processes)
  for r in $(seq 2 "${ROUNDS:-1}"); do
    if [ -n "${USELESS:-}" ]; then
      echo "round$r useless-adaptive$USELESS $(run --draft-model "$P/useless" --draft-tokens "$USELESS" --draft-depth adaptive)"
    else
      k=${KS[-1]}
      for a in $(echo "${AHEAD:-}" | tr , " "); do echo "round$r draft$k-ahead$a $(run --draft-model "$P/draft" --draft-tokens "$k" --draft-ahead "$a")"; done
      [ -n "${AHEAD:-}" ] || echo "round$r draft$k $(run --draft-model "$P/draft" --draft-tokens "$k")"
    fi
    echo "round$r plain $(run)"
  done
  for r in $(seq 1 "${ALTROUNDS:-0}"); do
    for b in generate ${ALT:-}; do
      echo "alt-round$r plain[$b] $(BIN=$b run)"
      echo "alt-round$r draft${KS[-1]}[$b] $(BIN=$b run --draft-model "$P/draft" --draft-tokens "${KS[-1]}")"
      [ -z "${ADAPTIVE:-}" ] || echo "alt-round$r adaptive$ADAPTIVE[$b] $(BIN=$b run --draft-model "$P/draft" --draft-tokens "$ADAPTIVE" --draft-depth adaptive)"
    done
  done
} 2>&1 | tee "$OUT/ours.log"
if [ -n "${TRACE:-}" ]; then
  xz -dkf "$G/spec_trace.xz" 2>/dev/null; chmod +x "$G/spec_trace"
  for a in $(echo "${AHEAD:-default}" | tr , " "); do
    [ "$a" = default ] && set -- || set -- --draft-ahead "$a"
    # every cycle of both generations in trace_k${KS[-1]}_$a.log (where the first one's extra time goes)
    "$G/spec_trace" --model "$P/target" --draft "$P/draft" --depth "${KS[-1]}" --new "$NEW" --runs 2 --prompt 32 --warm-up "$@" > "$OUT/trace_k${KS[-1]}_$a.log" 2>&1
    echo "spec_trace K=${KS[-1]} ahead=$a: $(grep '^run' "$OUT/trace_k${KS[-1]}_$a.log" | tr '\n' ' ')"
    [ -z "${BUCKET:-}" ] || echo "spec_trace K=${KS[-1]} ahead=$a bucket=$BUCKET: $("$G/spec_trace" --model "$P/target" --draft "$P/draft" --depth "${KS[-1]}" --new "$NEW" --runs 2 --prompt 32 --warm-up --quiet --key-bucket "$BUCKET" "$@" | grep '^run' | tr '\n' ' ')"
  done 2>&1 | tee "$OUT/trace.log"
  if [ -n "${PLAINFIRST:-}" ]; then
    "$G/spec_trace" --model "$P/target" --draft "$P/draft" --depth "${KS[-1]}" --new "$NEW" --runs 2 --prompt 32 --warm-up --plain > "$OUT/trace_plainfirst.log" 2>&1
    echo "spec_trace K=${KS[-1]} --plain: $(grep -E '^(plain run|run [0-9]+ against|run [0-9]+ speculative cycle)' "$OUT/trace_plainfirst.log" | tr '\n' ' ')"
  fi 2>&1 | tee -a "$OUT/trace.log"
  if [ -n "${SHIFT:-}" ]; then
    "$G/spec_trace" --model "$P/target" --draft "$P/draft" --depth "${KS[-1]}" --new "$NEW" --runs 3 --prompt 32 --prompt-step "$SHIFT" --warm-up > "$OUT/trace_shift.log" 2>&1
    echo "spec_trace K=${KS[-1]} prompt-step $SHIFT: $(grep -E '^(prompt of|run)' "$OUT/trace_shift.log" | tr '\n' ' ')"
  fi 2>&1 | tee -a "$OUT/trace.log"
  # with USELESS=K: where adaptive depth's time goes with the useless draft, cycle by cycle
  # (plain run first in the same process; full trace in trace_useless.log)
  if [ -n "${USELESS:-}" ]; then
    "$G/spec_trace" --model "$P/target" --draft "$P/useless" --depth "$USELESS" --adaptive --new "$NEW" --runs 2 --prompt 32 --warm-up --plain > "$OUT/trace_useless.log" 2>&1
    grep -E "^(warm-up|cycle|plain stretch|run)" "$OUT/trace_useless.log" | cut -c1-200 | head -40
  fi
fi
if [ -n "${OVERLAP:-}" ]; then
  xz -dkf "$G/spec_trace.xz" 2>/dev/null; chmod +x "$G/spec_trace"
  "$G/spec_trace" --model "$P/target" --draft "$P/draft" --depth "${KS[-1]}" --prompt 64 --overlap "$OVERLAP" 2>&1 | tee "$OUT/overlap.log"
fi
if [ -n "${GROWTH:-}" ]; then
  xz -dkf "$G/verify_probe.xz" 2>/dev/null; chmod +x "$G/verify_probe"
  for pre in "" --prewarm ""  --prewarm; do
    echo "growth ${pre:-(no prewarm)}: $("$G/verify_probe" --model "$P/target" --prompt 240 --growth $pre | grep -v '^device' | tr '\n' ' ')"
  done 2>&1 | tee "$OUT/growth.log"
fi
ls "$G"/mlx_lm-*.whl > /dev/null 2>&1 || { echo "mlx-lm not staged (MLX_LM=0)"; exit 0; }
PYTHONPATH=$R python3 - "$P" "$IDS" "$NEW" "${KS[@]}" <<'EOF' 2>&1 | tee "$OUT/mlx_lm.log"
import json, sys, time
import mlx.core as mx
from mlx_lm.utils import load_model
from mlx_lm.generate import generate_step, speculative_generate_step
p, ids, n, ks = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), [int(k) for k in sys.argv[4:]]
target, _ = load_model(__import__("pathlib").Path(p + "/target"))
draft, _ = load_model(__import__("pathlib").Path(p + "/draft"))
def timed(it, spec):
    toks, flags, t0 = [], [], None
    for item in it:
        toks.append(int(item[0]))
        if spec:
            flags.append(bool(item[2]))
        if t0 is None:
            t0 = time.perf_counter()
    mx.synchronize()
    r = {"decode_tokens_per_sec": (len(toks) - 1) / (time.perf_counter() - t0), "tokens": toks}
    if spec:
        r["from_draft_fraction"] = sum(flags) / len(flags)
    return r
sampler = lambda x: mx.argmax(x, axis=-1)
out = {"plain": timed(generate_step(mx.array(ids), target, max_tokens=n, sampler=sampler), False)}
for k in ks:
    out[f"draft{k}"] = timed(speculative_generate_step(mx.array(ids), target, draft, num_draft_tokens=k, max_tokens=n, sampler=sampler), True)
out["plain2"] = timed(generate_step(mx.array(ids), target, max_tokens=n, sampler=sampler), False)
for name, r in out.items():
    print(name, json.dumps({k: v for k, v in r.items() if k != "tokens"}), "same_tokens_as_plain", r["tokens"] == out["plain"]["tokens"])
EOF
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.log"
