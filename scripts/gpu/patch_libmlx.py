"""Fix the epilogue race of MLX's JIT-compiled `qmm_sm80` kernel inside a CUDA libmlx.so.

    python3 scripts/gpu/patch_libmlx.py IN OUT      # mlx-cuda-13 0.32.2's mlx/lib/libmlx.so

libmlx compiles `qmm_sm80_kernel` (quantized products of bf16/f16 rows with `M * B >= 8`: prefill,
speculative verify steps of 8 rows, `gather_qmm` of 8 or more expert rows) with NVRTC from a
source string it embeds. The kernel's shared storage is a union: the epilogue stages the output
tile in the bytes of the A/B `cp.async` pipeline, while up to two copies of the main loop may
still be landing there (its last iteration fetches once more and it only waits down to
`K_PIPE_MAX - 2` groups). A late copy then overwrites staged results, so the product is wrong on
a timing-dependent subset of launches (non-deterministic tokens at temperature 0, NaN).

The fix retires the outstanding copies and re-converges the block before the epilogue
(`cp_async_wait<0>(); __syncthreads();`). The source is rewritten in place with the same
length (the loop's comments make room; the rest is padded with spaces), and the JIT module name
changes from `qmm_sm80_tn_...` to `qmm_sm80_tf_...`, so kernels an unpatched libmlx left in the
PTX cache ($MLX_PTX_CACHE_DIR, by default under /tmp/mlx) are not picked up.

Every embedded copy of the source is patched; the script refuses a library in which it finds no
copy or an unexpected module-name string, and leaves IN untouched. The written file is replaced
atomically.
"""

import os
import sys
import tempfile

LOOP = b"""    // Unroll MMA blocks.
    CUTE_UNROLL
    for (int block = 0; block < K_BLOCK_MAX; ++block) {
      // Wait for last tile.
      if (block == K_BLOCK_MAX - 1) {
        smem_pipe_read = (smem_pipe_read + 1) % K_PIPE_MAX;
        cp_async_wait<K_PIPE_MAX - 2>();
        __syncthreads();
        fetch_scales((tile + 1 < K_TILE_MAX) ? tile + 1 : tile);
      }
      // Prefetch next block.
      fetch_smem((block + 1) % K_BLOCK_MAX);
      // Prefetch next tile.
      if (block == 0) {
        fetch_gmem(tile_pipe);
        tile_pipe = (tile_pipe + 1 < K_TILE_MAX) ? tile_pipe + 1 : tile_pipe;
      }
      // MMA.
      gemm(mma, tCrA(_,_,block), tCrB_dq(_,_,block), tCrC_accu);
    }
  }

  // Epilogue.
  CUTE_UNROLL
  for (int i = 0; i < size(tCrC_accu); i++) {
    tCrC(i) = Element(tCrC_accu(i));
  }
  copy(r2s_copy_c, r2s_tCrC, r2s_tCsC);"""

FIXED = b"""    CUTE_UNROLL
    for (int block = 0; block < K_BLOCK_MAX; ++block) {
      if (block == K_BLOCK_MAX - 1) {
        smem_pipe_read = (smem_pipe_read + 1) % K_PIPE_MAX;
        cp_async_wait<K_PIPE_MAX - 2>();
        __syncthreads();
        fetch_scales((tile + 1 < K_TILE_MAX) ? tile + 1 : tile);
      }
      fetch_smem((block + 1) % K_BLOCK_MAX);
      if (block == 0) {
        fetch_gmem(tile_pipe);
        tile_pipe = (tile_pipe + 1 < K_TILE_MAX) ? tile_pipe + 1 : tile_pipe;
      }
      gemm(mma, tCrA(_,_,block), tCrB_dq(_,_,block), tCrC_accu);
    }
  }
  // sC aliases sA/sB: retire in-flight cp.async first
  cp_async_wait<0>();
  __syncthreads();
  CUTE_UNROLL
  for (int i = 0; i < size(tCrC_accu); i++) {
    tCrC(i) = Element(tCrC_accu(i));
  }
  copy(r2s_copy_c, r2s_tCrC, r2s_tCsC);"""

NAME = b"qmm_sm80_tn_{}_m{}_b{}_g{}_{}"
NEW_NAME = b"qmm_sm80_tf_{}_m{}_b{}_g{}_{}"


def fixed_loop():
    if len(FIXED) > len(LOOP):
        raise SystemExit("internal error: the fixed loop is longer than the original")
    # pad with spaces before the last line's indentation: same length, same code
    pad = len(LOOP) - len(FIXED)
    head, sep, tail = FIXED.rpartition(b"\n")
    return head + sep + b" " * pad + tail


def patch(data):
    copies = data.count(LOOP)
    names = data.count(NAME)
    if copies == 0:
        if data.count(fixed_loop()) and data.count(NEW_NAME) == 1:
            raise SystemExit("already patched")
        raise SystemExit("no qmm_sm80 source with the racy epilogue found: not mlx-cuda 0.32.2's libmlx?")
    if names != 1:
        raise SystemExit(f"found the module name {NAME.decode()} {names} times, expected once")
    out = data.replace(LOOP, fixed_loop()).replace(NAME, NEW_NAME)
    assert len(out) == len(data)
    return out, copies


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    src, dst = sys.argv[1], sys.argv[2]
    with open(src, "rb") as f:
        data = f.read()
    out, copies = patch(data)
    d = os.path.dirname(os.path.abspath(dst))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".patch_libmlx.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(out)
        os.chmod(tmp, os.stat(src).st_mode & 0o777)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"patched {copies} copies of the qmm_sm80 source; module name {NEW_NAME.decode()}")


if __name__ == "__main__":
    main()
