//! Gathers, scatters, sorting and selection.
use super::axis;
use crate::error::{Error, OpExt, Result};
use crate::Array;
use mlx_rs::ops as m;

impl Array {
    /// Take the entries `indices` (any integer dtype, any shape) along `axis`.
    pub fn take(&self, indices: &Array, axis_: i32) -> Result<Array> {
        let ax = axis("take", self, axis_)?;
        self.inner.take_axis(&indices.inner, ax).op("take").map(Array::wrap)
    }
    /// `out[.., i, ..] = self[.., indices[.., i, ..], ..]` along `axis` (indices broadcast with self).
    pub fn take_along_axis(&self, indices: &Array, axis_: i32) -> Result<Array> {
        let ax = axis("take_along_axis", self, axis_)?;
        self.inner.take_along_axis(&indices.inner, ax).op("take_along_axis").map(Array::wrap)
    }
    /// The inverse of [`Array::take_along_axis`]: a copy with `values` written at `indices`.
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis_: i32) -> Result<Array> {
        let ax = axis("put_along_axis", self, axis_)?;
        self.inner.put_along_axis(&indices.inner, &values.inner, ax).op("put_along_axis").map(Array::wrap)
    }
    /// Sorted copy along `axis`.
    pub fn sort(&self, axis_: i32) -> Result<Array> {
        let ax = axis("sort", self, axis_)?;
        m::sort_axis(&self.inner, ax).op("sort").map(Array::wrap)
    }
    /// Indices that sort along `axis` (ascending, u32).
    pub fn argsort(&self, axis_: i32) -> Result<Array> {
        let ax = axis("argsort", self, axis_)?;
        m::argsort_axis(&self.inner, ax).op("argsort").map(Array::wrap)
    }
    /// Indices that partition along `axis`: the `kth` entry is in sorted position, smaller before it.
    pub fn argpartition(&self, kth: i32, axis_: i32) -> Result<Array> {
        let ax = axis("argpartition", self, axis_)?;
        let n = self.dims()[ax as usize];
        if kth < -n || kth >= n {
            return Err(Error::arg("argpartition", format!("kth {kth} out of range for axis of size {n}")));
        }
        m::argpartition_axis(&self.inner, kth, ax).op("argpartition").map(Array::wrap)
    }
    /// The `k` largest values along `axis` (unordered).
    pub fn topk(&self, k: usize, axis_: i32) -> Result<Array> {
        let ax = axis("topk", self, axis_)?;
        let n = self.dims()[ax as usize] as usize;
        if k == 0 || k > n {
            return Err(Error::arg("topk", format!("k = {k} for an axis of size {n}")));
        }
        m::indexing::topk_axis(&self.inner, k as i32, ax).op("topk").map(Array::wrap)
    }
    /// Indices (u32) of the `k` largest values along `axis` (unordered).
    pub fn topk_indices(&self, k: usize, axis_: i32) -> Result<Array> {
        let ax = axis("topk_indices", self, axis_)?;
        let n = self.dims()[ax as usize] as usize;
        if k == 0 || k > n {
            return Err(Error::arg("topk_indices", format!("k = {k} for an axis of size {n}")));
        }
        let neg = self.neg()?;
        let part = neg.argpartition(k as i32 - 1, ax)?;
        part.slice_axis(ax, 0, k)
    }
}

/// A copy of `dst` with rows `rows[i]` (axis 0) replaced by `updates[i]`.
///
/// `rows` is a 1-d integer array of length n, `updates` has shape `[n, dst.shape[1..]]`.
/// Rows must be distinct (a repeated row keeps one of its updates, unspecified which).
pub fn scatter_rows(dst: &Array, rows: &Array, updates: &Array) -> Result<Array> {
    let (ds, us) = (dst.shape(), updates.shape());
    if rows.ndim() != 1 || us.is_empty() || us[0] != rows.shape()[0] || us[1..] != ds[1..] {
        return Err(Error::shape("scatter_rows", format!("dst {ds:?}, rows {:?}, updates {us:?}", rows.shape())));
    }
    // MLX scatter wants updates shaped [n, 1, rest...]: one slice of dst per index.
    let mut ushape: Vec<i32> = updates.dims().to_vec();
    ushape.insert(1, 1);
    let u = updates.reshape(&ushape)?;
    m::indexing::scatter_single(&dst.inner, &rows.inner, &u.inner, 0).op("scatter_rows").map(Array::wrap)
}
