// Body of the CUDA kernel for attention of a few queries (mlx::core::fast::cuda_kernel supplies
// the signature: inputs q [B, Hq, M, D], k and v [B, Hk, N, D] of dtype T, read through their
// strides (a K/V cache's slice is not contiguous); output out [B, Hq, M, D]). Compile-time: D
// (a multiple of 32, at most 256), CAUSAL (query m is at position N - M + m and sees keys up to
// it), WINDOW (0: none; else a query sees only its WINDOW most recent keys), SCALE (the f32 bits
// of the score scale). One warp per query row: each lane holds D / 32 features of the query,
// the warp sums each key's score, and an online softmax accumulates the values in f32.
constexpr int WARP = 32;
constexpr int P = D / WARP;
const int HQ = q_shape[1];
const int M = q_shape[2];
const int HK = k_shape[1];
const int N = k_shape[2];
const int rows = q_shape[0] * HQ * M;
const int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
const int lane = threadIdx.x % WARP;
if (row >= rows) {
  return;
}
const int m = row % M;
const int hq = (row / M) % HQ;
const int b = row / (M * HQ);
const int hk = hq / (HQ / HK);
const float scale = __int_as_float(SCALE);
const T* qp = q + b * q_strides[0] + hq * q_strides[1] + m * q_strides[2];
float qv[P];
#pragma unroll
for (int i = 0; i < P; i++) {
  qv[i] = static_cast<float>(qp[(lane * P + i) * q_strides[3]]) * scale;
}
const T* kp = k + b * k_strides[0] + hk * k_strides[1];
const T* vp = v + b * v_strides[0] + hk * v_strides[1];
const int end = CAUSAL ? N - M + m + 1 : N;
const int start = WINDOW > 0 ? max(0, end - WINDOW) : 0;
float mx = -INFINITY;
float l = 0.0f;
float o[P];
#pragma unroll
for (int i = 0; i < P; i++) {
  o[i] = 0.0f;
}
for (int j = start; j < end; j++) {
  const T* kj = kp + (size_t)j * k_strides[2];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < P; i++) {
    s += qv[i] * static_cast<float>(kj[(lane * P + i) * k_strides[3]]);
  }
#pragma unroll
  for (int off = WARP / 2; off > 0; off /= 2) {
    s += __shfl_xor_sync(0xffffffff, s, off);
  }
  const float mn = fmaxf(mx, s);
  const float c = expf(mx - mn);
  const float p = expf(s - mn);
  l = l * c + p;
  const T* vj = vp + (size_t)j * v_strides[2];
#pragma unroll
  for (int i = 0; i < P; i++) {
    o[i] = o[i] * c + p * static_cast<float>(vj[(lane * P + i) * v_strides[3]]);
  }
  mx = mn;
}
T* op = out + (size_t)row * D;
#pragma unroll
for (int i = 0; i < P; i++) {
  op[lane * P + i] = static_cast<T>(o[i] / l);
}
