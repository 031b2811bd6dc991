// ops.cpp: RMSNorm, rotary embedding and few-query attention as single MLX primitives on the CPU.
//
// MLX's CPU backend has no kernels for `fast::rms_norm`, `fast::rope` and
// `fast::scaled_dot_product_attention`: it builds them from its general ops (11, 27-29 and about
// 12 graph nodes), and every node costs a scheduling round trip. A small model's decode step is
// dominated by that per-node cost, not by arithmetic. These primitives compute the same values
// (MLX's formulas in f32, rounded to bf16/f16 where MLX's ops of those dtypes round) in one node
// each, for float inputs on a CPU stream outside function transforms and MLX-ops scopes
// (`use_mlx_ops`); anything else goes to MLX's own op. Gradients are MLX's: the vjp of the op each one replaces.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "dispatch.h"
#include "guarded.h"
#include "kernels.h"
#include "strided.h"

namespace mx = mlx::core;

namespace mlxm {
namespace {

using Fn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

// The gradients of `op` (MLX's own op over the same inputs) for `argnums`.
std::vector<mx::array> vjp_of(const Fn& op, const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                              const std::vector<int>& argnums) {
  auto grads = mx::vjp(op, primals, cotangents).second;
  std::vector<mx::array> out;
  for (int a : argnums) out.push_back(grads.at(size_t(a)));
  return out;
}

// sum_i a[i] b[i] in 16 independent partial sums (the compiler vectorises them; one running sum
// is a serial chain of dependent additions).
inline float dot(const float* a, const float* b, int n) {
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
  float s = 0.0f;
  for (int j = 0; j < 16; j++) s += acc[j];
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

bool float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::bfloat16 || t == mx::float16; }
bool float_dtype(const mx::array& a) { return float_dtype(a.dtype()); }

// True while MLX traces a function (grad, vjp, vmap, compile). The primitives then step aside and
// the traced graph is built from MLX's own ops, so training and other transformed computations
// keep MLX's numerics exactly; only plain evaluation (inference) runs the primitives. MLX's
// tracing flag is not exported, but a tracer-marked array reports it through `is_tracer`.
// The probe is made once per thread and never freed (no array outlives MLX at exit), so the
// check on every op of a decode step allocates nothing.
bool tracing() {
  static thread_local const mx::array* probe = [] {
    auto* p = new mx::array(0.0f);
    p->set_tracer(true);
    return p;
  }();
  return probe->is_tracer();
}

// Scopes (`mlx_models_mlx_ops_only`) on this thread in which graphs are built from MLX's ops even
// outside a trace: a trainer's untraced forwards then compute what its traced ones do.
thread_local int mlx_ops_scopes = 0;

// Whether a graph node built now takes MLX's own ops rather than a primitive of this file.
bool use_mlx_ops() { return mlx_ops_scopes > 0 || tracing(); }

// `v` rounded to `t` (bf16, f16; f32 unchanged), as an MLX op with outputs of dtype `t` stores it:
// the primitives round where the ops they replace round, so bf16/f16 results match those ops'.
inline float rnd(float v, mx::Dtype t) {
  if (t == mx::bfloat16) return static_cast<float>(mx::bfloat16_t(v));
  if (t == mx::float16) return static_cast<float>(mx::float16_t(v));
  return v;
}

// `n` values (already rounded to `o`'s dtype) into row-contiguous `o` from element `at`.
inline void store(mx::array& o, size_t at, const float* v, size_t n) {
  if (o.dtype() == mx::float32) {
    std::copy(v, v + n, o.data<float>() + at);
  } else if (o.dtype() == mx::bfloat16) {
    auto* p = o.data<mx::bfloat16_t>() + at;
    for (size_t i = 0; i < n; i++) p[i] = mx::bfloat16_t(v[i]);
  } else {
    auto* p = o.data<mx::float16_t>() + at;
    for (size_t i = 0; i < n; i++) p[i] = mx::float16_t(v[i]);
  }
}

// Row `off` (stride `ls`) of `a` as f32: in place for contiguous f32, else copied into `buf`.
inline const float* row_f32(const mx::array& a, int64_t off, int64_t ls, int n, std::vector<float>& buf) {
  if (a.dtype() == mx::float32 && ls == 1) return a.data<float>() + off;
  load_f32(a, off, ls, n, buf.data());
  return buf.data();
}

// ---- RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w over the last axis, in f32, rounded to the
// output dtype where MLX's op rounds (before and after the weight).

class CpuRmsNorm : public mx::UnaryPrimitive {
 public:
  CpuRmsNorm(mx::Stream s, float eps, bool has_w) : mx::UnaryPrimitive(s), eps_(eps), has_w_(has_w) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [eps = eps_, has_w = has_w_](std::vector<mx::array>& in, mx::array& o) {
      const mx::array& x = in[0];
      const int d = int(x.shape(-1));
      const mx::Dtype ot = o.dtype();
      std::vector<float> w(size_t(d), 1.0f);
      if (has_w) {
        load_f32(in[1], 0, in[1].strides()[0], d, w.data());
        for (auto& v : w) v = rnd(v, ot);
      }
      const auto offs = row_offsets(x);
      const int64_t ls = x.strides().back();
      std::vector<float> row(static_cast<size_t>(d)), yr(static_cast<size_t>(d));
      const float inv_d = 1.0f / float(d);
      for (size_t r = 0; r < offs.size(); r++) {
        const float* xr = row_f32(x, offs[r], ls, d, row);
        const float ss = dot(xr, xr, d);
        const float n = 1.0f / std::sqrt(ss * inv_d + eps);
        for (int k = 0; k < d; k++) yr[size_t(k)] = rnd(rnd(xr[k] * n, ot) * w[size_t(k)], ot);
        store(o, r * size_t(d), yr.data(), size_t(d));
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { throw std::runtime_error("[cpu_rms_norm] runs on the CPU only"); }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto s = stream();
    Fn op = [eps = eps_, has_w = has_w_, s](const std::vector<mx::array>& in) {
      std::optional<mx::array> w;
      if (has_w) w = in[1];
      return std::vector<mx::array>{mx::fast::rms_norm(in[0], w, eps, s)};
    };
    return vjp_of(op, primals, cotangents, argnums);
  }
  const char* name() const override { return "CpuRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuRmsNorm&>(other);
    return eps_ == o.eps_ && has_w_ == o.has_w_;
  }

 private:
  float eps_;
  bool has_w_;
};

mx::array rms_norm(const mx::array& x, const mx::array* w, float eps, mx::Stream s) {
  const mx::Dtype ot = w ? mx::promote_types(x.dtype(), w->dtype()) : x.dtype();
  const bool ok = s.device == mx::Device::cpu && !use_mlx_ops() && float_dtype(x) && float_dtype(ot) && x.ndim() >= 1 && x.shape(-1) > 0 &&
                  (!w || (w->ndim() == 1 && w->shape(0) == x.shape(-1) && float_dtype(*w)));
  if (!ok) {
    std::optional<mx::array> wo;
    if (w) wo = *w;
    return mx::fast::rms_norm(x, wo, eps, s);
  }
  std::vector<mx::array> inputs{x};
  if (w) inputs.push_back(*w);
  return mx::array(x.shape(), ot, std::make_shared<CpuRmsNorm>(s, eps, w != nullptr), std::move(inputs));
}

// ---- RoPE at positions offset + t (t the second-to-last axis), MLX's fast::rope semantics.

// cos and sin of the angles of positions offset + t, t < t_len ([t_len, dims / 2] each), as MLX
// computes them: f32 positions (t + offset) * scale times the inverse frequencies (1 / freqs, or
// exp(-j * log(base) / (dims / 2))).
// The tables are rounded to `t` (MLX casts them to the input's dtype).
void rope_tables(int dims, float base, float scale, int offset, const mx::array* freqs, int t_len, mx::Dtype dt,
                 std::vector<float>& cs, std::vector<float>& sn) {
  const int half = dims / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  if (freqs) {
    load_f32(*freqs, 0, freqs->strides()[0], half, inv.data());
    for (auto& f : inv) f = 1.0f / f;
  } else {
    const float c = std::log(base) / float(half);
    for (int j = 0; j < half; j++) inv[size_t(j)] = std::exp(float(-j) * c);
  }
  cs.resize(size_t(t_len) * half);
  sn.resize(size_t(t_len) * half);
  for (int t = 0; t < t_len; t++) {
    const float pos = (float(t) + float(offset)) * scale;
    for (int j = 0; j < half; j++) {
      const float th = pos * inv[size_t(j)];
      cs[size_t(t) * half + j] = rnd(std::cos(th), dt);
      sn[size_t(t) * half + j] = rnd(std::sin(th), dt);
    }
  }
}

// One row of `d` features rotated by the angles c, sv (the first `dims` features; the rest copied),
// each product and sum rounded to `t` as MLX's ops of that dtype round them.
inline void rotate_row(const float* xr, float* yr, int d, int dims, bool trad, const float* c, const float* sv, mx::Dtype t) {
  const int half = dims / 2;
  const int step = trad ? 2 : 1, other = trad ? 1 : half;
  for (int j = 0; j < half; j++) {
    const int i = j * step;
    const float a = xr[i], b = xr[i + other];
    yr[i] = rnd(rnd(a * c[j], t) - rnd(b * sv[j], t), t);
    yr[i + other] = rnd(rnd(a * sv[j], t) + rnd(b * c[j], t), t);
  }
  for (int k = dims; k < d; k++) yr[k] = xr[k];
}

class CpuRope : public mx::UnaryPrimitive {
 public:
  CpuRope(mx::Stream s, int dims, bool traditional, float base, float scale, int offset, bool has_freqs)
      : mx::UnaryPrimitive(s), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset), freqs_(has_freqs) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [dims = dims_, trad = traditional_, base = base_, scale = scale_, offset = offset_,
                                     has_f = freqs_](std::vector<mx::array>& in, mx::array& o) {
      const mx::array& x = in[0];
      const int d = int(x.shape(-1));
      const int t_len = int(x.shape(-2));
      const int half = dims / 2;
      const mx::Dtype dt = x.dtype();
      std::vector<float> cs, sn;
      rope_tables(dims, base, scale, offset, has_f ? &in[1] : nullptr, t_len, dt, cs, sn);
      const auto offs = row_offsets(x);
      const int64_t ls = x.strides().back();
      std::vector<float> row(static_cast<size_t>(d)), yr(static_cast<size_t>(d));
      for (size_t r = 0; r < offs.size(); r++) {
        const float* xr = row_f32(x, offs[r], ls, d, row);
        const size_t t = r % size_t(t_len);
        rotate_row(xr, yr.data(), d, dims, trad, cs.data() + t * half, sn.data() + t * half, dt);
        store(o, r * size_t(d), yr.data(), size_t(d));
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { throw std::runtime_error("[cpu_rope] runs on the CPU only"); }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    for (int a : argnums)
      if (a != 0) throw std::invalid_argument("[cpu_rope] gradients flow to the input only, not to the frequencies");
    auto s = stream();
    Fn op = [d = dims_, t = traditional_, b = base_, sc = scale_, off = offset_, f = freqs_, s](const std::vector<mx::array>& in) {
      std::optional<mx::array> fr;
      std::optional<float> base;
      if (f) fr = in[1]; else base = b;
      return std::vector<mx::array>{mx::fast::rope(in[0], d, t, base, sc, off, fr, s)};
    };
    return vjp_of(op, primals, cotangents, argnums);
  }
  const char* name() const override { return "CpuRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuRope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ && offset_ == o.offset_ &&
           freqs_ == o.freqs_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
  bool freqs_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale, int offset,
               const mx::array* freqs, mx::Stream s) {
  const bool ok = s.device == mx::Device::cpu && !use_mlx_ops() && float_dtype(x) && x.ndim() >= 3 && dims > 0 && dims % 2 == 0 &&
                  dims <= x.shape(-1) && (freqs ? (!base && freqs->ndim() == 1 && freqs->shape(0) == dims / 2 && float_dtype(*freqs)) : base.has_value());
  if (!ok) {
    std::optional<mx::array> fr;
    if (freqs) fr = *freqs;
    return mx::fast::rope(x, dims, traditional, base, scale, offset, fr, s);
  }
  std::vector<mx::array> inputs{x};
  if (freqs) inputs.push_back(*freqs);
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<CpuRope>(s, dims, traditional, base.value_or(1.0f), scale, offset, freqs != nullptr),
                   std::move(inputs));
}

// ---- Attention's heads: q, k and v column ranges of the projection outputs ([B, L, C]) as
// [B, H, L, D] (row-contiguous), q and k rotated at positions offset + l. One node for what
// attention otherwise builds from slices, reshapes, transposes and two ropes.

struct Head {
  int input;   // which projection output
  int col;     // first column
  int heads;   // H
  bool rotate;
};

struct RopeArgs {
  int dims;
  bool traditional;
  std::optional<float> base;  // else the primitive's last input holds the frequencies
  float scale;
  int offset;
};

// The heads through MLX's own ops (other streams and dtypes, and gradients).
std::vector<mx::array> heads_by_ops(const std::vector<mx::array>& in, const std::vector<Head>& spec, int d, const RopeArgs& r,
                                    bool has_freqs, mx::Stream s) {
  std::vector<mx::array> outs;
  for (const Head& h : spec) {
    const mx::array& x = in[size_t(h.input)];
    mx::Shape start(x.ndim(), 0), stop = x.shape();
    start.back() = h.col;
    stop.back() = h.col + h.heads * d;
    auto part = mx::slice(x, start, stop, s);
    part = mx::transpose(mx::reshape(part, {x.shape(0), x.shape(1), h.heads, d}, s), {0, 2, 1, 3}, s);
    if (h.rotate) {
      std::optional<mx::array> fr;
      if (has_freqs) fr = in.back();
      part = mx::fast::rope(part, r.dims, r.traditional, r.base, r.scale, r.offset, fr, s);
    }
    outs.push_back(part);
  }
  return outs;
}

class CpuHeads : public mx::Primitive {
 public:
  CpuHeads(mx::Stream s, std::vector<Head> spec, int d, RopeArgs r) : mx::Primitive(s), spec_(std::move(spec)), d_(d), r_(r) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    std::vector<mx::array> ins, outs;
    for (auto& a : inputs) ins.push_back(mx::array::unsafe_weak_copy(a));
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      enc.set_output_array(o);
      outs.push_back(mx::array::unsafe_weak_copy(o));
    }
    enc.dispatch([ins = std::move(ins), outs = std::move(outs), spec = spec_, d = d_, r = r_]() mutable {
      const int b_n = int(ins[0].shape(0)), l_n = int(ins[0].shape(1));
      const bool has_f = !r.base.has_value();
      const mx::Dtype dt = ins[0].dtype();
      std::vector<float> cs, sn, row(static_cast<size_t>(d)), yr(static_cast<size_t>(d));
      rope_tables(r.dims, r.base.value_or(1.0f), r.scale, r.offset, has_f ? &ins.back() : nullptr, l_n, dt, cs, sn);
      const int half = r.dims / 2;
      for (size_t o = 0; o < spec.size(); o++) {
        const Head& h = spec[o];
        const mx::array& x = ins[size_t(h.input)];
        const auto& st = x.strides();
        for (int b = 0; b < b_n; b++)
          for (int hh = 0; hh < h.heads; hh++)
            for (int l = 0; l < l_n; l++) {
              const float* src = row_f32(x, b * st[0] + l * st[1] + int64_t(h.col + hh * d) * st[2], st[2], d, row);
              const size_t at = ((size_t(b) * h.heads + hh) * l_n + l) * d;
              if (h.rotate) {
                rotate_row(src, yr.data(), d, r.dims, r.traditional, cs.data() + size_t(l) * half, sn.data() + size_t(l) * half, dt);
                store(outs[o], at, yr.data(), size_t(d));
              } else {
                store(outs[o], at, src, size_t(d));
              }
            }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[cpu_heads] runs on the CPU only");
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const int n_x = int(primals.size()) - (r_.base.has_value() ? 0 : 1);
    for (int a : argnums)
      if (a >= n_x) throw std::invalid_argument("[cpu_heads] gradients flow to the projections only, not to the frequencies");
    auto s = stream();
    Fn op = [spec = spec_, d = d_, r = r_, s](const std::vector<mx::array>& in) { return heads_by_ops(in, spec, d, r, !r.base.has_value(), s); };
    return vjp_of(op, primals, cotangents, argnums);
  }
  const char* name() const override { return "CpuHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuHeads&>(other);
    if (spec_.size() != o.spec_.size() || d_ != o.d_ || r_.dims != o.r_.dims || r_.traditional != o.r_.traditional ||
        r_.base != o.r_.base || r_.scale != o.r_.scale || r_.offset != o.r_.offset)
      return false;
    for (size_t i = 0; i < spec_.size(); i++)
      if (spec_[i].input != o.spec_[i].input || spec_[i].col != o.spec_[i].col || spec_[i].heads != o.spec_[i].heads ||
          spec_[i].rotate != o.spec_[i].rotate)
        return false;
    return true;
  }

 private:
  std::vector<Head> spec_;
  int d_;
  RopeArgs r_;
};

std::vector<mx::array> heads(std::vector<mx::array> xs, std::vector<Head> spec, int d, RopeArgs r, const mx::array* freqs,
                             mx::Stream s) {
  auto bad = [](const std::string& m) { throw std::invalid_argument("[heads] " + m); };
  if (xs.empty() || spec.empty() || d <= 0) bad("no projections, heads or head dim");
  if (freqs ? r.base.has_value() : !r.base.has_value()) bad("give either a rope base or frequencies");
  if (r.dims <= 0 || r.dims % 2 != 0 || r.dims > d) bad("rotary dims " + std::to_string(r.dims) + " for head dim " + std::to_string(d));
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != r.dims / 2)) bad("frequencies must be [dims / 2]");
  bool ours = s.device == mx::Device::cpu && !use_mlx_ops() && (!freqs || float_dtype(*freqs)) && float_dtype(xs[0]);
  for (auto& x : xs) {
    if (x.ndim() != 3 || x.shape(0) != xs[0].shape(0) || x.shape(1) != xs[0].shape(1)) bad("projections must be [B, L, C] alike");
    ours = ours && x.dtype() == xs[0].dtype();
  }
  std::vector<mx::Shape> shapes;
  for (const Head& h : spec) {
    if (h.input < 0 || h.input >= int(xs.size()) || h.col < 0 || h.heads <= 0 || h.col + h.heads * d > xs[size_t(h.input)].shape(2))
      bad("a head range lies outside its projection");
    shapes.push_back({xs[0].shape(0), h.heads, xs[0].shape(1), d});
  }
  if (freqs) xs.push_back(*freqs);
  if (!ours) return heads_by_ops(xs, spec, d, r, freqs != nullptr, s);
  std::vector<mx::Dtype> dtypes(spec.size(), xs[0].dtype());
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<CpuHeads>(s, std::move(spec), d, r), xs);
}

// ---- Greedy pick: per row of f32 logits [B, V], the first index of the largest value and its
// log-probability x[t] - logsumexp(x), with MLX's logsumexp rule (the shift is the row's maximum,
// 0 where that is infinite). MLX's CPU backend runs exp here one element at a time through libm
// (about 0.75 ms for 49152 logits); this is one pass for the maximum and one vectorised pass of
// exp (KernelSet::sum_exp).

// A row's maximum (NaN never wins), its first index and MLX's logsumexp: shifted by the maximum,
// or by 0 where that is infinite (then log(sum) is +inf or -inf, and so is the result).
struct RowLse {
  float max;
  int at;
  float lse;
};
RowLse row_lse(const KernelSet& ks, const float* row, int n) {
  RowLse r;
  ks.max_index(row, n, &r.max, &r.at);
  r.lse = std::isinf(r.max) ? r.max : std::log(ks.sum_exp(row, n, r.max)) + r.max;
  return r;
}

std::vector<mx::array> greedy_by_ops(const mx::array& x, mx::Stream s) {
  auto tok = mx::astype(mx::argmax(x, -1, false, s), mx::uint32, s);
  auto picked = mx::squeeze(mx::take_along_axis(x, mx::expand_dims(tok, -1, s), -1, s), -1, s);
  return {tok, mx::subtract(picked, mx::logsumexp(x, -1, false, s), s)};
}

class CpuGreedy : public mx::Primitive {
 public:
  explicit CpuGreedy(mx::Stream s) : mx::Primitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    std::vector<mx::array> outs;
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      enc.set_output_array(o);
      outs.push_back(mx::array::unsafe_weak_copy(o));
    }
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), outs = std::move(outs)]() mutable {
      const int b_n = int(x.shape(0)), v_n = int(x.shape(1));
      const auto& st = x.strides();
      const KernelSet& ks = cpu_kernels();
      std::vector<float> buf(static_cast<size_t>(v_n));
      auto* tok = outs[0].data<uint32_t>();
      auto* lp = outs[1].data<float>();
      for (int b = 0; b < b_n; b++) {
        const float* row = row_f32(x, b * st[0], st[1], v_n, buf);
        const RowLse r = row_lse(ks, row, v_n);
        tok[b] = uint32_t(r.at);
        lp[b] = row[r.at] - r.lse;
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[cpu_greedy] runs on the CPU only");
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&, const std::vector<int>&,
                             const std::vector<mx::array>&) override {
    throw std::invalid_argument("[cpu_greedy] a greedy pick has no gradient");
  }
  const char* name() const override { return "CpuGreedy"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

std::vector<mx::array> greedy(const mx::array& x, mx::Stream s) {
  if (x.ndim() != 2 || x.shape(1) < 1) throw std::invalid_argument("[greedy] logits must be [B, V] with V >= 1");
  if (s.device != mx::Device::cpu || use_mlx_ops() || x.dtype() != mx::float32) return greedy_by_ops(x, s);
  return mx::array::make_arrays({{x.shape(0)}, {x.shape(0)}}, {mx::uint32, mx::float32}, std::make_shared<CpuGreedy>(s), {x});
}

// ---- log_softmax over the last axis of f32 [B, V]: x - logsumexp(x) with MLX's logsumexp rule
// (shift by the row's maximum, 0 where that is infinite), the exp sum vectorised
// (KernelSet::sum_exp).

class CpuLogSoftmax : public mx::UnaryPrimitive {
 public:
  explicit CpuLogSoftmax(mx::Stream s) : mx::UnaryPrimitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [](std::vector<mx::array>& in, mx::array& o) {
      const mx::array& x = in[0];
      const int b_n = int(x.shape(0)), v_n = int(x.shape(1));
      const auto& st = x.strides();
      const KernelSet& ks = cpu_kernels();
      std::vector<float> buf(static_cast<size_t>(v_n));
      float* dst = o.data<float>();
      for (int b = 0; b < b_n; b++) {
        const float* row = row_f32(x, b * st[0], st[1], v_n, buf);
        const float lse = row_lse(ks, row, v_n).lse;
        for (int i = 0; i < v_n; i++) dst[size_t(b) * v_n + i] = row[i] - lse;
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { throw std::runtime_error("[cpu_log_softmax] runs on the CPU only"); }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto s = stream();
    Fn op = [s](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::subtract(in[0], mx::logsumexp(in[0], -1, true, s), s)};
    };
    return vjp_of(op, primals, cotangents, argnums);
  }
  const char* name() const override { return "CpuLogSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array log_softmax(const mx::array& x, mx::Stream s) {
  if (x.ndim() != 2 || x.shape(1) < 1 || s.device != mx::Device::cpu || use_mlx_ops() || x.dtype() != mx::float32)
    return mx::subtract(x, mx::logsumexp(x, -1, true, s), s);
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuLogSoftmax>(s), {x});
}

// ---- Nucleus (top-p) filter: per row of f32 logits [B, V], entries below the least likely of
// the smallest most-likely set whose mass reaches p * total become -inf (ties at that value are
// kept): mlx-lm's apply_top_p, with the masses summed from the most likely down as its reverse
// cumsum does, but without sorting the row. The most likely entries are found in growing
// batches (nth_element, then a sort of the batch) until their mass reaches p * total.

mx::array nucleus_by_ops(const mx::array& x, float p, mx::Stream s) {
  const int v = x.shape(-1);
  auto sorted = mx::sort(x, -1, s);
  auto probs = mx::exp(mx::subtract(sorted, mx::slice(sorted, {0, v - 1}, {x.shape(0), v}, s), s), s);
  auto above = mx::cumsum(probs, -1, true, false, s);
  auto total = mx::sum(probs, -1, true, s);
  auto dropped = mx::sum(mx::astype(mx::greater_equal(above, mx::multiply(total, mx::array(p), s), s), mx::uint32, s), -1, true, s);
  auto thr = mx::take_along_axis(sorted, dropped, -1, s);
  return mx::where(mx::less(x, thr, s), mx::array(-std::numeric_limits<float>::infinity(), x.dtype()), x, s);
}

class CpuNucleus : public mx::UnaryPrimitive {
 public:
  CpuNucleus(mx::Stream s, float p) : mx::UnaryPrimitive(s), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [p = p_](std::vector<mx::array>& in, mx::array& o) {
      const mx::array& x = in[0];
      const int b_n = int(x.shape(0)), v_n = int(x.shape(1));
      const auto& st = x.strides();
      const KernelSet& ks = cpu_kernels();
      std::vector<float> buf(static_cast<size_t>(v_n)), e(static_cast<size_t>(v_n));
      std::vector<std::pair<float, int>> cand;
      const float ninf = -std::numeric_limits<float>::infinity();
      float* dst = o.data<float>();
      for (int b = 0; b < b_n; b++) {
        const float* row = row_f32(x, b * st[0], st[1], v_n, buf);
        float m;
        int at;
        ks.max_index(row, v_n, &m, &at);
        float thr = ninf;  // keep everything unless a cut is found
        if (std::isfinite(m)) {
          const float total = ks.exp_store(row, v_n, m, e.data());
          const float target = total * p;
          // (value, index) pairs side by side: the partitions compare without gathering
          cand.clear();
          for (int i = 0; i < v_n; i++)
            if (row[i] > ninf) cand.push_back({row[i], i});
          const int n = int(cand.size());
          auto more_likely = [](const std::pair<float, int>& a, const std::pair<float, int>& c) {
            return a.first > c.first || (a.first == c.first && a.second < c.second);
          };
          float mass = 0.0f;  // of the entries before rank r, most likely first
          int done = 0;       // ranks sorted so far
          for (int want = std::min(n, 256);; want = std::min(n, want * 4)) {
            if (want < n) std::nth_element(cand.begin() + done, cand.begin() + want, cand.end(), more_likely);
            std::sort(cand.begin() + done, cand.begin() + want, more_likely);
            bool cut = false;
            for (int r = done; r < want; r++) {
              if (mass >= target) {  // rank r and below are dropped: the cut is at rank r - 1
                thr = cand[size_t(r - 1)].first;
                cut = true;
                break;
              }
              mass += e[size_t(cand[size_t(r)].second)];
            }
            done = want;
            if (cut || done >= n) break;
          }
        }
        for (int i = 0; i < v_n; i++) dst[size_t(b) * v_n + i] = row[i] < thr ? ninf : row[i];
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { throw std::runtime_error("[cpu_nucleus] runs on the CPU only"); }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&, const std::vector<int>&,
                             const std::vector<mx::array>&) override {
    throw std::invalid_argument("[cpu_nucleus] a nucleus filter has no gradient");
  }
  const char* name() const override { return "CpuNucleus"; }
  bool is_equivalent(const mx::Primitive& other) const override { return p_ == static_cast<const CpuNucleus&>(other).p_; }

 private:
  float p_;
};

mx::array nucleus(const mx::array& x, float p, mx::Stream s) {
  if (x.ndim() != 2 || x.shape(1) < 1) throw std::invalid_argument("[nucleus] logits must be [B, V] with V >= 1");
  if (!(p > 0.0f && p < 1.0f)) throw std::invalid_argument("[nucleus] p must be in (0, 1)");
  if (s.device != mx::Device::cpu || use_mlx_ops() || x.dtype() != mx::float32) return nucleus_by_ops(x, p, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuNucleus>(s, p), {x});
}

// ---- Attention of a few queries: out = softmax(scale * q k^T (+ causal)) v, grouped-query heads.

// Queries per call at most for the primitive (decode, speculative verification); more go to MLX.
constexpr int SDPA_MAX_QUERIES = 8;

// MLX's attention op, with the heads joined when `merge`.
mx::array sdpa_by_ops(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal, bool merge, mx::Stream s) {
  auto o = mx::fast::scaled_dot_product_attention(q, k, v, scale, causal ? "causal" : "", std::nullopt, std::nullopt, false, s);
  if (!merge) return o;
  return mx::reshape(mx::transpose(o, {0, 2, 1, 3}, s), {o.shape(0), o.shape(2), o.shape(1) * o.shape(3)}, s);
}

class CpuSdpa : public mx::UnaryPrimitive {
 public:
  // `merge`: the output is [B, L, Hq * Dv] (heads joined, as attention's output projection takes
  // it) instead of [B, Hq, L, Dv].
  CpuSdpa(mx::Stream s, float scale, bool causal, bool merge) : mx::UnaryPrimitive(s), scale_(scale), causal_(causal), merge_(merge) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [scale = scale_, causal = causal_, merge = merge_](std::vector<mx::array>& in, mx::array& o) {
      const mx::array &q = in[0], &k = in[1], &v = in[2];
      const int b_n = int(q.shape(0)), hq = int(q.shape(1)), l_n = int(q.shape(2)), d = int(q.shape(3));
      const int hkv = int(k.shape(1)), s_n = int(k.shape(2)), dv = int(v.shape(3));
      const int rep = hq / hkv;
      const auto& qs = q.strides();
      const auto& ks = k.strides();
      const auto& vs = v.strides();
      // MLX's fallback in dtype t: q scaled (and rounded), scores rounded, softmax in f32 rounded,
      // the weighted sum rounded; all identity for f32.
      const mx::Dtype t = q.dtype();
      const bool f32 = t == mx::float32;
      const float sc_t = rnd(scale, t);
      const size_t du = static_cast<size_t>(d), dvu = static_cast<size_t>(dv);
      const KernelSet& ks_ = cpu_kernels();
      const bool rows_f32 = f32 && k.dtype() == mx::float32 && v.dtype() == mx::float32 && ks[3] == 1 && vs[3] == 1 && o.dtype() == mx::float32;
      // One unit is one (batch, query head) pair; the heads of a K/V head are consecutive units,
      // so a chunk of units reads each K/V row it needs while it is in cache.
      const int units = b_n * hq;
      const int64_t work = int64_t(l_n) * s_n * (d + dv);
      const int min_units = int(std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work)));
      parallel_for(units, min_units, [&](int u0, int u1) {
        std::vector<float> qrow(du), p(static_cast<size_t>(std::max(1, s_n))), acc(dvu), krow(du), vrow(dvu);
        for (int u = u0; u < u1; u++) {
          const int b = u / hq, h = u % hq;
          const int kh = h / rep;
          const int64_t kb = b * ks[0] + kh * ks[1], vb = b * vs[0] + kh * vs[1];
          for (int l = 0; l < l_n; l++) {
            load_f32(q, b * qs[0] + h * qs[1] + l * qs[2], qs[3], d, qrow.data());
            for (auto& e : qrow) e = rnd(sc_t * e, t);
            const int lim = causal ? s_n - l_n + l + 1 : s_n;
            if (rows_f32) {  // f32 rows read in place: one kernel call for the whole row
              ks_.attend(qrow.data(), k.data<float>() + kb, ks[2], v.data<float>() + vb, vs[2], lim, d, dv, p.data(), acc.data());
              const size_t at = merge ? (size_t(b) * l_n + l) * hq + h : (size_t(b) * hq + h) * l_n + l;
              store(o, at * dvu, acc.data(), dvu);
              continue;
            }
            float mx_s = -std::numeric_limits<float>::infinity();
            for (int j = 0; j < lim; j++) {
              const float sc = rnd(ks_.dot(qrow.data(), row_f32(k, kb + int64_t(j) * ks[2], ks[3], d, krow), d), t);
              p[size_t(j)] = sc;
              mx_s = std::max(mx_s, sc);
            }
            float sum = 0.0f;
            for (int j = 0; j < lim; j++) {
              p[size_t(j)] = std::exp(p[size_t(j)] - mx_s);
              sum += p[size_t(j)];
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            const float inv = 1.0f / sum;
            for (int j = 0; j < lim; j++) {
              const float w = f32 ? p[size_t(j)] * inv : rnd(p[size_t(j)] / sum, t);
              ks_.axpy(w, row_f32(v, vb + int64_t(j) * vs[2], vs[3], dv, vrow), acc.data(), dv);
            }
            for (auto& e : acc) e = rnd(e, t);
            const size_t at = merge ? (size_t(b) * l_n + l) * hq + h : (size_t(b) * hq + h) * l_n + l;
            store(o, at * dvu, acc.data(), dvu);
          }
        }
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { throw std::runtime_error("[cpu_sdpa] runs on the CPU only"); }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto s = stream();
    Fn op = [scale = scale_, causal = causal_, merge = merge_, s](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{sdpa_by_ops(in[0], in[1], in[2], scale, causal, merge, s)};
    };
    return vjp_of(op, primals, cotangents, argnums);
  }
  const char* name() const override { return "CpuSdpa"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuSdpa&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && merge_ == o.merge_;
  }

 private:
  float scale_;
  bool causal_, merge_;
};

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal, bool merge, mx::Stream s) {
  bool ok = s.device == mx::Device::cpu && !use_mlx_ops() && q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && float_dtype(q) &&
            k.dtype() == q.dtype() && v.dtype() == q.dtype();
  if (ok) {
    const int l = int(q.shape(2)), n = int(k.shape(2));
    ok = l >= 1 && l <= SDPA_MAX_QUERIES && n >= 1 && (!causal || l <= n) && q.shape(0) == k.shape(0) && v.shape(0) == q.shape(0) &&
         k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 && v.shape(1) == k.shape(1) && v.shape(2) == n && k.shape(3) == q.shape(3);
  }
  if (!ok) return sdpa_by_ops(q, k, v, scale, causal, merge, s);
  mx::Shape shape = merge ? mx::Shape{q.shape(0), q.shape(2), q.shape(1) * v.shape(3)} : mx::Shape{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  return mx::array(std::move(shape), q.dtype(), std::make_shared<CpuSdpa>(s, scale, causal, merge), {q, k, v});
}

}  // namespace
}  // namespace mlxm

extern "C" {

// Enter (`enter` true) or leave a scope on this thread in which the functions below build MLX's
// own ops (see use_mlx_ops). Scopes nest.
void mlx_models_mlx_ops_only(bool enter) { mlxm::mlx_ops_scopes += enter ? 1 : -1; }

// Whether graph nodes built now on this thread take MLX's own ops (inside a scope above or while
// MLX traces a function transform): callers of the CUDA kernels (cuda_ops.cpp) step aside then.
bool mlx_models_uses_mlx_ops() { return mlxm::use_mlx_ops(); }

// The rotation of mlx_models_rope and mlx_models_heads.
struct mlx_models_rope_args {
  int dims;
  bool traditional;
  bool has_base;  // else the frequencies array gives the wavelengths
  float base;
  float scale;
  int offset;
};

// Attention's q, k, v heads (`mlxm::heads`): `x0`, `x1`, `x2` the projection outputs [B, L, C]
// (`x1`/`x2` empty when the heads come from fewer arrays; outputs past `n_out` are left unset),
// head `i` from input `input[i]` at column `col[i]` with `heads[i]` heads, rotated when
// `rotate[i]` by `rope` (as mlx_models_rope).
int mlx_models_heads(mlx_array* out0, mlx_array* out1, mlx_array* out2, const mlx_array x0, const mlx_array x1,
                     const mlx_array x2, int n_out, const int* input, const int* col, const int* heads, const bool* rotate,
                     int head_dim, const mlx_models_rope_args* rope, const mlx_array freqs, const mlx_stream s) {
  try {
    std::vector<mx::array> xs{mlx_array_get_(x0)};
    if (x1.ctx) xs.push_back(mlx_array_get_(x1));
    if (x2.ctx) xs.push_back(mlx_array_get_(x2));
    if (n_out < 1 || n_out > 3) throw std::invalid_argument("[heads] 1 to 3 outputs");
    std::vector<mlxm::Head> spec;
    for (int i = 0; i < n_out; i++) spec.push_back({input[i], col[i], heads[i], rotate[i]});
    mlxm::RopeArgs r{rope->dims, rope->traditional, std::nullopt, rope->scale, rope->offset};
    if (rope->has_base) r.base = rope->base;
    auto outs = mlxm::heads(std::move(xs), std::move(spec), head_dim, r, freqs.ctx ? &mlx_array_get_(freqs) : nullptr,
                            mlx_stream_get_(s));
    mlx_array* res[3] = {out0, out1, out2};
    for (size_t i = 0; i < outs.size(); i++) mlx_array_set_(*res[i], outs[i]);
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

// x - logsumexp(x) over the last axis: one primitive for f32 [B, V] on a CPU stream, MLX's ops
// otherwise.
int mlx_models_log_softmax(mlx_array* res, const mlx_array x, const mlx_stream s) {
  return mlxm::guarded(res, [&] { return mlxm::log_softmax(mlx_array_get_(x), mlx_stream_get_(s)); });
}

// The nucleus (top-p) filter of logits x [B, V], 0 < p < 1 (mlx-lm's apply_top_p): one primitive
// for f32 on a CPU stream, MLX's ops (a sort) otherwise.
int mlx_models_nucleus(mlx_array* res, const mlx_array x, float p, const mlx_stream s) {
  return mlxm::guarded(res, [&] { return mlxm::nucleus(mlx_array_get_(x), p, mlx_stream_get_(s)); });
}

// Per row of logits x [B, V]: the first index of the largest value (u32 [B]) and its log-probability
// x[t] - logsumexp(x) ([B], x's dtype): one primitive for f32 on a CPU stream, MLX's ops otherwise.
int mlx_models_greedy(mlx_array* tokens, mlx_array* logprobs, const mlx_array x, const mlx_stream s) {
  try {
    auto outs = mlxm::greedy(mlx_array_get_(x), mlx_stream_get_(s));
    mlx_array_set_(*tokens, outs[0]);
    mlx_array_set_(*logprobs, outs[1]);
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

// The primitives an evaluation of `xs[0..n]` would run: the distinct unevaluated arrays with a
// primitive reachable from them (the outputs of one multi-output primitive counted once), written
// to `out` (capacity `cap`, NUL-terminated, truncated to fit) as "Name count" pairs, one a line,
// most frequent first. Returns the total, or -1 on error.
long long mlx_models_graph_nodes(const mlx_array* xs, int n, char* out, size_t cap) {
  try {
    std::unordered_set<std::uintptr_t> seen;
    std::unordered_map<std::string, long long> by_name;
    std::vector<mx::array> stack;
    for (int i = 0; i < n; i++) stack.push_back(mlx_array_get_(xs[i]));
    long long total = 0;
    while (!stack.empty()) {
      mx::array a = std::move(stack.back());
      stack.pop_back();
      // a node is its primitive's output group: the outputs of one primitive (split) share
      // it, but so do the replays of a compiled function, whose nodes all hold the traced
      // primitive, so the group is told by its outputs' ids (the smallest)
      if (!a.has_primitive()) continue;
      auto node = a.id();
      for (auto& s : a.siblings()) node = std::min(node, s.id());
      if (!seen.insert(node).second) continue;
      total++;
      by_name[a.primitive().name()]++;
      for (auto& x : a.inputs()) stack.push_back(x);
    }
    std::vector<std::pair<std::string, long long>> rows(by_name.begin(), by_name.end());
    std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; });
    std::ostringstream os;
    for (auto& [name, c] : rows) os << name << " " << c << "\n";
    if (cap > 0) {
      auto t = os.str().substr(0, cap - 1);
      std::copy(t.begin(), t.end(), out);
      out[t.size()] = 0;
    }
    return total;
  } catch (std::exception& e) {
    mlx_error(e.what());
    return -1;
  }
}

// fast::rms_norm (`w` may be an empty array): one primitive for float input on a CPU stream.
int mlx_models_rms_norm(mlx_array* res, const mlx_array x, const mlx_array w, float eps, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    return mlxm::rms_norm(mlx_array_get_(x), w.ctx ? &mlx_array_get_(w) : nullptr, eps, mlx_stream_get_(s));
  });
}

// fast::rope at an integer offset (`r`; `freqs` when `r->has_base` is false, MLX's rule: one of
// the two). One primitive for float input on a CPU stream.
int mlx_models_rope(mlx_array* res, const mlx_array x, const mlx_models_rope_args* r, const mlx_array freqs, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    std::optional<float> b;
    if (r->has_base) b = r->base;
    return mlxm::rope(mlx_array_get_(x), r->dims, r->traditional, b, r->scale, r->offset, freqs.ctx ? &mlx_array_get_(freqs) : nullptr,
                      mlx_stream_get_(s));
  });
}

// fast::scaled_dot_product_attention without a mask array (no mask, or causal): one primitive for
// float inputs of one dtype with at most 8 queries on a CPU stream. `merge`: the output's heads joined,
// [B, L, Hq * Dv].
int mlx_models_sdpa(mlx_array* res, const mlx_array q, const mlx_array k, const mlx_array v, float scale, bool causal,
                    bool merge, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    return mlxm::sdpa(mlx_array_get_(q), mlx_array_get_(k), mlx_array_get_(v), scale, causal, merge, mlx_stream_get_(s));
  });
}
}
