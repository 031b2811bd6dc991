// dispatch.h: how the CPU primitives (ops.cpp, primitive.cpp) run their work: on the stream's
// CPU encoder, with the inputs and the freshly allocated output registered, `f(inputs, out)`
// over weak copies of them.
#pragma once
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxm {

template <class F>
void dispatch(const mlx::core::Stream& s, const std::vector<mlx::core::array>& inputs, mlx::core::array& out, F&& f) {
  namespace mx = mlx::core;
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  std::vector<mx::array> ins;
  for (auto& a : inputs) ins.push_back(mx::array::unsafe_weak_copy(a));
  enc.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out), f = std::forward<F>(f)]() mutable { f(ins, out); });
}

}  // namespace mlxm
