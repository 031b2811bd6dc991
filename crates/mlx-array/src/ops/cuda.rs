//! Products over a few rows on a CUDA GPU by our own kernels (mlx-sys `src/cudakern`, compiled
//! by MLX's custom-kernel API at first use): a speculative verify step, a block draft or a short
//! prefill chunk runs 2-16 rows through every projection and attention layer.
//!
//! MLX runs a product of more than one row through cuBLASLt, whose per-call set-up on the host
//! (descriptors, the algorithm heuristic, capture into the step's CUDA graph) costs tens of
//! microseconds, and its fused attention of more than one query builds a cuDNN graph for every
//! new (queries, keys) shape.
//!
//! Whether [`Array::matmul_weight_t`] and [`Array::sdpa`] use the kernels is [`CudaFewRowKernels`]
//! (process-wide, `Off` by default, products and attention switched separately): in a forward
//! they lose to MLX's ops. `verify_probe` (benches, H100, Qwen3-8B-shaped bf16, 384 keys): a
//! forward of 2 / 8 rows took 10.0 / 10.5 ms with MLX's ops, 11.1 / 21.4 with the product kernel,
//! 22.0 / 21.7 with the attention kernel, 22.4 / 32.0 with both. Nsight Compute puts the
//! attention kernel at 383 us a layer for 2 queries (one warp walks every key of a query row: 16
//! blocks on a 132-SM GPU); the product kernel (one warp per 2 weight rows, one 16-byte load in
//! flight a lane) does not keep enough reads in flight at 8 rows. Timing many independent calls in one evaluation
//! hides this (MLX's CUDA graph runs them concurrently), which is how the kernels first looked
//! 1.5-3x faster. `tests/cuda_kernels.rs` checks them against f64 on a GPU (passed on an H100).
use crate::error::{Error, Result};
use crate::ops::AttentionMask;
use crate::{Array, DType};
use std::sync::atomic::{AtomicU8, Ordering};

/// Whether products of a few rows and attention of a few queries on a CUDA GPU run our kernels
/// ([`Array::cuda_rows_matmul`], [`Array::cuda_few_query_attention`]) or MLX's own ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaFewRowKernels {
    /// MLX's matmul (cuBLAS) and attention as matrix products.
    #[default]
    Off,
    /// The product kernel where it applies ([`Array::matmul_weight_t`]); attention as in `Off`.
    Products,
    /// The attention kernel where it applies ([`Array::sdpa`]); products as in `Off`.
    Attention,
    /// Both kernels where they apply.
    On,
}

impl CudaFewRowKernels {
    fn bits(self) -> u8 {
        match self {
            CudaFewRowKernels::Off => 0,
            CudaFewRowKernels::Products => PRODUCTS,
            CudaFewRowKernels::Attention => ATTENTION,
            CudaFewRowKernels::On => PRODUCTS | ATTENTION,
        }
    }

    /// Whether any kernel is on.
    pub fn any(self) -> bool {
        self != CudaFewRowKernels::Off
    }
}

impl std::str::FromStr for CudaFewRowKernels {
    type Err = Error;

    /// `off`, `products`, `attention` or `on`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(CudaFewRowKernels::Off),
            "products" => Ok(CudaFewRowKernels::Products),
            "attention" => Ok(CudaFewRowKernels::Attention),
            "on" => Ok(CudaFewRowKernels::On),
            _ => Err(Error::arg("cuda_few_row_kernels", format!("{s:?}: expected off, products, attention or on"))),
        }
    }
}

const PRODUCTS: u8 = 1;
const ATTENTION: u8 = 2;
static FEW_ROW_KERNELS: AtomicU8 = AtomicU8::new(0);

/// Set [`CudaFewRowKernels`] (process-wide; graphs built afterwards follow it).
pub fn set_cuda_few_row_kernels(mode: CudaFewRowKernels) {
    FEW_ROW_KERNELS.store(mode.bits(), Ordering::Relaxed);
}

