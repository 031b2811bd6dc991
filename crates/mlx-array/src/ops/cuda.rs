//! Products over a few rows on a CUDA GPU by our own kernels (mlx-sys `src/cudakern`, compiled
//! by MLX's custom-kernel API at first use): a speculative verify step, a block draft or a short
//! prefill chunk runs 2-16 rows through every projection and attention layer.
//!
//! MLX runs a product of more than one row through cuBLASLt, whose per-call set-up on the host
//! (descriptors, the algorithm heuristic, capture into the step's CUDA graph) costs tens of
//! microseconds, and its fused attention of more than one query builds a cuDNN graph for every
//! new (queries, keys) shape. Measured on an H100 with `crates/speculative/benches/cuda_rows_probe.py`
//! (36 calls per evaluation, bf16): Qwen3-8B's q/k/v product of 8 rows 1457 GB/s against 857 for
//! MLX's matmul, a 0.6B draft's 1024-wide products 1.5-2x faster; attention of 8 queries over 512
//! keys 30 us a call against 67 as matrix products, over 2048 keys about even, beyond that the
//! products win (one warp walks all keys of a query row), hence [`FEW_QUERY_ATTENTION_MAX_KEYS`].
//!
//! Whether [`Array::matmul_weight_t`] and [`Array::sdpa`] use them is [`CudaFewRowKernels`]
//! (process-wide, `Off` by default): in the one end-to-end measurement so far (speculative
//! decoding of the Qwen3-8B-shaped pair, `gpu_spec_bench.sh`, H100) the verify steps were slower
//! with them than with MLX's cuBLAS products and attention as matrix products (116.7 against
//! 166-179 tok/s at 7 drafts a cycle), with a build whose product kernel kept its row sums in an
//! early-exit loop; `tests/cuda_kernels.rs` checks the kernels against f64 on a GPU (it passed on
//! an H100 with that build; the loop was rewritten afterwards and not yet run on a GPU).
use crate::error::{Error, Result};
use crate::ops::AttentionMask;
use crate::{Array, DType};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether products of a few rows and attention of a few queries on a CUDA GPU run our kernels
/// ([`Array::cuda_rows_matmul`], [`Array::cuda_few_query_attention`]) or MLX's own ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaFewRowKernels {
    /// MLX's matmul (cuBLAS) and attention as matrix products.
    #[default]
    Off,
    /// Our kernels where they apply (see [`Array::matmul_weight_t`] and [`Array::sdpa`]).
    On,
}

static FEW_ROW_KERNELS_ON: AtomicBool = AtomicBool::new(false);

/// Set [`CudaFewRowKernels`] (process-wide; graphs built afterwards follow it).
pub fn set_cuda_few_row_kernels(mode: CudaFewRowKernels) {
    FEW_ROW_KERNELS_ON.store(mode == CudaFewRowKernels::On, Ordering::Relaxed);
}

/// The current [`CudaFewRowKernels`] setting.
pub fn cuda_few_row_kernels() -> CudaFewRowKernels {
    if FEW_ROW_KERNELS_ON.load(Ordering::Relaxed) {
        CudaFewRowKernels::On
    } else {
        CudaFewRowKernels::Off
    }
}

/// Most rows of `x` [`Array::matmul_weight_t`] gives the few-row kernel on a GPU (9-16 rows
/// measured slower than MLX's matmul for the 8B shapes).
pub const GPU_ROWS_MATMUL_MAX_ROWS: usize = 8;

/// Most keys (and most keys times queries: [`FEW_QUERY_ATTENTION_MAX_WORK`]) for which
/// [`Array::sdpa`] runs few-query attention by kernel on a GPU.
pub const FEW_QUERY_ATTENTION_MAX_KEYS: usize = 2048;
/// See [`FEW_QUERY_ATTENTION_MAX_KEYS`].
pub const FEW_QUERY_ATTENTION_MAX_WORK: usize = 16384;

/// Whether graph nodes built now take MLX's own ops (a function transform traces, or an
/// [`crate::ops::MlxOpsScope`] is open): our kernels have no gradients and step aside.
fn mlx_ops_only_now() -> bool {
    unsafe { mlx_sys::mlx_models_uses_mlx_ops() }
}

/// With [`CudaFewRowKernels::On`], on a GPU.
fn kernels_on_gpu() -> bool {
    FEW_ROW_KERNELS_ON.load(Ordering::Relaxed) && matches!(crate::default_device(), Ok(crate::Device::Gpu))
}

impl Array {
    /// `self @ wt` where `wt` (`[in, out]`) is the transposed view of a weight stored
    /// `[out, in]` (what a linear layer holds; `self` `[.., in]`): with [`CudaFewRowKernels::On`]
    /// on a GPU, 2 to [`GPU_ROWS_MATMUL_MAX_ROWS`] rows of bf16 or f16 run
    /// [`Array::cuda_rows_matmul`] over the stored rows, everything else MLX's matmul.
    pub fn matmul_weight_t(&self, wt: &Array) -> Result<Array> {
        let d = self.dims();
        let k = d.last().copied().unwrap_or(0);
        let rows = if k > 0 { self.size() / k as usize } else { 0 };
        if (2..=GPU_ROWS_MATMUL_MAX_ROWS).contains(&rows)
            && matches!(self.dtype(), DType::BF16 | DType::F16)
            && wt.dtype() == self.dtype()
            && wt.ndim() == 2
            && wt.dims()[0] == k
            && k % 8 == 0
            && kernels_on_gpu()
            && !mlx_ops_only_now()
        {
            let y = self.reshape(&[rows as i32, k])?.cuda_rows_matmul(&wt.swap_axes(0, 1)?)?;
            let mut shape = d[..d.len() - 1].to_vec();
            shape.push(wt.dims()[1]);
            return y.reshape(&shape);
        }
        self.matmul(wt)
    }

