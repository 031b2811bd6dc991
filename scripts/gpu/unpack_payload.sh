# Sourced on the H200 by benches/gpu_bench.sh and scripts/gpu/run_tests.sh:
#   unpack_payload STAGE RT   # STAGE: the carried folder holding stage_payload.sh's files
# Makes RT/mlx/lib/libmlx.so (the sm_90 CUDA libmlx), RT/mlx/include, RT/mlx_cuda_13.libs and
# RT/nvidia -> the image's venv nvidia/ (cu13, cudnn, nccl), as the mlx-cuda-13 wheel lays them out
# (with STAGE/crt.tar.xz's nvidia/cu13/include/crt added where the image lacks it).
unpack_payload() {
  local g=$1 r=$2 sp d t
  # never through a link (one to a build's CPU libmlx would be overwritten by the CUDA one)
  [ ! -L "$r/mlx" ] && [ ! -L "$r/mlx/lib" ] || { echo "unpack_payload: $r/mlx/lib is a link; not writing through it" >&2; return 3; }
  mkdir -p "$r/mlx/lib"
  xz -dc "$g/libmlx.so.xz" > "$r/mlx/lib/libmlx.so.part" && mv -f "$r/mlx/lib/libmlx.so.part" "$r/mlx/lib/libmlx.so" || return 3
  for t in include cudalibs; do tar -C "$r" -xJf "$g/$t.tar.xz" || return 3; done
  sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
  [ -d "$sp/nvidia/cu13/lib" ] || for d in /opt/torch/.venv/lib/python3*/site-packages; do [ -d "$d/nvidia/cu13/lib" ] && sp=$d; done
  rm -rf "$r/nvidia"
  if [ -f "$g/crt.tar.xz" ] && [ ! -e "$sp/nvidia/cu13/include/crt/mma.h" ]; then
    # the image's cu13 headers lack crt/ (package nvidia-cuda-crt), which NVRTC needs for MLX's
    # JIT kernels that include mma.h (the sm_90 quantized products): a tree of links to the
    # image's nvidia/ with the staged crt/ added to cu13/include
    mkdir -p "$r/nvidia/cu13/include"
    for d in "$sp"/nvidia/*; do [ ! -e "$d" ] || [ "${d##*/}" = cu13 ] || ln -s "$d" "$r/nvidia/"; done
    for d in "$sp"/nvidia/cu13/*; do [ ! -e "$d" ] || [ "${d##*/}" = include ] || ln -s "$d" "$r/nvidia/cu13/"; done
    for d in "$sp"/nvidia/cu13/include/*; do [ ! -e "$d" ] || ln -s "$d" "$r/nvidia/cu13/include/"; done
    tar -C "$r" -xJf "$g/crt.tar.xz" || return 3
  else
    ln -s "$sp/nvidia" "$r/nvidia"
  fi
}
