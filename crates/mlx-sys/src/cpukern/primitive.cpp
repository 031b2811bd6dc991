// primitive.cpp: the products of kernels.h as an MLX primitive (`mlx::core::Primitive`), with a C
// entry point in mlx-c's conventions (status 0, else the message goes to mlx-c's error handler).
//
// `CpuPackedMatmul` computes y[.., n] = sum_k W[n, k] x[.., k] for W f32 or bf16 `[N, K]`, MLX affine
// 4/8-bit or mxfp4 (packed u32 `[N, K*bits/32]` with scales, and biases for affine), optionally
// per row with an expert index (W `[E, N, ..]`, row r uses W[idx[r]]: MoE expert products).
// It runs on the CPU only: eval_gpu throws, and the caller builds it on a CPU stream only.
#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dispatch.h"
#include "guarded.h"
#include "kernels.h"
#include "strided.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxm {
namespace {

// ---- instruction set, chosen once from cpuid (AMX is never used).

// The best set this CPU runs that is not above `f` ("" = the best). Sets from the widest down:
// avx512vnni (with VBMI), avx512, avx2, portable.
const KernelSet* pick(const std::string& f) {
  const int cap = f == "avx512" ? 1 : f == "avx2" ? 2 : f == "portable" ? 3 : 0;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool vnni = has512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (cap <= 0 && vnni) return &avx512vnni::set;
  if (cap <= 1 && has512) return &avx512::set;
  if (cap <= 2 && has2) return &avx2::set;
#endif
  (void)cap;
  return &portable::set;
}

// The widest instruction set this CPU supports; `set_isa` (mlx-array's `set_cpu_kernels_isa`)
// lowers it.
const KernelSet* detect() { return pick(""); }

std::atomic<const KernelSet*>& current() {
  static std::atomic<const KernelSet*> k{detect()};
  return k;
}

const KernelSet& kernels() { return *current().load(std::memory_order_relaxed); }

// ---- threads: the BLAS path's policy (OpenBLAS): OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS,
// else every hardware thread. The calling thread takes a share; workers spin briefly between
// products (a decode step runs hundreds back to back), then sleep.

int env_threads(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  int n = std::atoi(v);
  return n > 0 ? n : 0;
}

int thread_count() {
  static const int n = [] {
    int t = env_threads("OPENBLAS_NUM_THREADS");
    if (!t) t = env_threads("OMP_NUM_THREADS");
    if (!t) t = int(std::thread::hardware_concurrency());
    return std::clamp(t, 1, 256);
  }();
  return n;
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; i++) threads_.emplace_back([this, i] { loop(i + 1); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return int(threads_.size()) + 1; }

  // Run f(part) for part in [0, parts) over the pool and the calling thread.
  void run(int parts, const std::function<void(int)>& f) {
    if (parts <= 1 || threads_.empty()) {
      for (int p = 0; p < parts; p++) f(p);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mu_);
    // Parts are claimed from `next_`, which carries this run's number in its high half. Before
    // this run's job and part count are written, `next_` moves to this run's number with no
    // claimable part: a worker still leaving the previous run holds that run's value of `next_`,
    // and its compare-exchange fails from here on. (Without this step such a worker could read
    // this run's larger part count, claim "part N" of the previous run, run this run's job with
    // it and count it done: the run returned while a part still ran on its stack.)
    run_id_++;
    next_.store(uint64_t(run_id_) << 32 | 0xffffffffu, std::memory_order_seq_cst);
    job_.store(&f, std::memory_order_relaxed);
    parts_.store(parts, std::memory_order_release);  // a worker that reads it has seen the blocker too
    done_.store(0, std::memory_order_relaxed);
    next_.store(uint64_t(run_id_) << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> g(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    while (done_.load(std::memory_order_acquire) < parts) pause();
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }
  void work() {
    uint64_t v = next_.load(std::memory_order_acquire);
    const uint64_t run = v >> 32;
    for (;;) {
      if ((v >> 32) != run || uint32_t(v) >= uint32_t(parts_.load(std::memory_order_acquire))) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      (*job_.load(std::memory_order_relaxed))(int(uint32_t(v)));
      done_.fetch_add(1, std::memory_order_release);
      v = next_.load(std::memory_order_acquire);
    }
  }
  void loop(int) {
    uint64_t seen = 0;
    for (;;) {
      // Spin a little for the next product, then sleep on the condition variable.
      int spins = 0;
      while (gen_.load(std::memory_order_acquire) == seen && spins < 4000) {
        pause();
        spins++;
      }
      if (gen_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return gen_.load() != seen; });
      }
      seen = gen_.load(std::memory_order_acquire);
      if (stop_) return;
      work();
    }
  }
  std::vector<std::thread> threads_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> next_{0};  // run number << 32 | next unclaimed part
  std::atomic<int> done_{0}, parts_{0};
  uint32_t run_id_ = 0;
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  bool stop_ = false;
};

Pool& pool() {
  // Leaked on purpose: worker threads must not be joined from static destructors at exit.
  static Pool* p = new Pool(thread_count() - 1);
  return *p;
}

// Split rows [0, total) into about `pool size * 4` chunks of at least `min_rows`.
void parallel_rows(int total, int min_rows, const std::function<void(int, int)>& f) {
  const int threads = pool().size();
  int chunks = std::min(threads * 4, std::max(1, total / std::max(1, min_rows)));
  if (threads == 1) chunks = 1;
  const int per = (total + chunks - 1) / chunks;
  chunks = (total + per - 1) / per;
  pool().run(chunks, [&](int c) {
    const int a = c * per;
    const int b = std::min(total, a + per);
    if (a < b) f(a, b);
  });
}

int stype_of(const mx::array& a) {
  switch (a.dtype()) {
    case mx::float32: return S_F32;
    case mx::bfloat16: return S_BF16;
    case mx::float16: return S_F16;
    case mx::uint8: return S_U8;
    default: throw std::invalid_argument("[cpu_packed_matmul] scales must be float32, bfloat16, float16 or uint8");
  }
}

int bits_of(int kind) { return kind == KIND_F32 ? 32 : kind == KIND_BF16 ? 16 : kind == KIND_AFFINE8 ? 8 : 4; }
bool is_float_kind(int kind) { return kind == KIND_BF16 || kind == KIND_F32; }

// Evaluate: x [..., K] (any float dtype and strides; R rows), W [.., N, K'] (row-contiguous),
// out f32/bf16/f16 [..., N] (R rows).
// With `glu`, W has 2N' rows and out[.., j] = silu(y[.., j]) * y[.., N' + j] (N' = N / 2).
void compute(int kind, int gs, const mx::array& x, const mx::array& w, const mx::array* scales,
             const mx::array* biases, const mx::array* idx, bool glu, mx::array& out) {
  const KernelSet& ks = kernels();
  const int K = int(x.shape(-1));
  const int R = int(x.size() / std::max<size_t>(1, size_t(K)));
  const int N = int(out.shape(-1)) * (glu ? 2 : 1);
  if (R == 0 || N == 0) return;
  for (const mx::array* a : {&w, scales, biases, idx})
    if (a && !a->flags().row_contiguous) throw std::invalid_argument("[cpu_packed_matmul] weights must be row-contiguous");
  // prepared rows start on 64-byte boundaries (the kernels' aligned vector loads)
  const size_t xps = (ks.xp_floats(kind, gs, K) + 15) / 16 * 16;
  std::vector<float> xpbuf(std::max<size_t>(1, xps * R) + 16);
  float* const xp0 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xpbuf.data()) + 63) & ~uintptr_t(63));
  std::vector<float> xbuf;
  const float* xd = rows_f32(x, xbuf);
  for (int r = 0; r < R; r++) ks.prep(kind, gs, xd + size_t(r) * K, K, xp0 + size_t(r) * xps);

  const bool f32_out = out.dtype() == mx::float32 && !glu;
  std::vector<float> tmp;
  float* y = f32_out ? out.data<float>() : (tmp.resize(size_t(R) * N), tmp.data());

  Job base{};
  base.kind = kind;
  base.N = N;
  base.K = K;
  base.gs = gs;
  base.stype = scales ? stype_of(*scales) : S_F32;
  base.xp_stride = xps;
  base.out_stride = size_t(N);

  const size_t w_words_per_row = size_t(K) * bits_of(kind) / 32;  // bf16: K/2 words (K even or not: bytes)
  const size_t w_bytes_per_row = kind == KIND_BF16 ? size_t(K) * 2 : w_words_per_row * 4;
  const size_t groups_per_row = is_float_kind(kind) ? 0 : size_t(K) / gs;
  const size_t s_size = scales ? mx::size_of(scales->dtype()) : 0;
  const char* wd = static_cast<const char*>(w.data<void>());
  const char* sd = scales ? static_cast<const char*>(scales->data<void>()) : nullptr;
  const char* bd = biases ? static_cast<const char*>(biases->data<void>()) : nullptr;
  // At least ~64K weights per chunk, so small products do not pay for waking threads.
  const int min_rows = std::max(1, int(65536 / std::max(1, K)));

  if (!idx) {
    Job j = base;
    j.M = R;
    j.w = wd;
    j.scales = sd;
    j.biases = bd;
    j.xp = xp0;
    j.x = xd;
    j.out = y;
    parallel_rows(N, std::max(4, min_rows / std::max(1, R)), [&](int a, int b) { ks.rows(j, a, b); });
  } else {
    // Row r: W[idx[r]] against x[r]. Units are (row, output) pairs, split in contiguous runs.
    const uint32_t* id = idx->data<uint32_t>();
    const int E = int(w.shape(0));
    const long total = long(R) * N;
    const int per_unit_rows = std::max(4, min_rows);
    const int units = int(std::min<long>(total, 1L << 30));
    parallel_rows(units, per_unit_rows, [&](int a, int b) {
      while (a < b) {
        const int r = a / N;
        const int n0 = a % N;
        const int n1 = std::min(N, n0 + (b - a));
        const size_t e = std::min<uint32_t>(id[r], uint32_t(E - 1));
        Job j = base;
        j.M = 1;
        j.w = wd + e * N * w_bytes_per_row;
        j.scales = sd ? sd + e * N * groups_per_row * s_size : nullptr;
        j.biases = bd ? bd + e * N * groups_per_row * s_size : nullptr;
        j.xp = xp0 + size_t(r) * xps;
        j.x = xd + size_t(r) * K;
        j.out = y + size_t(r) * N;
        ks.rows(j, n0, n1);
        a += n1 - n0;
      }
    });
  }
  if (glu) {
    // silu(g) * u as MLX computes it: (g * sigmoid(g)) * u, sigmoid = 1 / (1 + exp(-g))
    const int h = N / 2;
    for (int r = 0; r < R; r++) {
      float* yr = y + size_t(r) * N;
      float* dst = y + size_t(r) * h;  // in place: row r's outputs land at or before its inputs
      for (int j = 0; j < h; j++) {
        const float g = yr[j], u = yr[h + j];
        dst[j] = (g * (1.0f / (1.0f + std::exp(-g)))) * u;
      }
    }
    if (out.dtype() == mx::float32) {
      std::memcpy(out.data<float>(), y, size_t(R) * h * sizeof(float));
      return;
    }
  }
  if (!f32_out) {
    const size_t n = size_t(R) * (glu ? N / 2 : N);
    if (out.dtype() == mx::bfloat16) {
      auto* o = out.data<mx::bfloat16_t>();
      for (size_t i = 0; i < n; i++) o[i] = mx::bfloat16_t(y[i]);
    } else {
      auto* o = out.data<mx::float16_t>();
      for (size_t i = 0; i < n; i++) o[i] = mx::float16_t(y[i]);
    }
  }
}

