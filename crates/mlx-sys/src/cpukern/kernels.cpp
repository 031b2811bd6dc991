// kernels.cpp: the products of kernels.h over one vector abstraction `V`, compiled once per
// instruction set: with -mavx512f -mavx512bw -mavx512vl -mavx512dq and -mavx512vnni -mavx512vbmi
// (KERN_NS=avx512vnni: integer products for the quantized kinds, below), without those two
// (KERN_NS=avx512), with -mavx2 -mfma -mf16c (KERN_NS=avx2), and plain (KERN_NS=portable, 4-lane
// arrays the compiler may vectorize). No AMX instruction is used anywhere.
//
// Layouts (MLX's, as `mx.quantize` writes them): row n of W is contiguous; a u32 word holds
// 32/bits elements, element t of a word at bits [t*bits, (t+1)*bits). Affine: w = scale * q + bias
// per group of `gs` consecutive elements of a row. mxfp4: w = e2m1(q) * 2^(e - 127) per 32.
//
// Every product accumulates in f32. A vector of W lanes covers W consecutive words, so lane i
// holds elements [E*i, E*i + E) of a block (E = elements per word); x is stored permuted to
// match (`prep`: xp[(b*E + t)*W + i] = x[(b*W + i)*E + t]), so decoding a word position t of all
// lanes is one shift (and mask) and one multiply-add, with no shuffles. The per-lane sums of q*x
// are scaled per block (lanes map to groups by a fixed permutation), and the affine bias term is
// sum_g bias_g * sum_{k in g} x_k, from per-lane sums of x computed once in `prep`.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef KERN_NS
#error "KERN_NS must name the instruction set of this copy"
#endif

