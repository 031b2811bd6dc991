// kernels.h: matrix-vector / small-M products over f32, bf16 and MLX-quantized weights (CPU).
//
// kernels.cpp is compiled once per instruction set (AVX-512 with VNNI, AVX-512, AVX2+FMA, portable
// C++), each copy in its own namespace (KERN_NS); primitive.cpp picks one at run time from cpuid.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

namespace mlxm {

// Shared by kernels.cpp's copies and primitive.cpp, which are compiled for different instruction
// sets: internal linkage, so that each translation unit keeps its own compiled copy (an inline
// definition would let the linker pick one for all).

// The E2M1 (mxfp4) values of the 16 codes.
alignas(64) constexpr float FP4_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// An E8M0 scale: 2^(e - 127); e = 0 is 2^-127 (a subnormal), e = 255 is +inf.
static inline float e8m0_to_f32(uint8_t e) {
  uint32_t u = e == 0 ? 0x00400000u : uint32_t(e) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Weight formats.
enum Kind : int {
  KIND_BF16 = 0,     // bf16 [N, K]
  KIND_AFFINE4 = 1,  // MLX affine 4-bit: u32 [N, K/8], scales/biases [N, K/gs]
  KIND_AFFINE8 = 2,  // MLX affine 8-bit: u32 [N, K/4], scales/biases [N, K/gs]
  KIND_MXFP4 = 3,    // OCP MX FP4 (E2M1), u32 [N, K/8], u8 E8M0 scales [N, K/32]
  KIND_F32 = 4,      // f32 [N, K]
};

// Element type of scales and biases.
enum SType : int { S_F32 = 0, S_BF16 = 1, S_F16 = 2, S_U8 = 3 };

// One product out[m, n] = sum_k W[n, k] x[m, k] for m < M, n in a row range.
struct Job {
  int kind;
  int M, N, K;
  int gs;  // group size (quantized kinds)
  const void* w;
  const void* scales;
  const void* biases;  // affine only
  int stype;
  const float* xp;  // prepared x, M rows of xp_stride floats (KernelSet::prep), 64-byte aligned
  size_t xp_stride;  // a multiple of 16
  const float* x;  // x itself, f32 [M, K]
  float* out;      // f32, row m at out + m * out_stride
  size_t out_stride;
};

// The vector-width-dependent half of a kernel set.
struct KernelSet {
  const char* name;
  // Floats of prepared x per row (xp_stride) for group size gs (quantized kinds).
  size_t (*xp_floats)(int kind, int gs, int K);
  // Prepare one row of x.
  void (*prep)(int kind, int gs, const float* x, int K, float* xp);
  // Rows [n0, n1) of the product.
  void (*rows)(const Job& j, int n0, int n1);
  // sum_i a[i] b[i] over n floats (attention scores).
  float (*dot)(const float* a, const float* b, int n);
  // y[i] += a x[i] over n floats (attention's weighted sum of values).
  void (*axpy)(float a, const float* x, float* y, int n);
  // The largest of n >= 1 floats (NaN never wins; -inf when all are NaN) and the first index
  // holding it.
  void (*max_index)(const float* x, int n, float* max, int* index);
  // sum_i exp(x[i] - shift) over n floats, with x[i] - shift <= 0 (a polynomial exp within 2
  // ulp; arguments below -87.3 count as exp(-87.3), about 1e-38).
  float (*sum_exp)(const float* x, int n, float shift);
  // sum_exp that also stores each exp(x[i] - shift) in out[i].
  float (*exp_store)(const float* x, int n, float shift, float* out);
  // One query row of attention over n >= 1 keys: out[0, dv) = sum_j softmax_j(q . k_j) v_j, q
  // already scaled, key j's d floats at k + j * ks, value j's dv floats at v + j * vs; p is
  // scratch for n floats.
  void (*attend)(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int n, int d, int dv, float* p,
                 float* out);
};

// The set chosen for this CPU (primitive.cpp), and `f(a, b)` over chunks of rows [0, total) of at
// least `min_rows` on the products' thread pool.
const KernelSet& cpu_kernels();
void parallel_for(int total, int min_rows, const std::function<void(int, int)>& f);

namespace avx512vnni { extern const KernelSet set; }
namespace avx512 { extern const KernelSet set; }
namespace avx2 { extern const KernelSet set; }
namespace portable { extern const KernelSet set; }

}  // namespace mlxm