// ---- dequantize: packed weights `[.., N, K*bits/32]` to f32 `[.., N, K]`, for the products of
// more rows than the kernels take (prefill), which run MLX's f32 matmul over it. MLX's own CPU
// dequantize is a graph of shifts, masks and broadcasts (about 40 nodes and as many full-size
// temporaries a weight); this is one pass writing each element once. Affine: scale * q + bias in
// f32 as two roundings (a product, then a sum: MLX's order; build.rs compiles this file with
// -ffp-contract=off), scales and biases of any float
// dtype converted exactly; mxfp4: e2m1(q) * 2^(e - 127).

float scale_at(const char* p, int stype, size_t i) {
  switch (stype) {
    case S_F32: return reinterpret_cast<const float*>(p)[i];
    case S_BF16: return float(reinterpret_cast<const mx::bfloat16_t*>(p)[i]);
    case S_F16: return float(reinterpret_cast<const mx::float16_t*>(p)[i]);
    default: return e8m0_to_f32(reinterpret_cast<const uint8_t*>(p)[i]);
  }
}

// One group of `gs` elements: `words` u32 words of BITS-bit codes, element t of a word at bits
// [t*BITS, (t+1)*BITS) (constant shifts, so the compiler vectorizes the loop over words).
template <int BITS>
void dequantize_group(const uint32_t* w, int words, float s, float b, float* o) {
  constexpr int E = 32 / BITS;
  constexpr uint32_t M = (1u << BITS) - 1;
  for (int i = 0; i < words; i++)
    for (int t = 0; t < E; t++) o[i * E + t] = s * float((w[i] >> (t * BITS)) & M) + b;  // -ffp-contract=off
}

