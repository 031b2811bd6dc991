//! Shape manipulation: reshape, transpose, slicing, concatenation, splitting, padding.
use super::axis;
use crate::array::check_shape;
use crate::error::{Error, OpExt, Result};
use crate::Array;
use mlx_rs::ops as m;

impl Array {
    /// Reshape; one dimension may be `-1` (inferred).
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        m::reshape(&self.inner, shape).op("reshape").map(Array::wrap)
    }
    /// The same values in a row-major contiguous buffer (the input's own when it already is
    /// one, else a copy).
    pub fn contiguous(&self) -> Result<Array> {
        self.inner.contiguous().op("contiguous").map(Array::wrap)
    }
    /// Permute axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        m::transpose_axes(&self.inner, axes).op("transpose").map(Array::wrap)
    }
    /// Swap two axes.
    pub fn swap_axes(&self, a: i32, b: i32) -> Result<Array> {
        m::swap_axes(&self.inner, a, b).op("swap_axes").map(Array::wrap)
    }
    /// Insert a length-1 axis.
    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        m::expand_dims(&self.inner, axis).op("expand_dims").map(Array::wrap)
    }
    /// Remove length-1 axes.
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        m::squeeze_axes(&self.inner, axes).op("squeeze").map(Array::wrap)
    }
    /// Merge axes `start..=end` into one.
    pub fn flatten(&self, start: i32, end: i32) -> Result<Array> {
        m::flatten(&self.inner, start, end).op("flatten").map(Array::wrap)
    }
    /// Broadcast to `shape`.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Array> {
        let dims = check_shape("broadcast_to", shape)?;
        m::broadcast_to(&self.inner, &dims).op("broadcast_to").map(Array::wrap)
    }
    /// Repeat the array `reps[i]` times along axis i.
    pub fn tile(&self, reps: &[i32]) -> Result<Array> {
        m::tile(&self.inner, reps).op("tile").map(Array::wrap)
    }

    /// Elements `start..stop` of `axis` (a view: no copy until needed).
    pub fn slice_axis(&self, axis_: i32, start: usize, stop: usize) -> Result<Array> {
        let ax = axis("slice_axis", self, axis_)?;
        let n = self.dims()[ax as usize] as usize;
        if start > stop || stop > n {
            return Err(Error::shape("slice_axis", format!("range {start}..{stop} out of bounds for axis {axis_} of size {n}")));
        }
        if start == 0 && stop == n {
            return Ok(self.clone());
        }
        let parts = m::split_at_indices(&self.inner, &[start as i32, stop as i32], ax).op("slice_axis")?;
        Ok(Array::wrap(parts.into_iter().nth(1).expect("split into 3 parts")))
    }

    /// General strided slice: `start[i]..stop[i]` step `strides[i]` on every axis.
    pub fn slice(&self, start: &[usize], stop: &[usize], strides: &[usize]) -> Result<Array> {
        let n = self.ndim();
        if start.len() != n || stop.len() != n || strides.len() != n {
            return Err(Error::shape("slice", format!("need {n} starts, stops and strides")));
        }
        let mut out = self.clone();
        for ax in 0..n {
            let dim = self.dims()[ax] as usize;
            if start[ax] > stop[ax] || stop[ax] > dim || strides[ax] == 0 {
                return Err(Error::shape("slice", format!("bad range {}..{} step {} for axis {ax} of size {dim}", start[ax], stop[ax], strides[ax])));
            }
            out = out.slice_axis(ax as i32, start[ax], stop[ax])?;
            if strides[ax] > 1 {
                let len = stop[ax] - start[ax];
                let idx: Vec<i32> = (0..len).step_by(strides[ax]).map(|i| i as i32).collect();
                let k = idx.len();
                out = out.take(&Array::from_slice(&idx, &[k])?, ax as i32)?;
            }
        }
        Ok(out)
    }

    /// Split into pieces at the given indices along `axis`.
    pub fn split_at(&self, indices: &[usize], axis_: i32) -> Result<Vec<Array>> {
        let ax = axis("split_at", self, axis_)?;
        let idx: Vec<i32> = indices.iter().map(|&i| i as i32).collect();
        let v = m::split_at_indices(&self.inner, &idx, ax).op("split_at")?;
        Ok(v.into_iter().map(Array::wrap).collect())
    }

    /// Split into `parts` equal pieces along `axis`.
    pub fn split(&self, parts: usize, axis_: i32) -> Result<Vec<Array>> {
        let ax = axis("split", self, axis_)?;
        let n = self.dims()[ax as usize] as usize;
        if parts == 0 || n % parts != 0 {
            return Err(Error::shape("split", format!("axis of size {n} does not split into {parts} equal parts")));
        }
        let v = m::split_equal(&self.inner, parts as i32, ax).op("split")?;
        Ok(v.into_iter().map(Array::wrap).collect())
    }

    /// Pad every axis with `(before, after)` elements of `value`.
    pub fn pad(&self, widths: &[(usize, usize)], value: f32) -> Result<Array> {
        if widths.len() != self.ndim() {
            return Err(Error::shape("pad", format!("{} pad widths for a {}-d array", widths.len(), self.ndim())));
        }
        let w: Vec<(i32, i32)> = widths.iter().map(|&(a, b)| (a as i32, b as i32)).collect();
        let v = Array::scalar_as(value, self.dtype())?;
        m::pad(&self.inner, w.as_slice(), v.inner, None).op("pad").map(Array::wrap)
    }

    /// Lower triangle (elements above diagonal `k` zeroed).
    pub fn tril(&self, k: i32) -> Result<Array> {
        m::tril(&self.inner, k).op("tril").map(Array::wrap)
    }
    /// Upper triangle.
    pub fn triu(&self, k: i32) -> Result<Array> {
        m::triu(&self.inner, k).op("triu").map(Array::wrap)
    }
}

