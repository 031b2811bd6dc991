//! Matrix products.
use crate::error::{Error, OpExt, Result};
use crate::{Array, DType};
use mlx_rs::ops as m;

impl Array {
    /// Matrix product with NumPy broadcasting of batch dimensions.
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        m::matmul(&self.inner, &other.inner).op("matmul").map(Array::wrap)
    }

    /// `alpha * (self @ b) + beta * c`, computed explicitly (matmul, scale, then add `beta * c`),
    /// so a non-zero `c` is always applied, on every backend.
    pub fn addmm(&self, b: &Array, c: &Array, alpha: f32, beta: f32) -> Result<Array> {
        let mut p = self.matmul(b)?;
        if alpha != 1.0 {
            p = p.mul_scalar(alpha)?;
        }
        if beta == 0.0 {
            return Ok(p);
        }
        let c = if beta == 1.0 { c.clone() } else { c.mul_scalar(beta)? };
        p.add(&c)
    }

    /// `self @ w.T + bias` (a linear layer with weight `[out, in]`).
    pub fn linear(&self, w: &Array, bias: Option<&Array>) -> Result<Array> {
        let wt = w.swap_axes(-1, -2)?;
        let y = self.matmul(&wt)?;
        match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}

/// Matrix products with gathered operands (MoE expert dispatch): `a[lhs_indices] @ b[rhs_indices]`,
/// where the indices select along the batch dimensions of `a` and `b`. MLX's CPU kernel takes
/// only f32, so on the CPU other float operands are multiplied in f32 and the product rounded to
/// their dtype (an MoE model in bf16 on the CPU).
pub fn gather_mm(a: &Array, b: &Array, lhs_indices: Option<&Array>, rhs_indices: Option<&Array>, sorted_indices: bool) -> Result<Array> {
    if a.ndim() < 2 || b.ndim() < 2 {
        return Err(Error::shape("gather_mm", format!("operands must be at least 2-d, got {:?} and {:?}", a.shape(), b.shape())));
    }
    let dt = a.dtype();
    if dt != DType::F32 && dt.is_float() && b.dtype() == dt && crate::default_device()? == crate::Device::Cpu {
        let (a32, b32) = (a.astype(DType::F32)?, b.astype(DType::F32)?);
        return gather_mm(&a32, &b32, lhs_indices, rhs_indices, sorted_indices)?.astype(dt);
    }
    m::gather_mm(&a.inner, &b.inner, lhs_indices.map(|x| &x.inner), rhs_indices.map(|x| &x.inner), sorted_indices)
        .op("gather_mm")
        .map(Array::wrap)
}