void dequantize_group_fp4(const uint32_t* w, int words, float s, float* o) {
  for (int i = 0; i < words; i++)
    for (int t = 0; t < 8; t++) o[i * 8 + t] = FP4_VALUES[(w[i] >> (t * 4)) & 15u] * s;
}

void dequantize_rows(int kind, int gs, const mx::array& w, const mx::array& scales, const mx::array* biases,
                     mx::array& out) {
  const int K = int(out.shape(-1));
  const size_t rows = K > 0 ? out.size() / size_t(K) : 0;
  if (rows == 0) return;
  const int per_word = 32 / bits_of(kind);
  const int words = gs / per_word;  // a group's words
  const size_t groups = size_t(K) / gs;
  const int stype = stype_of(scales);
  const uint32_t* wd = w.data<uint32_t>();
  const char* sd = static_cast<const char*>(scales.data<void>());
  const char* bd = biases ? static_cast<const char*>(biases->data<void>()) : nullptr;
  float* od = out.data<float>();
  const int min_rows = std::max(1, int(65536 / std::max(1, K)));
  parallel_rows(int(rows), min_rows, [&](int r0, int r1) {
    for (size_t r = size_t(r0); r < size_t(r1); r++) {
      for (size_t g = 0; g < groups; g++) {
        const size_t at = r * groups + g;
        const uint32_t* wg = wd + at * words;
        float* og = od + at * size_t(gs);
        const float s = scale_at(sd, stype, at);
        if (kind == KIND_MXFP4) dequantize_group_fp4(wg, words, s, og);
        else if (kind == KIND_AFFINE4) dequantize_group<4>(wg, words, s, scale_at(bd, stype, at), og);
        else dequantize_group<8>(wg, words, s, scale_at(bd, stype, at), og);
      }
    }
  });
}

