// cuda_ops.cpp: two CUDA kernels for products over a few rows, built through MLX's custom-kernel
// API (`mlx::core::fast::cuda_kernel`, compiled by NVRTC on first use and cached by MLX):
//
// - `rows_matmul.cu`: x @ w.T for 1-16 rows of x. MLX runs a product of more than one row through
//   cuBLASLt, and each such call sets up its descriptors, queries the algorithm heuristic and
//   captures the call into the step's CUDA graph on the host: tens of microseconds a product.
//   (In a forward this kernel is still slower than cuBLAS: see mlx-array's `ops::cuda`.)
// - `few_query_attention.cu`: attention of a few queries over a K/V cache read through its
//   strides; MLX's fused attention for more than one query builds a cuDNN graph per new shape,
//   and the matrix-product form pays the cuBLAS set-up twice per layer. (One warp per query row
//   walks all keys: too few blocks for a few queries; slower than the products in a forward.)
//
// The kernel bodies are the .cu files next to this one (build.rs embeds them). mlx-array's
// `ops::cuda` checks the arguments with typed errors; these functions check them again (a wrong
// shape here would read out of bounds on the GPU) and report any failure through mlx-c's handler.
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "../cpukern/guarded.h"
#include "mlxm_cuda_src.h"

namespace mx = mlx::core;

namespace {

const mx::fast::CustomKernelFunction& rows_kernel() {
  static const mx::fast::CustomKernelFunction k =
      mx::fast::cuda_kernel("mlxm_rows_matmul", {"x", "w"}, {"out"}, MLXM_ROWS_MATMUL_SRC, "", false, 0);
  return k;
}

const mx::fast::CustomKernelFunction& attention_kernel() {
  static const mx::fast::CustomKernelFunction k = mx::fast::cuda_kernel(
      "mlxm_few_query_attention", {"q", "k", "v"}, {"out"}, MLXM_FEW_QUERY_ATTENTION_SRC, "", false, 0);
  return k;
}

}  // namespace

extern "C" {

// x [M, K] @ w[N, K].T -> [M, N], x and w of one 2-byte float dtype, 1 <= M <= 16 (any strides).
int mlx_models_cuda_rows_matmul(mlx_array* res, const mlx_array x, const mlx_array w, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    const auto& xa = mlx_array_get_(x);
    const auto& wa = mlx_array_get_(w);
    if (xa.ndim() != 2 || wa.ndim() != 2 || xa.shape(1) != wa.shape(1) || xa.shape(0) < 1 || xa.shape(0) > 16 ||
        xa.dtype() != wa.dtype() || (xa.dtype() != mx::bfloat16 && xa.dtype() != mx::float16))
      throw std::invalid_argument("[cuda_rows_matmul] needs x [M <= 16, K] and w [N, K] of one 16-bit float dtype");
    const int m = xa.shape(0), n = wa.shape(0);
    // one compiled variant per dtype for up to 8 rows (2 rows of w per warp: 16 sums in
    // registers) and one for 9-16 (1 row of w per warp)
    const int maxm = m <= 8 ? 8 : 16, r = m <= 8 ? 2 : 1;
    const int warps = (n + r - 1) / r;
    return rows_kernel()({xa, wa}, {{m, n}}, {xa.dtype()}, {warps * 32, 1, 1}, {256, 1, 1},
                         {{"T", xa.dtype()}, {"MAXM", maxm}, {"R", r}}, std::nullopt, false, mlx_stream_get_(s))[0];
  });
}

// Attention of q [B, Hq, M, D] over k, v [B, Hk, N, D] (Hq a multiple of Hk, D a multiple of 32
// up to 256, one float dtype): causal (the queries are the last M positions) or not, within the
// `window` most recent keys when `window` > 0 (with causal). Output [B, Hq, M, D].
int mlx_models_cuda_few_query_attention(mlx_array* res, const mlx_array q, const mlx_array k, const mlx_array v, float scale,
                                        bool causal, int window, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    const auto& qa = mlx_array_get_(q);
    const auto& ka = mlx_array_get_(k);
    const auto& va = mlx_array_get_(v);
    const bool float_t = qa.dtype() == mx::bfloat16 || qa.dtype() == mx::float16 || qa.dtype() == mx::float32;
    if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4 || ka.shape() != va.shape() || qa.shape(0) != ka.shape(0) ||
        qa.shape(3) != ka.shape(3) || ka.shape(1) == 0 || qa.shape(1) % ka.shape(1) != 0 || qa.shape(3) % 32 != 0 ||
        qa.shape(3) > 256 || !float_t || ka.dtype() != qa.dtype() || va.dtype() != qa.dtype() || window < 0 ||
        (causal && qa.shape(2) > ka.shape(2)))
      throw std::invalid_argument("[cuda_few_query_attention] unsupported q/k/v shapes or dtypes");
    int bits;
    std::memcpy(&bits, &scale, sizeof bits);
    const int rows = qa.shape(0) * qa.shape(1) * qa.shape(2);
    return attention_kernel()({qa, ka, va}, {qa.shape()}, {qa.dtype()}, {rows * 32, 1, 1}, {128, 1, 1},
                              {{"T", qa.dtype()}, {"D", qa.shape(3)}, {"CAUSAL", causal}, {"WINDOW", window}, {"SCALE", bits}},
                              std::nullopt, false, mlx_stream_get_(s))[0];
  });
}
}