    /// `self @ w.T` by the few-row CUDA kernel: `self` `[M, K]` with 1 <= M <= 16, `w` `[N, K]`,
    /// both bf16 or both f16, read through their strides (16-byte vector loads where rows are
    /// aligned and unit-stride with `K` a multiple of 8, scalar loads otherwise). f32
    /// accumulation, one rounding of each output. An error off a CUDA GPU.
    pub fn cuda_rows_matmul(&self, w: &Array) -> Result<Array> {
        let (x, wd) = (self.dims(), w.dims());
        if x.len() != 2 || wd.len() != 2 || x[1] != wd[1] || !(1..=16).contains(&x[0]) {
            return Err(Error::shape("cuda_rows_matmul", format!("x {x:?} and w {wd:?}: need [1..=16, K] and [N, K]")));
        }
        if self.dtype() != w.dtype() || !matches!(self.dtype(), DType::BF16 | DType::F16) {
            return Err(Error::arg("cuda_rows_matmul", format!("dtypes {:?} and {:?}: need one of bf16, f16", self.dtype(), w.dtype())));
        }
        let (xp, wp, s) = (self.inner.as_ptr(), w.inner.as_ptr(), crate::ffi::stream());
        crate::ffi::call("cuda_rows_matmul", |res| unsafe { mlx_sys::mlx_models_cuda_rows_matmul(res, xp, wp, s.as_ptr()) })
    }

    /// Attention of a few queries by the CUDA kernel: `self` = queries `[B, Hq, M, D]`, keys and
    /// values `[B, Hk, N, D]` (any strides: a cache's slice is read in place), `Hq` a multiple of
    /// `Hk`, `D` a multiple of 32 up to 256, one float dtype; masks `None`, `Causal` and
    /// `SlidingWindow` (the queries are the last `M` positions). An online softmax in f32 per
    /// query row. An error off a CUDA GPU or for an array mask.
    pub fn cuda_few_query_attention(&self, keys: &Array, values: &Array, scale: f32, mask: AttentionMask) -> Result<Array> {
        let (q, k, v) = (self.dims(), keys.dims(), values.dims());
        if q.len() != 4 || k.len() != 4 || k != v || q[0] != k[0] || q[3] != k[3] || k[1] == 0 || q[1] % k[1] != 0 || q[3] % 32 != 0 || q[3] > 256 {
            return Err(Error::shape("cuda_few_query_attention", format!("queries {q:?}, keys {k:?}, values {v:?}")));
        }
        if keys.dtype() != self.dtype() || values.dtype() != self.dtype() || !matches!(self.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::arg("cuda_few_query_attention", format!("dtypes {:?}, {:?}, {:?}", self.dtype(), keys.dtype(), values.dtype())));
        }
        let (causal, window) = match mask {
            AttentionMask::None => (false, 0),
            AttentionMask::Causal => (true, 0),
            AttentionMask::SlidingWindow(w) if w > 0 => (true, i32::try_from(w).unwrap_or(i32::MAX)),
            AttentionMask::SlidingWindow(_) => return Err(Error::arg("cuda_few_query_attention", "a sliding window of 0 keys")),
            AttentionMask::Array(_) => return Err(Error::arg("cuda_few_query_attention", "mask arrays are not supported")),
        };
        if causal && q[2] > k[2] {
            return Err(Error::shape("cuda_few_query_attention", format!("{} queries after {} keys under a causal mask", q[2], k[2])));
        }
        let (qp, kp, vp, s) = (self.inner.as_ptr(), keys.inner.as_ptr(), values.inner.as_ptr(), crate::ffi::stream());
        crate::ffi::call("cuda_few_query_attention", |res| unsafe {
            mlx_sys::mlx_models_cuda_few_query_attention(res, qp, kp, vp, scale, causal, window, s.as_ptr())
        })
    }
}

/// Whether [`Array::sdpa`] on a GPU runs `q` `[B, Hq, M, D]` over `k` by
/// [`Array::cuda_few_query_attention`] (else as matrix products).
pub(crate) fn few_query_kernel_applies(q: &Array, k: &Array, v: &Array, mask: &AttentionMask) -> bool {
    let (qd, kd) = (q.dims(), k.dims());
    let keys = kd[2] as usize;
    FEW_ROW_KERNELS_ON.load(Ordering::Relaxed)
        && !matches!(mask, AttentionMask::Array(_) | AttentionMask::SlidingWindow(0))
        && keys <= FEW_QUERY_ATTENTION_MAX_KEYS
        && keys * qd[2] as usize <= FEW_QUERY_ATTENTION_MAX_WORK
        && qd[3] % 32 == 0
        && qd[3] <= 256
        && kd == v.dims()
        && q.dtype() == k.dtype()
        && q.dtype() == v.dtype()
        && matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && !mlx_ops_only_now()
}