class CpuDequantize : public mx::UnaryPrimitive {
 public:
  CpuDequantize(mx::Stream s, int kind, int gs, bool has_biases)
      : mx::UnaryPrimitive(s), kind_(kind), gs_(gs), biases_(has_biases) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [kind = kind_, gs = gs_, b = biases_](std::vector<mx::array>& ins, mx::array& out) {
      dequantize_rows(kind, gs, ins[0], ins[1], b ? &ins[2] : nullptr, out);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[cpu_dequantize] runs on the CPU only");
  }
  const char* name() const override { return "CpuDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuDequantize&>(other);
    return kind_ == o.kind_ && gs_ == o.gs_ && biases_ == o.biases_;
  }

 private:
  int kind_, gs_;
  bool biases_;
};

class CpuPackedMatmul : public mx::UnaryPrimitive {
 public:
  CpuPackedMatmul(mx::Stream s, int kind, int gs, bool has_scales, bool has_biases, bool has_idx, bool glu = false)
      : mx::UnaryPrimitive(s), kind_(kind), gs_(gs), scales_(has_scales), biases_(has_biases), idx_(has_idx), glu_(glu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [kind = kind_, gs = gs_, s = scales_, b = biases_, i = idx_, glu = glu_](
                                        std::vector<mx::array>& ins, mx::array& out) {
      int at = 2;
      const mx::array* sc = s ? &ins[at++] : nullptr;
      const mx::array* bi = b ? &ins[at++] : nullptr;
      const mx::array* id = i ? &ins[at++] : nullptr;
      compute(kind, gs, ins[0], ins[1], sc, bi, id, glu, out);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[cpu_packed_matmul] runs on the CPU only");
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override;
  const char* name() const override { return "CpuPackedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuPackedMatmul&>(other);
    return kind_ == o.kind_ && gs_ == o.gs_ && scales_ == o.scales_ && biases_ == o.biases_ && idx_ == o.idx_ && glu_ == o.glu_;
  }

 private:
  int kind_, gs_;
  bool scales_, biases_, idx_, glu_;
};

const char* mode_name(int kind) { return kind == KIND_MXFP4 ? "mxfp4" : "affine"; }

// The float weight as `[.., N, K]` f32, from MLX's own ops (for gradients).
mx::array float_weight(int kind, int gs, const std::vector<mx::array>& p, bool has_b, mx::Stream s) {
  if (is_float_kind(kind)) return mx::astype(p[1], mx::float32, s);
  std::optional<mx::array> b;
  if (has_b) b = p[3];
  return mx::dequantize(p[1], p[2], b, gs, bits_of(kind), mode_name(kind), std::nullopt, mx::float32, s);
}

std::vector<mx::array> CpuPackedMatmul::vjp(const std::vector<mx::array>& primals,
                                            const std::vector<mx::array>& cotangents,
                                            const std::vector<int>& argnums, const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int a : argnums) {
    if (a == 1 && is_float_kind(kind_) && !idx_ && !glu_) {
      // a float weight [N, K]: dW = cot^T x over the rows
      auto s = stream();
      const int K = int(primals[0].shape(-1)), N = int(primals[1].shape(0));
      auto x2 = mx::reshape(mx::astype(primals[0], mx::float32, s), {-1, K}, s);
      auto c2 = mx::reshape(mx::astype(cotangents[0], mx::float32, s), {-1, N}, s);
      grads.push_back(mx::astype(mx::matmul(mx::transpose(c2, s), x2, s), primals[1].dtype(), s));
      continue;
    }
    if (a != 0) throw std::invalid_argument("[cpu_packed_matmul] gradients flow to the input only, not to packed weights or gated products' weights");
    if (idx_) throw std::invalid_argument("[cpu_packed_matmul] no gradient for expert-indexed products");
    // x [R, K] f32, cotangent [R, N]: dx = cot @ W.
    auto s = stream();
    auto w = float_weight(kind_, gs_, primals, biases_, s);
    if (glu_) {
      // through MLX's ops: y = x W^T, out = silu(y[.., :N']) * y[.., N':]
      auto f = [w, s](const std::vector<mx::array>& in) {
        auto y = mx::matmul(mx::astype(in[0], mx::float32, s), mx::transpose(w, s), s);
        auto parts = mx::split(y, 2, -1, s);
        auto g = parts[0];
        return std::vector<mx::array>{mx::multiply(mx::multiply(g, mx::sigmoid(g, s), s), parts[1], s)};
      };
      auto dx = mx::vjp(f, {primals[0]}, {mx::astype(cotangents[0], mx::float32, s)}).second[0];
      grads.push_back(mx::astype(dx, primals[0].dtype(), s));
      continue;
    }
    auto g = mx::matmul(mx::astype(cotangents[0], mx::float32, s), w, s);
    grads.push_back(mx::astype(g, primals[0].dtype(), s));
  }
  return grads;
}

void check(bool ok, const std::string& msg, const char* op = "cpu_packed_matmul") {
  if (!ok) throw std::invalid_argument("[" + std::string(op) + "] " + msg);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < a.ndim(); i++) o << (i ? ", " : "") << a.shape(int(i));
  o << "]";
  return o.str();
}

