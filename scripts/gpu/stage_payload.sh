# Sourced by the staging scripts (benches/prepare_gpu.sh, scripts/gpu/stage_tests.sh):
#   stage_payload NAME   # creates $ROOT/NAME/ (git-ignored via .git/info/exclude) holding the
#                        # CUDA libmlx payload of scripts/gpu/prepare.sh; sets S to that folder
# Needs ROOT (the repository root). MLX_CUDA_CACHE overrides the payload cache.
stage_payload() {
  local name=$1
  local p=${MLX_CUDA_CACHE:-$HOME/.cache/mlx-sys/mlx-cuda-13-0.32.2}/payload-sm90
  local excl
  excl=$(git -C "$ROOT" rev-parse --git-path info/exclude); case $excl in /*) ;; *) excl=$ROOT/$excl ;; esac
  grep -qxF "/$name/" "$excl" || echo "/$name/" >> "$excl"
  # made, or remade when prepare.sh's patch or trim scripts changed, by prepare.sh itself
  bash "$ROOT/scripts/gpu/prepare.sh" --payload || return 1
  S=$ROOT/$name
  mkdir -p "$S"
  cp -f "$p"/{libmlx.so.xz,include.tar.xz,cudalibs.tar.xz,crt.tar.xz} "$S/"
}