/// The current [`CudaFewRowKernels`] setting.
pub fn cuda_few_row_kernels() -> CudaFewRowKernels {
    match FEW_ROW_KERNELS.load(Ordering::Relaxed) {
        0 => CudaFewRowKernels::Off,
        PRODUCTS => CudaFewRowKernels::Products,
        ATTENTION => CudaFewRowKernels::Attention,
        _ => CudaFewRowKernels::On,
    }
}

fn kernel_on(bit: u8) -> bool {
    FEW_ROW_KERNELS.load(Ordering::Relaxed) & bit != 0
}

/// Most rows of `x` [`Array::matmul_weight_t`] gives the few-row kernel on a GPU (9-16 rows were
/// slower than MLX's matmul for the 8B shapes even in the overlapped per-call timing the module
/// docs describe).
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

/// With the product kernel on ([`CudaFewRowKernels::Products`] or `On`), on a GPU.
fn product_kernel_on_gpu() -> bool {
    kernel_on(PRODUCTS) && matches!(crate::default_device(), Ok(crate::Device::Gpu))
}

impl Array {
    /// `self @ wt` where `wt` (`[in, out]`) is the transposed view of a weight stored
    /// `[out, in]` (what a linear layer holds; `self` `[.., in]`): with the product kernel on ([`CudaFewRowKernels`])
    /// on a GPU, 2 to [`GPU_ROWS_MATMUL_MAX_ROWS`] rows of bf16 or f16 run
    /// [`Array::cuda_rows_matmul`] over the stored rows, everything else MLX's matmul (a
    /// `[1, L, in]` input against the weight as `[1, in, out]`: one graph node).
    pub fn matmul_weight_t(&self, wt: &Array) -> Result<Array> {
        self.matmul_weight_t_held(wt, None)
    }

    /// [`Array::matmul_weight_t`] with the caller's `[1, in, out]` view of `wt` (`batched`, kept
    /// across calls: a `[1, L, in]` input then multiplies it without an ExpandDims node per
    /// product). An error when `batched` is not that view's shape.
    pub fn matmul_weight_t_held(&self, wt: &Array, batched: Option<&Array>) -> Result<Array> {
        if let Some(b) = batched {
            let (bd, wd) = (b.dims(), wt.dims());
            if bd.len() != 3 || bd[0] != 1 || wd.len() != 2 || bd[1..] != wd[..] {
                return Err(Error::shape("matmul_weight_t", format!("a held view {bd:?} of a weight {wd:?}")));
            }
        }
        let d = self.dims();
        let k = d.last().copied().unwrap_or(0);
        let rows = if k > 0 { self.size() / k as usize } else { 0 };
        if (2..=GPU_ROWS_MATMUL_MAX_ROWS).contains(&rows)
            && matches!(self.dtype(), DType::BF16 | DType::F16)
            && wt.dtype() == self.dtype()
            && wt.ndim() == 2
            && wt.dims()[0] == k
            && k % 8 == 0
            && product_kernel_on_gpu()
            && !mlx_ops_only_now()
        {
            let y = self.reshape(&[rows as i32, k])?.cuda_rows_matmul(&wt.swap_axes(0, 1)?)?;
            let mut shape = d[..d.len() - 1].to_vec();
            shape.push(wt.dims()[1]);
            return y.reshape(&shape);
        }
        if d.len() == 3 && d[0] == 1 && wt.ndim() == 2 {
            // `[1, L, in]` against the weight viewed as `[1, in, out]`: MLX's matmul makes one
            // node, where a 2-D weight has it flatten the input and unflatten the product (two
            // more nodes, about a microsecond of host time each on CUDA; a one-row decode
            // step's cost is its nodes). The same product: a batch of one.
            return match batched {
                Some(b) => self.matmul(b),
                None => self.matmul(&wt.expand_dims(0)?),
            };
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
    kernel_on(ATTENTION)
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