// Validate and build the graph node: y[..., N] = x[..., K] W^T.
mx::array build(const mx::array& x0, const mx::array& w0, const mx::array* scales0, const mx::array* biases0,
                const mx::array* idx0, int kind, int gs, mx::Stream s, bool glu = false) {
  check(s.device == mx::Device::cpu, "runs on a CPU stream only");
  check(kind >= KIND_BF16 && kind <= KIND_F32, "unknown weight kind");
  check(x0.ndim() >= 1, "0-d input");
  check(mx::issubdtype(x0.dtype(), mx::floating), "input must be a float array");
  const int K = int(x0.shape(-1));
  check(K > 0, "input has no features");
  const int wdims = idx0 ? 3 : 2;
  check(int(w0.ndim()) == wdims, "weight must be " + std::string(idx0 ? "[E, N, K']" : "[N, K']") + ", got " + shape_str(w0));
  const int N = int(w0.shape(-2));
  mx::Dtype out_t = x0.dtype();
  if (is_float_kind(kind)) {
    if (kind == KIND_BF16) check(w0.dtype() == mx::bfloat16, "bf16 kind needs a bfloat16 weight");
    else check(w0.dtype() == mx::float32, "f32 kind needs a float32 weight");
    check(int(w0.shape(-1)) == K, "weight has " + std::to_string(w0.shape(-1)) + " columns, input has " + std::to_string(K) + " features");
    check(!scales0 && !biases0, "float weights take no scales or biases");
  } else {
    check(w0.dtype() == mx::uint32, "packed weights must be uint32");
    const int bits = bits_of(kind);
    if (kind == KIND_MXFP4) check(gs == 32, "mxfp4 uses groups of 32");
    else check(gs == 32 || gs == 64 || gs == 128, "group size must be 32, 64 or 128");
    check(K % gs == 0, "input features " + std::to_string(K) + " are not a multiple of the group size " + std::to_string(gs));
    check(int64_t(w0.shape(-1)) * 32 == int64_t(K) * bits,
          "packed weight has " + std::to_string(w0.shape(-1)) + " words a row, " + std::to_string(K) + " features need " + std::to_string(K * bits / 32));
    check(scales0 != nullptr, "quantized weights need scales");
    auto want = w0.shape();
    want.back() = K / gs;
    check(scales0->shape() == want, "scales " + shape_str(*scales0) + " do not match the weight " + shape_str(w0));
    if (kind == KIND_MXFP4) {
      check(scales0->dtype() == mx::uint8, "mxfp4 scales must be uint8 (E8M0)");
      check(!biases0, "mxfp4 takes no biases");
    } else {
      check(biases0 != nullptr, "affine quantization needs biases");
      check(scales0->dtype() == mx::float32 || scales0->dtype() == mx::bfloat16 || scales0->dtype() == mx::float16,
            "scales must be float32, bfloat16 or float16");
      check(biases0->dtype() == scales0->dtype(), "biases must have the scales' dtype");
      check(biases0->shape() == scales0->shape(), "biases must have the scales' shape");
      out_t = mx::promote_types(out_t, scales0->dtype());
    }
  }
  check(out_t == mx::float32 || out_t == mx::bfloat16 || out_t == mx::float16, "output dtype must be float32, bfloat16 or float16");

  // Weights already evaluated and row-contiguous (a loaded model's) are taken as they are: no
  // graph node per product for them. The input is read in any float dtype and layout.
  auto as_is = [&](const mx::array& a) { return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, s); };
  std::vector<mx::array> inputs;
  mx::Shape out_shape;
  check(!glu || (!idx0 && N % 2 == 0), "a gated product needs an even number of weight rows and no expert index");
  if (!idx0) {
    out_shape = x0.shape();
    out_shape.back() = glu ? N / 2 : N;
    inputs.push_back(x0);
    inputs.push_back(as_is(w0));
    if (scales0) inputs.push_back(as_is(*scales0));
    if (biases0) inputs.push_back(as_is(*biases0));
    return mx::array(std::move(out_shape), out_t,
                     std::make_shared<CpuPackedMatmul>(s, kind, gs, scales0 != nullptr, biases0 != nullptr, false, glu),
                     std::move(inputs));
  } else {
    // x [..., 1, K] with idx [...] (broadcast together): out [..., 1, N].
    check(mx::issubdtype(idx0->dtype(), mx::integer), "expert indices must be integers");
    check(x0.ndim() >= 2 && x0.shape(-2) == 1, "expert-indexed input must be [..., 1, K]");
    mx::Shape xb(x0.shape().begin(), x0.shape().end() - 2);
    auto bshape = mx::broadcast_shapes(xb, idx0->shape());
    int64_t R = 1;
    for (auto d : bshape) R *= d;
    mx::Shape xfull = bshape;
    xfull.push_back(1);
    xfull.push_back(K);
    auto xr = mx::reshape(mx::broadcast_to(x0, xfull, s), {int(R), K}, s);
    inputs.push_back(mx::contiguous(mx::astype(xr, mx::float32, s), false, s));
    out_shape = bshape;
    out_shape.push_back(1);
    out_shape.push_back(N);
  }
  inputs.push_back(as_is(w0));
  if (scales0) inputs.push_back(as_is(*scales0));
  if (biases0) inputs.push_back(as_is(*biases0));
  if (idx0) {
    auto bshape = mx::broadcast_shapes(mx::Shape(x0.shape().begin(), x0.shape().end() - 2), idx0->shape());
    int64_t R = 1;
    for (auto d : bshape) R *= d;
    inputs.push_back(mx::contiguous(mx::reshape(mx::astype(mx::broadcast_to(*idx0, bshape, s), mx::uint32, s), {int(R)}, s), false, s));
  }
  int64_t rows = inputs[0].shape(0);
  mx::Shape flat_out = {int(rows), N};
  auto y = mx::array(flat_out, out_t,
                     std::make_shared<CpuPackedMatmul>(s, kind, gs, scales0 != nullptr, biases0 != nullptr, idx0 != nullptr),
                     std::move(inputs));
  return mx::reshape(y, out_shape, s);
}


