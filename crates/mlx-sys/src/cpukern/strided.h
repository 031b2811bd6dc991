// strided.h: reading an MLX array of any float dtype and any strides as rows of its last axis.
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/array.h"

namespace mlxm {

// Element offsets of the rows of `a` seen as [R, D] (D = the last axis), leading axes in
// row-major order.
inline std::vector<int64_t> row_offsets(const mlx::core::array& a) {
  const int nd = int(a.ndim());
  int64_t rows = 1;
  for (int i = 0; i + 1 < nd; i++) rows *= a.shape(i);
  std::vector<int64_t> offs(size_t(std::max<int64_t>(rows, 0)), 0);
  if (nd <= 1 || rows <= 0) return offs;
  std::vector<int> idx(size_t(nd - 1), 0);
  int64_t off = 0;
  for (int64_t r = 0; r < rows; r++) {
    offs[size_t(r)] = off;
    for (int d = nd - 2; d >= 0; d--) {
      if (++idx[size_t(d)] < a.shape(d)) {
        off += a.strides()[size_t(d)];
        break;
      }
      off -= int64_t(a.shape(d) - 1) * a.strides()[size_t(d)];
      idx[size_t(d)] = 0;
    }
  }
  return offs;
}

// `n` elements of `a` from element offset `off`, `stride` apart, as f32 into `dst`.
inline void load_f32(const mlx::core::array& a, int64_t off, int64_t stride, int n, float* dst) {
  namespace mx = mlx::core;
  switch (a.dtype()) {
    case mx::float32: {
      const float* p = a.data<float>() + off;
      if (stride == 1)
        for (int i = 0; i < n; i++) dst[i] = p[i];
      else
        for (int i = 0; i < n; i++) dst[i] = p[int64_t(i) * stride];
      return;
    }
    case mx::bfloat16: {
      const mx::bfloat16_t* p = a.data<mx::bfloat16_t>() + off;
      for (int i = 0; i < n; i++) dst[i] = static_cast<float>(p[int64_t(i) * stride]);
      return;
    }
    case mx::float16: {
      const mx::float16_t* p = a.data<mx::float16_t>() + off;
      for (int i = 0; i < n; i++) dst[i] = static_cast<float>(p[int64_t(i) * stride]);
      return;
    }
    default:
      throw std::invalid_argument("[mlx-models cpu kernels] expected a float32, bfloat16 or float16 array");
  }
}

// `a` ([..., D], any float dtype and strides) as row-contiguous f32 [R, D]: its own data when it
// already is, else a copy into `buf`.
inline const float* rows_f32(const mlx::core::array& a, std::vector<float>& buf) {
  namespace mx = mlx::core;
  if (a.dtype() == mx::float32 && a.flags().row_contiguous) return a.data<float>();
  const int d = a.ndim() ? int(a.shape(-1)) : 1;
  const int64_t ls = a.ndim() ? a.strides().back() : 1;
  const auto offs = row_offsets(a);
  buf.resize(std::max<size_t>(1, offs.size() * size_t(d)));
  for (size_t r = 0; r < offs.size(); r++) load_f32(a, offs[r], ls, d, buf.data() + r * size_t(d));
  return buf.data();
}

}  // namespace mlxm
