# Sourced on the H200 by benches/gpu_bench.sh and scripts/gpu/run_tests.sh:
#   unpack_payload STAGE RT   # STAGE: the carried folder holding stage_payload.sh's files
# Makes RT/mlx/lib/libmlx.so (the sm_90 CUDA libmlx), RT/mlx/include, RT/mlx_cuda_13.libs and
# RT/nvidia -> the image's venv nvidia/ (cu13, cudnn, nccl), as the mlx-cuda-13 wheel lays them out.
unpack_payload() {
  local g=$1 r=$2 sp d t
  mkdir -p "$r/mlx/lib"
  xz -dc "$g/libmlx.so.xz" > "$r/mlx/lib/libmlx.so" || return 3
  for t in include cudalibs; do tar -C "$r" -xJf "$g/$t.tar.xz" || return 3; done
  sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
  [ -d "$sp/nvidia/cu13/lib" ] || for d in /opt/torch/.venv/lib/python3*/site-packages; do [ -d "$d/nvidia/cu13/lib" ] && sp=$d; done
  ln -sfn "$sp/nvidia" "$r/nvidia"
}