// Validate and build the graph node: W `[.., N, K*bits/32]` packed as f32 `[.., N, K]`.
mx::array build_dequantize(const mx::array& w0, const mx::array& scales0, const mx::array* biases0, int kind, int gs,
                           mx::Stream s) {
  auto fail = [](bool ok, const std::string& msg) { check(ok, msg, "cpu_dequantize"); };
  fail(s.device == mx::Device::cpu, "runs on a CPU stream only");
  fail(kind == KIND_AFFINE4 || kind == KIND_AFFINE8 || kind == KIND_MXFP4, "unknown packed weight kind");
  fail(w0.ndim() >= 1 && w0.dtype() == mx::uint32, "packed weights must be uint32 with at least one axis, got " + shape_str(w0));
  const int bits = bits_of(kind);
  if (kind == KIND_MXFP4) fail(gs == 32, "mxfp4 uses groups of 32");
  else fail(gs == 32 || gs == 64 || gs == 128, "group size must be 32, 64 or 128");
  const int64_t K = int64_t(w0.shape(-1)) * 32 / bits;
  fail(K > 0 && K % gs == 0, "rows of " + std::to_string(K) + " elements are not whole groups of " + std::to_string(gs));
  auto want = w0.shape();
  want.back() = int(K / gs);
  fail(scales0.shape() == want, "scales " + shape_str(scales0) + " do not match the weight " + shape_str(w0));
  if (kind == KIND_MXFP4) {
    fail(scales0.dtype() == mx::uint8, "mxfp4 scales must be uint8 (E8M0)");
    fail(!biases0, "mxfp4 takes no biases");
  } else {
    fail(biases0 != nullptr, "affine quantization needs biases");
    fail(scales0.dtype() == mx::float32 || scales0.dtype() == mx::bfloat16 || scales0.dtype() == mx::float16,
         "scales must be float32, bfloat16 or float16");
    fail(biases0->dtype() == scales0.dtype() && biases0->shape() == scales0.shape(), "biases must have the scales' dtype and shape");
  }
  auto as_is = [&](const mx::array& a) { return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, s); };
  std::vector<mx::array> inputs{as_is(w0), as_is(scales0)};
  if (biases0) inputs.push_back(as_is(*biases0));
  auto out_shape = w0.shape();
  out_shape.back() = int(K);
  return mx::array(std::move(out_shape), mx::float32, std::make_shared<CpuDequantize>(s, kind, gs, biases0 != nullptr),
                   std::move(inputs));
}

}  // namespace

