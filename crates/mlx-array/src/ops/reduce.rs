//! Reductions, softmax, scans.
use super::axis;
use crate::error::{OpExt, Result};
use crate::Array;
use mlx_rs::ops as m;

macro_rules! reduce {
    ($($(#[$doc:meta])* $name:ident => $f:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self, axes: &[i32], keep_dims: bool) -> Result<Array> {
            let axes = self.all_axes_if_empty(axes);
            self.inner.$f(&axes, keep_dims).op(stringify!($name)).map(Array::wrap)
        }
    )*};
}

impl Array {
    fn all_axes_if_empty(&self, axes: &[i32]) -> Vec<i32> {
        if axes.is_empty() { (0..self.ndim() as i32).collect() } else { axes.to_vec() }
    }
    reduce! {
        /// Sum over `axes` (all axes when empty).
        sum => sum_axes;
        /// Mean over `axes` (all axes when empty).
        mean => mean_axes;
        /// Maximum over `axes` (all axes when empty).
        max => max_axes;
        /// Minimum over `axes` (all axes when empty).
        min => min_axes;
        /// Product over `axes` (all axes when empty).
        prod => prod_axes;
        /// `log(sum(exp(x)))` over `axes`, computed stably.
        logsumexp => logsumexp_axes;
    }
    /// Variance over `axes` (population variance, ddof 0).
    pub fn var(&self, axes: &[i32], keep_dims: bool) -> Result<Array> {
        let axes = self.all_axes_if_empty(axes);
        self.inner.var_axes(&axes, keep_dims, 0).op("var").map(Array::wrap)
    }
    /// Index of the maximum along `axis` (u32).
    pub fn argmax(&self, axis_: i32, keep_dims: bool) -> Result<Array> {
        let ax = axis("argmax", self, axis_)?;
        m::indexing::argmax_axis(&self.inner, ax, keep_dims).op("argmax").map(Array::wrap)
    }
    /// Index of the minimum along `axis` (u32).
    pub fn argmin(&self, axis_: i32, keep_dims: bool) -> Result<Array> {
        let ax = axis("argmin", self, axis_)?;
        m::indexing::argmin_axis(&self.inner, ax, keep_dims).op("argmin").map(Array::wrap)
    }
    /// Softmax along `axis`; `precise` accumulates half-precision inputs in f32.
    pub fn softmax(&self, axis_: i32, precise: bool) -> Result<Array> {
        let ax = axis("softmax", self, axis_)?;
        m::softmax_axis(&self.inner, ax, precise).op("softmax").map(Array::wrap)
    }
    /// `x - logsumexp(x)` along `axis`. For f32 `[B, V]` along the last axis on a CPU stream one
    /// primitive with a vectorised exp (MLX's CPU logsumexp calls libm's exp per element, ~1.9 ms
    /// at V = 151936); gradients and every other case are MLX's ops.
    pub fn log_softmax(&self, axis_: i32) -> Result<Array> {
        let ax = axis("log_softmax", self, axis_)?;
        if self.ndim() == 2 && ax == 1 {
            let (xp, s) = (self.inner.as_ptr(), crate::ffi::stream());
            return crate::ffi::call("log_softmax", |res| unsafe { mlx_sys::mlx_models_log_softmax(res, xp, s.as_ptr()) });
        }
        self.sub(&self.logsumexp(&[axis_], true)?)
    }
    /// Cumulative sum along `axis`; `reverse` scans from the end, `inclusive` includes self.
    pub fn cumsum(&self, axis_: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        let ax = axis("cumsum", self, axis_)?;
        m::cumsum(&self.inner, ax, reverse, inclusive).op("cumsum").map(Array::wrap)
    }
    /// Cumulative maximum along `axis`.
    pub fn cummax(&self, axis_: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        let ax = axis("cummax", self, axis_)?;
        m::cummax(&self.inner, ax, reverse, inclusive).op("cummax").map(Array::wrap)
    }
}