/// Join arrays along an existing axis.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    if arrays.is_empty() {
        return Err(Error::arg("concatenate", "no arrays"));
    }
    let v: Vec<&mlx_rs::Array> = arrays.iter().map(|a| &a.inner).collect();
    m::concatenate(&v, axis).op("concatenate").map(Array::wrap)
}

/// Join arrays along a new axis.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    if arrays.is_empty() {
        return Err(Error::arg("stack", "no arrays"));
    }
    let v: Vec<&mlx_rs::Array> = arrays.iter().map(|a| &a.inner).collect();
    m::stack(&v, axis).op("stack").map(Array::wrap)
}

impl Array {
    /// A copy of `self` with the block starting at `start` (one index per axis) replaced by
    /// `update` (same rank and dtype). MLX reuses `self`'s buffer when it holds the only reference,
    /// which makes this the cheap way to fill a preallocated cache.
    pub fn slice_update(&self, update: &Array, start: &[usize]) -> Result<Array> {
        let (ds, us) = (self.shape(), update.shape());
        if start.len() != ds.len() || us.len() != ds.len() || start.iter().zip(&us).zip(&ds).any(|((s, u), d)| s + u > *d) {
            return Err(Error::shape("slice_update", format!("update {us:?} at {start:?} does not fit in {ds:?}")));
        }
        if self.dtype() != update.dtype() {
            return Err(Error::DType { op: "slice_update", expected: self.dtype().to_string(), got: update.dtype().to_string() });
        }
        let st: Vec<i32> = start.iter().map(|&s| s as i32).collect();
        let sp: Vec<i32> = start.iter().zip(&us).map(|(&s, &u)| (s + u) as i32).collect();
        let strides = vec![1i32; st.len()];
        let s = super::quant::stream();
        super::quant::ffi("slice_update", |res| unsafe {
            mlx_sys::mlx_slice_update(res, self.inner.as_ptr(), update.inner.as_ptr(), st.as_ptr(), st.len(), sp.as_ptr(), sp.len(), strides.as_ptr(), strides.len(), s.as_ptr())
        })
    }
}