const KernelSet& cpu_kernels() { return kernels(); }
void parallel_for(int total, int min_rows, const std::function<void(int, int)>& f) { parallel_rows(total, min_rows, f); }

}  // namespace mlxm

extern "C" {

// res = x @ W^T over packed weights on the CPU stream `s` (see build() for the forms). `scales`,
// `biases` and `idx` may be empty arrays (null ctx). Returns 0, or 1 after reporting the error.
int mlx_models_cpu_packed_matmul(mlx_array* res, const mlx_array x, const mlx_array w, const mlx_array scales,
                                 const mlx_array biases, const mlx_array idx, int kind, int group_size,
                                 const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    const mx::array* sc = scales.ctx ? &mlx_array_get_(scales) : nullptr;
    const mx::array* bi = biases.ctx ? &mlx_array_get_(biases) : nullptr;
    const mx::array* id = idx.ctx ? &mlx_array_get_(idx) : nullptr;
    return mlxm::build(mlx_array_get_(x), mlx_array_get_(w), sc, bi, id, kind, group_size, mlx_stream_get_(s));
  });
}

// res = W dequantized to f32 on the CPU stream `s` (kinds 1-3: affine 4/8-bit, mxfp4); `biases`
// may be an empty array (null ctx). Returns 0, or 1 after reporting the error.
int mlx_models_cpu_dequantize(mlx_array* res, const mlx_array w, const mlx_array scales, const mlx_array biases,
                              int kind, int group_size, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    const mx::array* bi = biases.ctx ? &mlx_array_get_(biases) : nullptr;
    return mlxm::build_dequantize(mlx_array_get_(w), mlx_array_get_(scales), bi, kind, group_size, mlx_stream_get_(s));
  });
}

