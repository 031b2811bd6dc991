//! Operations, as methods on [`crate::Array`] (and a few free functions over several arrays).
//! Every one is lazy and returns `Result`: MLX's own checks become [`crate::Error::Mlx`].
mod cuda;
mod fused;
mod index;
mod linalg;
mod math;
mod nn;
mod packed;
mod quant;
mod reduce;
mod shape;

pub use cuda::{cuda_few_row_kernels, set_cuda_few_row_kernels, CudaFewRowKernels, FEW_QUERY_ATTENTION_MAX_KEYS, FEW_QUERY_ATTENTION_MAX_WORK, GPU_ROWS_MATMUL_MAX_ROWS};
pub use fused::{cpu_fusion, fused, set_cpu_fusion, CpuFusion, FusedFn};
pub use index::scatter_rows;
pub use linalg::gather_mm;
pub use math::where_;
pub use nn::{gpu_attention_key_bucket, heads, mlx_ops_only, set_gpu_attention_key_bucket, AttentionMask, GPU_PRODUCT_ATTENTION_MAX_QUERIES, HeadGroup, MlxOpsScope, RopeConfig};
pub use packed::{cpu_kernels_isa, cpu_kernels_threads, cpu_packed_supports, set_cpu_kernels_isa, CPU_PACKED_MAX_ROWS, CPU_PACKED_NARROW_MAX_ROWS};
pub use quant::{gather_qmm, QuantMode, Quantized};
pub use shape::{concatenate, stack};

use crate::Array;

/// Normalise an axis against `ndim`, allowing negative axes.
pub(crate) fn axis(op: &'static str, a: &Array, axis: i32) -> crate::Result<i32> {
    let n = a.ndim() as i32;
    let ax = if axis < 0 { axis + n } else { axis };
    if ax < 0 || ax >= n {
        return Err(crate::Error::shape(op, format!("axis {axis} out of range for shape {:?}", a.shape())));
    }
    Ok(ax)
}
