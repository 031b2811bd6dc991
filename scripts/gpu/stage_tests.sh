#!/usr/bin/env bash
# Stage integration-test binaries for a run on the H200 (the `run` tool, carry [".gpu-tests"]):
#
#   bash scripts/gpu/stage_tests.sh [TEST...]     # default: paged (crates/models/tests/paged.rs)
#   STAGE=.gpu-bench bash scripts/gpu/stage_tests.sh ...   # add them to the benchmark's staging
#                                                          # (one carry; GPU_STAGE=.gpu-bench on the device)
#   PKG=mlx-speculative bash scripts/gpu/stage_tests.sh identity   # another package's tests
#
# Builds `cargo test --release -p PKG --test TEST --no-run` (PKG default mlx-models) here, against the CPU libmlx
# (the binary runs with the CUDA libmlx swapped in through LD_LIBRARY_PATH, as gpu_check does),
# and puts each binary (stripped, xz) with the CUDA payload of scripts/gpu/prepare.sh in
# .gpu-tests/ (git-ignored through .git/info/exclude). Then on the device:
#   bash scripts/gpu/run_tests.sh
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
. "$ROOT/scripts/gpu/stage_payload.sh"
STAGE=${STAGE:-.gpu-tests}
[ "$STAGE" != .gpu-tests ] || rm -rf "$ROOT/.gpu-tests"
stage_payload "$STAGE"
TESTS=("$@"); [ ${#TESTS[@]} -gt 0 ] || TESTS=(paged)
for t in "${TESTS[@]}"; do
  bin=$(cd "$ROOT" && cargo test --release -p "${PKG:-mlx-models}" --test "$t" --no-run --message-format json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]: print(m["executable"])' | tail -1)
  [ -x "$bin" ] || { echo "no test binary for $t" >&2; exit 1; }
  cp -f "$bin" "$S/$t" && strip --strip-unneeded "$S/$t" && xz -T2 -6 -f "$S/$t"
done
echo "$ROOT" > "$S/manifest_dir_root"   # the tests find their fixtures under this path
du -ch "$S"/* | tail -1