// silu(x @ Wg^T) * (x @ Wu^T) for W = [Wg; Wu] (2N rows, N outputs), the same forms as
// mlx_models_cpu_packed_matmul without `idx`.
int mlx_models_cpu_packed_swiglu(mlx_array* res, const mlx_array x, const mlx_array w, const mlx_array scales,
                                 const mlx_array biases, int kind, int group_size, const mlx_stream s) {
  return mlxm::guarded(res, [&] {
    const mx::array* sc = scales.ctx ? &mlx_array_get_(scales) : nullptr;
    const mx::array* bi = biases.ctx ? &mlx_array_get_(biases) : nullptr;
    return mlxm::build(mlx_array_get_(x), mlx_array_get_(w), sc, bi, nullptr, kind, group_size, mlx_stream_get_(s), true);
  });
}

// The instruction set the kernels use in this process ("avx512vnni", "avx512", "avx2" or
// "portable"), and the number of threads a product uses.
const char* mlx_models_cpu_kernels_isa(void) { return mlxm::kernels().name; }
int mlx_models_cpu_kernels_threads(void) { return mlxm::thread_count(); }

// Use `name`'s kernels from now on ("avx512vnni", "avx512", "avx2", "portable"); returns the set now in use,
// which is a lower one when this CPU lacks `name`'s instructions.
const char* mlx_models_cpu_kernels_select(const char* name) {
  const mlxm::KernelSet* k = mlxm::pick(name ? name : "");
  mlxm::current().store(k);
  return k->name;
}
}