namespace mlxm {
namespace KERN_NS {
namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      e++;
      man <<= 1;
    } while ((man & 0x400) == 0);
    u = sign | uint32_t(112 - e) << 23 | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

inline float to_f32(float v) { return v; }
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
inline float to_f32(bf16_t v) { return bf16_to_f32(v.bits); }
inline float to_f32(f16_t v) { return f16_to_f32(v.bits); }
inline float to_f32(uint8_t v) { return e8m0_to_f32(v); }

alignas(64) constexpr float IOTA16[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#if defined(__AVX512F__)
struct V {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // the larger of a and b; b where either is NaN
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float hsum(F a) { return _mm512_reduce_add_ps(a); }
  static float hmax(F a) { return _mm512_reduce_max_ps(a); }
  static I round_i(F a) { return _mm512_cvtps_epi32(a); }
  static I addi(I a, int b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
  static I loadi(const void* p, int lanes) {
    if (lanes == W) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi32(__mmask16((1u << lanes) - 1), p);
  }
  static I loadidx(const int32_t* p) { return _mm512_loadu_si512(p); }
  template <int S> static I srli(I a) { return S == 0 ? a : _mm512_srli_epi32(a, S); }
  template <int S> static I slli(I a) { return _mm512_slli_epi32(a, S); }
  static I andi(I a, uint32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(int(m))); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F as_f(I a) { return _mm512_castsi512_ps(a); }
  static F perm(F v, I idx) { return _mm512_permutexvar_ps(idx, v); }
  // Low 4 bits of each lane as 0..15, and as E2M1 values: a table lookup on the low 4 bits.
  static F nibble(I a) { return _mm512_permutexvar_ps(a, _mm512_load_ps(IOTA16)); }
  static F fp4(I a) { return _mm512_permutexvar_ps(a, _mm512_load_ps(FP4_VALUES)); }
  // `c` (< W) scales or biases as f32 in lanes [0, c), straight from memory (masked loads).
  static __mmask16 first(int c) { return __mmask16((1u << c) - 1); }
  static F lscale(const float* p, int c) { return _mm512_maskz_loadu_ps(first(c), p); }
  static F lscale(const bf16_t* p, int c) {
    return as_f(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first(c), p)), 16));
  }
  static F lscale(const f16_t* p, int c) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(c), p)); }
  static F lscale(const uint8_t* p, int c) {
    const I e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(first(c), p));
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    return as_f(_mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), zero, _mm512_set1_epi32(0x00400000)));
  }
};
#elif defined(__AVX2__)
struct V {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F a) { _mm256_storeu_ps(p, a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float hmax(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static I round_i(F a) { return _mm256_cvtps_epi32(a); }
  static I addi(I a, int b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
  static float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static I loadi(const void* p, int lanes) {
    if (lanes == W) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), lane);
    return _mm256_maskload_epi32(static_cast<const int*>(p), mask);
  }
  static I loadidx(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <int S> static I srli(I a) { return S == 0 ? a : _mm256_srli_epi32(a, S); }
  template <int S> static I slli(I a) { return _mm256_slli_epi32(a, S); }
  static I andi(I a, uint32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(int(m))); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F as_f(I a) { return _mm256_castsi256_ps(a); }
  static F perm(F v, I idx) { return _mm256_permutevar8x32_ps(v, idx); }
  static F nibble(I a) { return cvt(andi(a, 15)); }
  // Magnitude from the low 3 bits (an 8-entry lookup), sign from bit 3.
  static F fp4(I a) {
    F mag = _mm256_permutevar8x32_ps(_mm256_load_ps(FP4_VALUES), a);
    I sign = _mm256_and_si256(_mm256_slli_epi32(a, 28), _mm256_set1_epi32(int(0x80000000u)));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
  }
  // `c` (< W) scales or biases as f32 in lanes [0, c): up to 4 16-bit values through a
  // general-purpose register (no store-to-load round trip), more element by element.
  static F lscale(const float* p, int c) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane));
  }
  template <class T>
  static __m128i bits16(const T* p, int c) {
    uint64_t v = 0;
    if (c <= 4) {
      std::memcpy(&v, p, size_t(c) * 2);
      return _mm_cvtsi64_si128(int64_t(v));
    }
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, size_t(c) * 2);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  static F lscale(const bf16_t* p, int c) { return as_f(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits16(p, c)), 16)); }
  static F lscale(const f16_t* p, int c) { return _mm256_cvtph_ps(bits16(p, c)); }
  static F lscale(const uint8_t* p, int c) {
    uint64_t v = 0;
    std::memcpy(&v, p, size_t(c));
    const I e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(v)));
    const I zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
    return _mm256_blendv_ps(as_f(_mm256_slli_epi32(e, 23)), as_f(_mm256_set1_epi32(0x00400000)), as_f(zero));
  }
};
#else
struct V {
  static constexpr int W = 4;
  struct F { float v[4]; };
  struct I { uint32_t v[4]; };
  static F zero() { return F{{0, 0, 0, 0}}; }
  static F set1(float a) { return F{{a, a, a, a}}; }
  static F loadf(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void storef(float* p, F a) { std::memcpy(p, a.v, sizeof a.v); }
  static F fma(F a, F b, F c) { for (int i = 0; i < 4; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
  static F add(F a, F b) { for (int i = 0; i < 4; i++) a.v[i] += b.v[i]; return a; }
  static F mul(F a, F b) { for (int i = 0; i < 4; i++) a.v[i] *= b.v[i]; return a; }
  static F max(F a, F b) { for (int i = 0; i < 4; i++) b.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return b; }
  static float hsum(F a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
  static float hmax(F a) { return std::max(std::max(a.v[0], a.v[1]), std::max(a.v[2], a.v[3])); }
  static I round_i(F a) { I r; for (int i = 0; i < 4; i++) r.v[i] = uint32_t(int32_t(std::nearbyint(a.v[i]))); return r; }
  static I addi(I a, int b) { for (auto& x : a.v) x += uint32_t(b); return a; }
  static I loadi(const void* p, int lanes) {
    I r{{0, 0, 0, 0}};
    std::memcpy(r.v, p, size_t(lanes) * 4);
    return r;
  }
  static I loadidx(const int32_t* p) { I r; std::memcpy(r.v, p, sizeof r.v); return r; }
  template <int S> static I srli(I a) { for (auto& x : a.v) x >>= S; return a; }
  template <int S> static I slli(I a) { for (auto& x : a.v) x <<= S; return a; }
  static I andi(I a, uint32_t m) { for (auto& x : a.v) x &= m; return a; }
  static F cvt(I a) { F r; for (int i = 0; i < 4; i++) r.v[i] = float(int32_t(a.v[i])); return r; }
  static F as_f(I a) { F r; std::memcpy(r.v, a.v, sizeof r.v); return r; }
  static F perm(F v, I idx) { F r; for (int i = 0; i < 4; i++) r.v[i] = v.v[idx.v[i] & 3]; return r; }
  static F nibble(I a) { F r; for (int i = 0; i < 4; i++) r.v[i] = float(a.v[i] & 15); return r; }
  static F fp4(I a) { F r; for (int i = 0; i < 4; i++) r.v[i] = FP4_VALUES[a.v[i] & 15]; return r; }
  template <class T>
  static F lscale(const T* p, int c) {
    F r = zero();
    for (int i = 0; i < c; i++) r.v[i] = to_f32(p[i]);
    return r;
  }
};
#endif

constexpr int W = V::W;
using F = V::F;
using I = V::I;

constexpr int elems_per_word(int kind) { return kind == KIND_BF16 ? 2 : kind == KIND_AFFINE8 ? 4 : 8; }

// Weight rows stream from memory once per product: ask for the bytes PREFETCH ahead of the ones
// being read, into L2 (prefetcht2: more lines in flight than L1's fill buffers allow). Rows are
// contiguous, so this runs on into the next row. `benches/packed_matmul.rs` on the Intel Xeon VM,
// two threads, 4-bit g64: 18.3 GB/s without, 25.6 with 2 KiB ahead into L1, 26.0 with 8 KiB
// ahead into L2 (mxfp4 22.6 -> 25.4).
constexpr int PREFETCH = 8192;
inline void prefetch(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + PREFETCH, 0, 1); }

// ---- bf16: W words = 2W elements per block; even elements are `word << 16`, odd ones
// `word & 0xffff0000`, against x stored as [x_even(W), x_odd(W)] per block.

template <int MT>
void rows_bf16(const Job& j, int m0, int n0, int n1) {
  const int K = j.K;
  const int nb = K / (2 * W);
  const int kv = nb * 2 * W;
  const uint16_t* w = static_cast<const uint16_t*>(j.w);
  for (int n = n0; n < n1; n++) {
    const uint16_t* wr = w + size_t(n) * K;
    F ae[MT], ao[MT];
    for (int m = 0; m < MT; m++) ae[m] = ao[m] = V::zero();
    for (int b = 0; b < nb; b++) {
      prefetch(wr + size_t(b) * 2 * W);
      I q = V::loadi(wr + size_t(b) * 2 * W, W);
      F we = V::as_f(V::slli<16>(q));
      F wo = V::as_f(V::andi(q, 0xffff0000u));
      for (int m = 0; m < MT; m++) {
        const float* xb = j.xp + size_t(m0 + m) * j.xp_stride + size_t(b) * 2 * W;
        ae[m] = V::fma(we, V::loadf(xb), ae[m]);
        ao[m] = V::fma(wo, V::loadf(xb + W), ao[m]);
      }
    }
    for (int m = 0; m < MT; m++) {
      float s = V::hsum(V::add(ae[m], ao[m]));
      const float* x = j.x + size_t(m0 + m) * K;
      for (int k = kv; k < K; k++) s += bf16_to_f32(wr[k]) * x[k];
      j.out[size_t(m0 + m) * j.out_stride + n] = s;
    }
  }
}

// ---- f32: the weight row read once for the MT rows of x (as stored; `prep` copies x).

template <int MT>
void rows_f32(const Job& j, int m0, int n0, int n1) {
  const int K = j.K;
  const int kv = K / (2 * W) * (2 * W);
  const float* w = static_cast<const float*>(j.w);
  for (int n = n0; n < n1; n++) {
    const float* wr = w + size_t(n) * K;
    F a0[MT], a1[MT];
    for (int m = 0; m < MT; m++) a0[m] = a1[m] = V::zero();
    for (int k = 0; k < kv; k += 2 * W) {
      prefetch(wr + k);
      const F w0 = V::loadf(wr + k), w1 = V::loadf(wr + k + W);
      for (int m = 0; m < MT; m++) {
        const float* xm = j.xp + size_t(m0 + m) * j.xp_stride + k;
        a0[m] = V::fma(w0, V::loadf(xm), a0[m]);
        a1[m] = V::fma(w1, V::loadf(xm + W), a1[m]);
      }
    }
    for (int m = 0; m < MT; m++) {
      float s = V::hsum(V::add(a0[m], a1[m]));
      const float* x = j.xp + size_t(m0 + m) * j.xp_stride;
      for (int k = kv; k < K; k++) s += wr[k] * x[k];
      j.out[size_t(m0 + m) * j.out_stride + n] = s;
    }
  }
}

// ---- quantized: W words = W*E elements per block.

template <int KIND, int T>
inline F decode_at(I q) {
  if constexpr (KIND == KIND_AFFINE8) {
    I s = V::srli<8 * T>(q);
    return V::cvt(T == 3 ? s : V::andi(s, 0xff));
  } else if constexpr (KIND == KIND_AFFINE4) {
    I s = V::srli<4 * T>(q);
    return V::nibble(s);
  } else {
    return V::fp4(V::srli<4 * T>(q));
  }
}

// Rows n0..n1 of the product, NR weight rows at a time: the rows share each load of x and
// stream NR weight rows at once; each row's arithmetic (and so its rounding) is the same for any NR.
template <int KIND, int GS, class S, int MT, int NR>
void rows_qr(const Job& j, int m0, int n0, int n1) {
  constexpr int E = elems_per_word(KIND);
  constexpr int B = W * E;  // elements per block
  constexpr bool AFF = KIND != KIND_MXFP4;
  const int K = j.K;
  const int KW = K / E;  // words per row
  const int nb = (KW + W - 1) / W;
  const int G = K / GS;
  alignas(64) int32_t lane_group[W];
  for (int i = 0; i < W; i++) lane_group[i] = B >= GS ? (i * E) / GS : 0;
  const I gidx = V::loadidx(lane_group);
  const uint32_t* w = static_cast<const uint32_t*>(j.w);
  const S* scales = static_cast<const S*>(j.scales);
  const S* biases = static_cast<const S*>(j.biases);
  const size_t xsum_off = size_t(nb) * E * W;  // per-lane sums of x follow the permuted x
  for (int n = n0; n + NR <= n1; n += NR) {
    const uint32_t* wr[NR];
    const S* sr[NR];
    const S* br[NR];
    for (int r = 0; r < NR; r++) {
      wr[r] = w + size_t(n + r) * KW;
      sr[r] = scales + size_t(n + r) * G;
      br[r] = AFF ? biases + size_t(n + r) * G : nullptr;
    }
    F acc[NR][MT], accb[NR][MT];
    for (int r = 0; r < NR; r++)
      for (int m = 0; m < MT; m++) acc[r][m] = accb[r][m] = V::zero();
    for (int b = 0; b < nb; b++) {
      const int lanes = std::min(W, KW - b * W);
      I q[NR];
      for (int r = 0; r < NR; r++) prefetch(wr[r] + size_t(b) * W);
      for (int r = 0; r < NR; r++) q[r] = V::loadi(wr[r] + size_t(b) * W, lanes);
      F p0[NR][MT], p1[NR][MT];
      for (int r = 0; r < NR; r++)
        for (int m = 0; m < MT; m++) p0[r][m] = p1[r][m] = V::zero();
      const size_t xoff = size_t(b) * E * W;
      [&]<int... T>(std::integer_sequence<int, T...>) {
        (
            [&] {
              F wv[NR];
              for (int r = 0; r < NR; r++) wv[r] = decode_at<KIND, T>(q[r]);
              for (int m = 0; m < MT; m++) {
                const F xv = V::loadf(j.xp + size_t(m0 + m) * j.xp_stride + xoff + size_t(T) * W);
                for (int r = 0; r < NR; r++) {
                  if constexpr (T % 2 == 0)
                    p0[r][m] = V::fma(wv[r], xv, p0[r][m]);
                  else
                    p1[r][m] = V::fma(wv[r], xv, p1[r][m]);
                }
              }
            }(),
            ...);
      }(std::make_integer_sequence<int, E>{});
      for (int r = 0; r < NR; r++) {
        F sc, bv = V::zero();
        if constexpr (B >= GS) {
          constexpr int C = B / GS;
          const int g0 = b * C;
          if constexpr (C == 1) {
            sc = V::set1(to_f32(sr[r][g0]));
            if constexpr (AFF) bv = V::set1(to_f32(br[r][g0]));
          } else {
            // lanes map to the block's groups by a fixed permutation; a ragged last block has
            // fewer groups (its missing lanes hold zero weights)
            const int c = std::min(C, G - g0);
            // full blocks with a constant count (constant masks / copy sizes once inlined)
            sc = V::perm(c == C ? V::lscale(sr[r] + g0, C) : V::lscale(sr[r] + g0, c), gidx);
            if constexpr (AFF) bv = V::perm(c == C ? V::lscale(br[r] + g0, C) : V::lscale(br[r] + g0, c), gidx);
          }
        } else {
          const int g = (b * B) / GS;
          sc = V::set1(to_f32(sr[r][g]));
          if constexpr (AFF) bv = V::set1(to_f32(br[r][g]));
        }
        for (int m = 0; m < MT; m++) {
          acc[r][m] = V::fma(V::add(p0[r][m], p1[r][m]), sc, acc[r][m]);
          if constexpr (AFF) {
            const float* xs = j.xp + size_t(m0 + m) * j.xp_stride + xsum_off + size_t(b) * W;
            accb[r][m] = V::fma(bv, V::loadf(xs), accb[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < NR; r++)
      for (int m = 0; m < MT; m++) j.out[size_t(m0 + m) * j.out_stride + n + r] = V::hsum(V::add(acc[r][m], accb[r][m]));
  }
}

// 8-bit rows two at a time where the accumulators fit the registers (MT <= 2), the odd row
// alone (`benches/packed_matmul.rs`, M = 1: 8-bit 13.3 -> 15.0 GB/s; 4-bit and mxfp4, whose
// decoding is a lane permutation, ran slower in pairs: 12.2 -> 8.2 GB/s).
template <int KIND, int GS, class S, int MT>
void rows_q(const Job& j, int m0, int n0, int n1) {
  constexpr int NR = KIND == KIND_AFFINE8 && MT <= 2 ? 2 : 1;
  const int even = n0 + (n1 - n0) / NR * NR;
  rows_qr<KIND, GS, S, MT, NR>(j, m0, n0, even);
  if (even < n1) rows_qr<KIND, GS, S, MT, 1>(j, m0, even, n1);
}

template <class Fn>
void tiles(const Job& j, int n0, int n1, Fn&& f) {
  int m = 0;
  for (; m + 4 <= j.M; m += 4) f(std::integral_constant<int, 4>{}, m);
  for (; m + 2 <= j.M; m += 2) f(std::integral_constant<int, 2>{}, m);
  for (; m < j.M; m++) f(std::integral_constant<int, 1>{}, m);
  (void)n0;
  (void)n1;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// ---- quantized kinds with AVX-512 VNNI (and VBMI): x as exact integers, products in int32.
//
// Each lane of a block covers one weight word (E elements: 8 for 4-bit and mxfp4, 4 for 8-bit).
// `prep_vnni` writes x's elements of a lane as integers v = round(x * 2^s), s chosen per lane so
// that |v| <= 2^22 (2^21 for 8-bit) for the lane's largest |x|, as three signed 8-bit digits
// v = d0 * 2^16 + d1 * 2^8 + d2 in byte planes laid out like the weight bytes. `vpdpbusd` sums
// q * d over a lane's elements for each digit (exact in int32), the digits recombine exactly
// (|sum q v| < 2^31; wrap-around in between is harmless), and the lane's integer, converted to
// f32 and times 2^-s, is scaled by its group's scale. The one rounding beyond an f32 product is
// x's: at most 2^-22 (8-bit: 2^-21) of the largest |x| among the E elements of its lane (s is
// capped at 126, so values below about 2^-104 round to multiples of 2^-127). The affine bias
// term is sum_g bias_g * sum_{k in g} x_k from per-group sums of x. mxfp4 weights enter as
// 2 * e2m1 + 12 (unsigned bytes 0..24, looked up with vpermb), the 12 * sum v taken off per lane
// and the scale halved. A lane whose x holds an infinity or NaN gives NaN.
constexpr int VL = 16;  // lanes (words) per block

constexpr int vnni_planes(int kind) { return kind == KIND_AFFINE8 ? 1 : 2; }
// Floats per block: the digits (3 digits x planes x 64 bytes), 2^-s per lane, and for mxfp4 the
// per-lane -12 * sum v (int32).
constexpr size_t vnni_block_floats(int kind) { return size_t(48 * vnni_planes(kind) + VL + (kind == KIND_MXFP4 ? VL : 0)); }

int vnni_blocks(int kind, int K) { return (K / elems_per_word(kind) + VL - 1) / VL; }

size_t vnni_xp_floats(int kind, int gs, int K) {
  return size_t(vnni_blocks(kind, K)) * vnni_block_floats(kind) + (kind == KIND_MXFP4 ? 0 : size_t(K / gs));
}

// Layout of one row: digits of every block, then 2^-s per lane, then (mxfp4) -12 * sum v per lane
// or (affine) the G group sums.
void prep_vnni(int kind, int gs, const float* x, int K, float* xp) {
  const int E = elems_per_word(kind);
  const int P = vnni_planes(kind);
  const int KW = K / E;
  const int nb = vnni_blocks(kind, K);
  const int lim = kind == KIND_AFFINE8 ? 21 : 22;
  int8_t* d = reinterpret_cast<int8_t*>(xp);
  float* f = xp + size_t(nb) * 48 * P;
  int32_t* voff = reinterpret_cast<int32_t*>(f + size_t(nb) * VL);
  for (int b = 0; b < nb; b++) {
    int8_t* db = d + size_t(b) * 192 * P;
    for (int i = 0; i < VL; i++) {
      const int w = b * VL + i;
      float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      float mx = 0.0f;
      bool finite = true;
      for (int t = 0; t < E && w < KW; t++) {
        v[t] = x[size_t(w) * E + t];
        finite = finite && std::isfinite(v[t]);
        mx = std::max(mx, std::fabs(v[t]));
      }
      int s = 0;
      if (finite && mx > 0.0f) {
        int e = 0;
        std::frexp(mx, &e);  // mx < 2^e
        s = std::min(lim - e, 126);
      }
      f[size_t(b) * VL + i] = finite ? std::ldexp(1.0f, -s) : std::numeric_limits<float>::quiet_NaN();
      int32_t sum = 0;
      for (int t = 0; t < E; t++) {
        const int32_t iv = finite ? int32_t(std::nearbyint(std::ldexp(double(v[t]), s))) : 0;
        const int32_t d2 = ((iv + 128) & 255) - 128;
        const int32_t i1 = (iv - d2) >> 8;
        const int32_t d1 = ((i1 + 128) & 255) - 128;
        const int32_t d0 = (i1 - d1) >> 8;
        sum += iv;
        // byte of the lane's word holding element t, and its plane (4-bit: low or high nibble)
        const int byte = i * 4 + (P == 2 ? t / 2 : t);
        const int plane = P == 2 ? t % 2 : 0;
        db[0 * 64 * P + plane * 64 + byte] = int8_t(d0);
        db[1 * 64 * P + plane * 64 + byte] = int8_t(d1);
        db[2 * 64 * P + plane * 64 + byte] = int8_t(d2);
      }
      if (kind == KIND_MXFP4) voff[size_t(b) * VL + i] = -12 * sum;
    }
  }
  if (kind != KIND_MXFP4) {
    float* gsum = f + size_t(nb) * VL;
    for (int g = 0; g < K / gs; g++) {
      float s = 0.0f;
      for (int k = 0; k < gs; k++) s += x[size_t(g) * gs + k];
      gsum[g] = s;
    }
  }
}

// 2 * e2m1 + 12 for each 4-bit code, as bytes (vpermb's table: the 16 repeated 4 times).
alignas(16) constexpr int8_t FP4_SHIFTED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// Rows n0..n1 of the product. `sf` holds G + 2 * VL floats (the row's scales as f32).
template <int KIND, int GS, class S, int MT>
void rows_vnni(const Job& j, int m0, int n0, int n1, float* sf) {
  constexpr int E = elems_per_word(KIND);
  constexpr int P = vnni_planes(KIND);
  constexpr int B = VL * E;  // elements per block
  constexpr int C = B / GS;  // groups per block (0: a block is part of one group)
  constexpr bool AFF = KIND != KIND_MXFP4;
  const int K = j.K;
  const int KW = K / E;
  const int nb = vnni_blocks(KIND, K);
  const int G = K / GS;
  const size_t fo = size_t(nb) * 48 * P;  // floats before 2^-s
  const size_t eo = fo + size_t(nb) * VL;
  alignas(64) int32_t lane_group[VL];
  for (int i = 0; i < VL; i++) lane_group[i] = C >= 2 ? (i * E) / GS : 0;
  const __m512i gidx = _mm512_load_si512(lane_group);
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i tbl = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(FP4_SHIFTED)));  // x4
  const uint32_t* w = static_cast<const uint32_t*>(j.w);
  const S* scales = static_cast<const S*>(j.scales);
  const S* biases = static_cast<const S*>(j.biases);
  for (int n = n0; n < n1; n++) {
    const uint32_t* wr = w + size_t(n) * KW;
    const S* sr = scales + size_t(n) * G;
    // the row's scales as f32 (zero past G), and the bias term against x's group sums
    F acc[MT], accb[MT];
    for (int m = 0; m < MT; m++) acc[m] = accb[m] = V::zero();
    for (int g = 0; g < G; g += VL) {
      const int c = std::min(VL, G - g);
      F sc = c == VL ? V::lscale(sr + g, VL) : V::lscale(sr + g, c);
      if constexpr (!AFF) sc = _mm512_mul_ps(sc, V::set1(0.5f));
      V::storef(sf + g, sc);
      if constexpr (AFF) {
        const S* br = biases + size_t(n) * G;
        const F bv = c == VL ? V::lscale(br + g, VL) : V::lscale(br + g, c);
        for (int m = 0; m < MT; m++) {
          const float* gsum = j.xp + size_t(m0 + m) * j.xp_stride + eo;
          accb[m] = V::fma(bv, V::lscale(gsum + g, c), accb[m]);
        }
      }
    }
    for (int b = 0; b < nb; b++) {
      prefetch(wr + size_t(b) * VL);
      const I q = V::loadi(wr + size_t(b) * VL, std::min(VL, KW - b * VL));
      I w0, w1;
      if constexpr (P == 1) {
        w0 = w1 = q;
      } else {
        if constexpr (AFF) {
          w0 = _mm512_and_si512(q, m4);
          w1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        } else {
          // vpermb reads the low 6 bits of each byte: the table repeats per 16 codes, so the
          // neighbouring nibble's bits need no mask
          w0 = _mm512_permutexvar_epi8(q, tbl);
          w1 = _mm512_permutexvar_epi8(_mm512_srli_epi16(q, 4), tbl);
        }
      }
      F sc;
      if constexpr (C >= 2)
        sc = V::perm(C == 2 ? _mm512_castpd_ps(_mm512_castpd128_pd512(_mm_load_sd(reinterpret_cast<const double*>(sf + size_t(b) * 2))))
                            : _mm512_castps128_ps512(_mm_loadu_ps(sf + size_t(b) * 4)),
                     gidx);
      else
        sc = V::set1(sf[size_t(b) * B / GS]);
      for (int m = 0; m < MT; m++) {
        // aligned loads of x's digits (64-byte rows and blocks): unaligned ones split cache
        // lines, and these loads, not the arithmetic, bound the loop
        const float* xm = j.xp + size_t(m0 + m) * j.xp_stride;
        const int8_t* db = reinterpret_cast<const int8_t*>(xm) + size_t(b) * 192 * P;
        const I z = _mm512_setzero_si512();
        // mxfp4: the lowest digit's sum starts from -12 * sum v
        const I a2i = AFF ? z : _mm512_load_si512(xm + eo + size_t(b) * VL);
        I a0 = _mm512_dpbusd_epi32(z, w0, _mm512_load_si512(db));
        I a1 = _mm512_dpbusd_epi32(z, w0, _mm512_load_si512(db + 64 * P));
        I a2 = _mm512_dpbusd_epi32(a2i, w0, _mm512_load_si512(db + 128 * P));
        if constexpr (P == 2) {
          a0 = _mm512_dpbusd_epi32(a0, w1, _mm512_load_si512(db + 64));
          a1 = _mm512_dpbusd_epi32(a1, w1, _mm512_load_si512(db + 192));
          a2 = _mm512_dpbusd_epi32(a2, w1, _mm512_load_si512(db + 320));
        }
        const I t = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(a0, 8), a1), 8), a2);
        acc[m] = V::fma(_mm512_mul_ps(V::cvt(t), V::loadf(xm + fo + size_t(b) * VL)), sc, acc[m]);
      }
    }
    for (int m = 0; m < MT; m++) j.out[size_t(m0 + m) * j.out_stride + n] = V::hsum(V::add(acc[m], accb[m]));
  }
}
#endif

template <int KIND, int GS, class S>
void run_q(const Job& j, int n0, int n1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  // a row's scales as f32, past G rounded up to whole vectors
  std::vector<float> sf(size_t(j.K / GS + 2 * VL));
  tiles(j, n0, n1, [&](auto mt, int m) { rows_vnni<KIND, GS, S, decltype(mt)::value>(j, m, n0, n1, sf.data()); });
  return;
#endif
  tiles(j, n0, n1, [&](auto mt, int m) { rows_q<KIND, GS, S, decltype(mt)::value>(j, m, n0, n1); });
}

template <int KIND, class S>
void run_gs(const Job& j, int n0, int n1) {
  switch (j.gs) {
    case 32: return run_q<KIND, 32, S>(j, n0, n1);
    case 64: return run_q<KIND, 64, S>(j, n0, n1);
    case 128: return run_q<KIND, 128, S>(j, n0, n1);
  }
}

template <int KIND>
void run_affine(const Job& j, int n0, int n1) {
  switch (j.stype) {
    case S_F32: return run_gs<KIND, float>(j, n0, n1);
    case S_BF16: return run_gs<KIND, bf16_t>(j, n0, n1);
    case S_F16: return run_gs<KIND, f16_t>(j, n0, n1);
  }
}

void rows(const Job& j, int n0, int n1) {
  switch (j.kind) {
    case KIND_BF16:
      tiles(j, n0, n1, [&](auto mt, int m) { rows_bf16<decltype(mt)::value>(j, m, n0, n1); });
      return;
    case KIND_F32:
      tiles(j, n0, n1, [&](auto mt, int m) { rows_f32<decltype(mt)::value>(j, m, n0, n1); });
      return;
    case KIND_AFFINE4: return run_affine<KIND_AFFINE4>(j, n0, n1);
    case KIND_AFFINE8: return run_affine<KIND_AFFINE8>(j, n0, n1);
    case KIND_MXFP4: return run_q<KIND_MXFP4, 32, uint8_t>(j, n0, n1);
  }
}

size_t xp_floats(int kind, int gs, int K) {
  if (kind == KIND_F32) return size_t(K);
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (kind != KIND_BF16) return vnni_xp_floats(kind, gs, K);
#endif
  (void)gs;
  if (kind == KIND_BF16) return size_t(K / (2 * W)) * 2 * W;
  const int E = elems_per_word(kind);
  const size_t nb = (size_t(K / E) + W - 1) / W;
  return nb * W * (E + 1);
}

void prep(int kind, int gs, const float* x, int K, float* xp) {
  if (kind == KIND_F32) {
    std::memcpy(xp, x, size_t(K) * sizeof(float));
    return;
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (kind != KIND_BF16) return prep_vnni(kind, gs, x, K, xp);
#endif
  (void)gs;
  if (kind == KIND_BF16) {
    const int nb = K / (2 * W);
    for (int b = 0; b < nb; b++)
      for (int i = 0; i < W; i++) {
        xp[size_t(b) * 2 * W + i] = x[size_t(b) * 2 * W + 2 * i];
        xp[size_t(b) * 2 * W + W + i] = x[size_t(b) * 2 * W + 2 * i + 1];
      }
    return;
  }
  const int E = elems_per_word(kind);
  const int nb = (K / E + W - 1) / W;
  float* xs = xp + size_t(nb) * E * W;
  for (int b = 0; b < nb; b++)
    for (int i = 0; i < W; i++) {
      float s = 0.0f;
      for (int t = 0; t < E; t++) {
        const size_t k = (size_t(b) * W + i) * E + t;
        const float v = k < size_t(K) ? x[k] : 0.0f;
        xp[(size_t(b) * E + t) * W + i] = v;
        s += v;
      }
      xs[size_t(b) * W + i] = s;
    }
}

float dot(const float* a, const float* b, int n) {
  V::F s0 = V::zero(), s1 = V::zero();
  int i = 0;
  for (; i + 2 * V::W <= n; i += 2 * V::W) {
    s0 = V::fma(V::loadf(a + i), V::loadf(b + i), s0);
    s1 = V::fma(V::loadf(a + i + V::W), V::loadf(b + i + V::W), s1);
  }
  for (; i + V::W <= n; i += V::W) s0 = V::fma(V::loadf(a + i), V::loadf(b + i), s0);
  float s = V::hsum(V::add(s0, s1));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* x, float* y, int n) {
  const V::F av = V::set1(a);
  int i = 0;
  for (; i + V::W <= n; i += V::W) V::storef(y + i, V::fma(av, V::loadf(x + i), V::loadf(y + i)));
  for (; i < n; i++) y[i] += a * x[i];
}

void max_index(const float* x, int n, float* max, int* index) {
  // the maximum by lanes (NaN lanes never replace a number: V::max keeps its second operand),
  // then the first index holding it
  const float ninf = -std::numeric_limits<float>::infinity();
  F m = V::set1(ninf);
  int i = 0;
  for (; i + W <= n; i += W) m = V::max(V::loadf(x + i), m);
  float best = V::hmax(m);
  for (; i < n; i++) best = x[i] > best ? x[i] : best;
  int at = 0;
  while (at < n && !(x[at] == best)) at++;
  *max = best;
  *index = at < n ? at : 0;
}

// exp(t) for t <= 0 (Cephes' expf: t = k ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
// e^r, 2^k from the exponent bits), t clamped at -87.3 so 2^k stays normal.
inline F exp_nonpositive(F t) {
  t = V::max(t, V::set1(-87.3f));
  const F k = V::cvt(V::round_i(V::mul(t, V::set1(1.44269504088896341f))));
  F r = V::fma(k, V::set1(-0.693359375f), t);
  r = V::fma(k, V::set1(2.12194440e-4f), r);
  F p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  const F e = V::add(V::fma(V::mul(p, r), r, r), V::set1(1.0f));
  return V::mul(e, V::as_f(V::template slli<23>(V::addi(V::round_i(k), 127))));
}

// sum_i exp(x[i] - shift), each term also stored in out[i] when STORE.
template <bool STORE>
float exp_sum(const float* x, int n, float shift, float* out) {
  const F sh = V::set1(-shift);
  F s0 = V::zero(), s1 = V::zero();
  int i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const F e0 = exp_nonpositive(V::add(V::loadf(x + i), sh));
    const F e1 = exp_nonpositive(V::add(V::loadf(x + i + W), sh));
    if constexpr (STORE) {
      V::storef(out + i, e0);
      V::storef(out + i + W, e1);
    }
    s0 = V::add(s0, e0);
    s1 = V::add(s1, e1);
  }
  for (; i + W <= n; i += W) {
    const F e = exp_nonpositive(V::add(V::loadf(x + i), sh));
    if constexpr (STORE) V::storef(out + i, e);
    s0 = V::add(s0, e);
  }
  float s = V::hsum(V::add(s0, s1));
  if (i < n) {
    alignas(64) float t[W];
    for (int j = 0; j < W; j++) t[j] = i + j < n ? x[i + j] - shift : -std::numeric_limits<float>::infinity();
    V::storef(t, exp_nonpositive(V::loadf(t)));
    for (int j = 0; j < n - i; j++) {
      if constexpr (STORE) out[i + j] = t[j];
      s += t[j];
    }
  }
  return s;
}

float sum_exp(const float* x, int n, float shift) { return exp_sum<false>(x, n, shift, nullptr); }

float exp_store(const float* x, int n, float shift, float* out) { return exp_sum<true>(x, n, shift, out); }

void attend(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int n, int d, int dv, float* p, float* out) {
  // scores and their maximum (rows of d floats: whole vectors, then a scalar tail)
  const int dw = d - d % W;
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; j++) {
    const float* kr = k + j * ks;
    F acc = V::zero();
    for (int i = 0; i < dw; i += W) acc = V::fma(V::loadf(q + i), V::loadf(kr + i), acc);
    float sc = V::hsum(acc);
    for (int i = dw; i < d; i++) sc += q[i] * kr[i];
    p[j] = sc;
    m = sc > m ? sc : m;
  }
  // exp(s - max) in place and the sum
  const float sum = exp_store(p, n, m, p);
  const float inv = 1.0f / sum;
  // the weighted sum of the values, in registers when a row is at most 8 whole vectors
  if (dv % W == 0 && dv / W <= 8) {
    const int nv = dv / W;
    F o[8];
    for (int c = 0; c < nv; c++) o[c] = V::zero();
    for (int jj = 0; jj < n; jj++) {
      const F w = V::set1(p[jj] * inv);
      const float* vr = v + jj * vs;
      for (int c = 0; c < nv; c++) o[c] = V::fma(w, V::loadf(vr + c * W), o[c]);
    }
    for (int c = 0; c < nv; c++) V::storef(out + c * W, o[c]);
  } else {
    std::fill(out, out + dv, 0.0f);
    for (int jj = 0; jj < n; jj++) axpy(p[jj] * inv, v + jj * vs, out, dv);
  }
}

}  // namespace

#define STR2(x) #x
#define STR(x) STR2(x)
const KernelSet set = {STR(KERN_NS), xp_floats, prep, rows, dot, axpy, max_index, sum_exp, exp_store, attend};

}  // namespace KERN_NS
}  // namespace mlxm
