// Body of the CUDA kernel `out = x @ w.T` for a few rows of x (mlx::core::fast::cuda_kernel
// supplies the signature: inputs x [M, K] and w [N, K] of dtype T read through their strides (no
// copy of a weight that is a view), output out [M, N]; compile-time MAXM (most rows of x: the
// sums live in registers) and R (rows of w per warp)). One warp computes R outputs of every row of x: each lane walks K in 16-byte
// steps, reads 8 weights of each of its R rows once and the matching 8 inputs of the M rows (the
// same for every warp, served from L1), accumulates in f32, and the warp sums its lanes. Weights
// are read once: a product of 2-16 rows costs about what one row's matrix-vector product costs.
// Rows that are not 16-byte aligned or not unit-stride take a scalar path (same sums).
constexpr int WARP = 32;
constexpr int V = 8;
const int M = x_shape[0];
const int N = w_shape[0];
const int K = w_shape[1];
const int64_t xs0 = x_strides[0];
const int64_t ws0 = w_strides[0];
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
const int lane = threadIdx.x % WARP;
const int n0 = warp * R;
if (n0 >= N) {
  return;
}
float acc[R][MAXM];
#pragma unroll
for (int r = 0; r < R; r++) {
#pragma unroll
  for (int m = 0; m < MAXM; m++) {
    acc[r][m] = 0.0f;
  }
}
const bool vec = x_strides[1] == 1 && w_strides[1] == 1 && K % V == 0 && xs0 % V == 0 && ws0 % V == 0 &&
    reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
if (vec) {
  const uint4* wrow[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    wrow[r] = reinterpret_cast<const uint4*>(w + (int64_t)min(n0 + r, N - 1) * ws0);
  }
  for (int k = lane; k < K / V; k += WARP) {
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      wv[r] = __ldg(wrow[r] + k);
    }
#pragma unroll
    for (int m = 0; m < MAXM; m++) {
      if (m < M) {
        uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (int64_t)m * xs0) + k);
        const T* xe = reinterpret_cast<const T*>(&xv);
        float xf[V];
#pragma unroll
        for (int i = 0; i < V; i++) {
          xf[i] = static_cast<float>(xe[i]);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
          const T* we = reinterpret_cast<const T*>(&wv[r]);
#pragma unroll
          for (int i = 0; i < V; i++) {
            acc[r][m] += static_cast<float>(we[i]) * xf[i];
          }
        }
      }
    }
  }
} else {
  const int64_t xs1 = x_strides[1];
  const int64_t ws1 = w_strides[1];
  for (int k = lane; k < K; k += WARP) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      const float wk = static_cast<float>(w[(int64_t)min(n0 + r, N - 1) * ws0 + k * ws1]);
#pragma unroll
      for (int m = 0; m < MAXM; m++) {
        if (m < M) {
          acc[r][m] += wk * static_cast<float>(x[(int64_t)m * xs0 + k * xs1]);
        }
      }
    }
  }
}
#pragma unroll
for (int r = 0; r < R; r++) {
#pragma unroll
  for (int m = 0; m < MAXM; m++) {
    float v = acc[r][m];
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) {
      v += __shfl_xor_sync(0xffffffff, v, o);
    }
    acc[r][m] = v;
  }
}
if (lane == 0) {
#pragma unroll
  for (int r = 0; r < R; r++) {
    if (n0 + r < N) {
#pragma unroll
      for (int m = 0; m < MAXM; m++) {
        if (m < M) {
          out[(int64_t)m * N + n0 + r] = static_cast<T>(acc[r][m]);
        }
      }
    }
  }
}
