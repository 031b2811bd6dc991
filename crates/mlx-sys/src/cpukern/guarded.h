// guarded.h: the C entry points' error convention (ops.cpp, primitive.cpp, cudakern/cuda_ops.cpp): run `f`,
// store its array in `*res` and return 0, or report the exception's message to mlx-c's error
// handler and return 1.
#pragma once
#include <exception>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

namespace mlxm {

template <class F>
int guarded(mlx_array* res, F&& f) {
  try {
    mlx_array_set_(*res, f());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

}  // namespace mlxm
