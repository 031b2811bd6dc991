//! Random numbers from explicit keys, so that every draw is reproducible.
//!
//! MLX's generator is counter-based: a [`Key`] plus a shape determines the result. Use
//! [`Key::split`] to derive independent keys instead of reusing one.
//!
//! ```
//! use mlx_array::{random::{self, Key}, DType};
//! # fn main() -> mlx_array::Result<()> {
//! let key = Key::new(42)?;
//! let a = random::normal(&[4], DType::F32, &key)?;
//! let b = random::normal(&[4], DType::F32, &key)?;
//! assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?); // same key, same numbers
//! let (k1, _k2) = key.split()?;
//! assert_ne!(a.to_vec::<f32>()?, random::normal(&[4], DType::F32, &k1)?.to_vec::<f32>()?);
//! # Ok(()) }
//! ```
use crate::array::check_shape;
use crate::error::{Error, Result};
use crate::ffi::{call, stream};
use crate::ops::axis;
use crate::{Array, DType};

/// A PRNG key (MLX's two-u32 key array).
#[derive(Clone, Debug)]
pub struct Key(Array);

impl Key {
    /// The key for `seed`.
    pub fn new(seed: u64) -> Result<Key> {
        call("random_key", |res| unsafe { mlx_sys::mlx_random_key(res, seed) }).map(Key)
    }
    /// Two new keys, independent of each other and of `self`.
    pub fn split(&self) -> Result<(Key, Key)> {
        let mut v = self.split_n(2)?.into_iter();
        Ok((v.next().unwrap(), v.next().unwrap()))
    }
    /// `n` new independent keys.
    pub fn split_n(&self, n: usize) -> Result<Vec<Key>> {
        if n == 0 {
            return Err(Error::arg("random_split", "n must be positive"));
        }
        let num = i32::try_from(n).map_err(|_| Error::arg("random_split", "n exceeds i32"))?;
        let s = stream();
        let keys = call("random_split", |res| unsafe { mlx_sys::mlx_random_split_num(res, self.0.inner.as_ptr(), num, s.as_ptr()) })?;
        (0..n).map(|i| keys.slice_axis(0, i, i + 1)?.squeeze(&[0]).map(Key)).collect()
    }
    /// The key as an array (shape `[2]`, u32).
    pub fn as_array(&self) -> &Array {
        &self.0
    }
}

fn float_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        Ok(())
    } else {
        Err(Error::DType { op, expected: "f32, f16 or bf16".into(), got: dtype.to_string() })
    }
}

/// Normal samples with mean 0 and standard deviation 1.
pub fn normal(shape: &[usize], dtype: DType, key: &Key) -> Result<Array> {
    normal_with(shape, 0.0, 1.0, dtype, key)
}

/// Normal samples with mean `loc` and standard deviation `scale`.
pub fn normal_with(shape: &[usize], loc: f32, scale: f32, dtype: DType, key: &Key) -> Result<Array> {
    float_dtype("random_normal", dtype)?;
    let dims = check_shape("random_normal", shape)?;
    let s = stream();
    call("random_normal", |res| unsafe {
        mlx_sys::mlx_random_normal(res, dims.as_ptr(), dims.len(), dtype.to_mlx() as mlx_sys::mlx_dtype, loc, scale, key.0.inner.as_ptr(), s.as_ptr())
    })
}

/// Uniform samples in `[low, high)`.
pub fn uniform(shape: &[usize], low: f32, high: f32, dtype: DType, key: &Key) -> Result<Array> {
    float_dtype("random_uniform", dtype)?;
    if low.is_nan() || high.is_nan() || low >= high {
        return Err(Error::arg("random_uniform", format!("need low < high, got {low} and {high}")));
    }
    let dims = check_shape("random_uniform", shape)?;
    let (lo, hi) = (Array::scalar(low), Array::scalar(high));
    let s = stream();
    call("random_uniform", |res| unsafe {
        mlx_sys::mlx_random_uniform(res, lo.inner.as_ptr(), hi.inner.as_ptr(), dims.as_ptr(), dims.len(), dtype.to_mlx() as mlx_sys::mlx_dtype, key.0.inner.as_ptr(), s.as_ptr())
    })
}

/// One sample per distribution from unnormalised `logits` along `axis` (u32 indices; the output
/// has `logits`' shape without `axis`).
pub fn categorical(logits: &Array, axis_: i32, key: &Key) -> Result<Array> {
    let ax = axis("random_categorical", logits, axis_)?;
    let s = stream();
    call("random_categorical", |res| unsafe {
        mlx_sys::mlx_random_categorical(res, logits.inner.as_ptr(), ax, key.0.inner.as_ptr(), s.as_ptr())
    })
}

/// `num_samples` independent samples per distribution, in a new last axis.
pub fn categorical_n(logits: &Array, axis_: i32, num_samples: usize, key: &Key) -> Result<Array> {
    let ax = axis("random_categorical", logits, axis_)?;
    let n = i32::try_from(num_samples).ok().filter(|&n| n > 0).ok_or_else(|| Error::arg("random_categorical", "num_samples must be in 1..=i32::MAX"))?;
    let s = stream();
    call("random_categorical", |res| unsafe {
        mlx_sys::mlx_random_categorical_num_samples(res, logits.inner.as_ptr(), ax, n, key.0.inner.as_ptr(), s.as_ptr())
    })
}

/// Booleans that are true with probability `p` (an array broadcast to `shape`).
pub fn bernoulli(p: &Array, shape: &[usize], key: &Key) -> Result<Array> {
    let dims = check_shape("random_bernoulli", shape)?;
    let s = stream();
    call("random_bernoulli", |res| unsafe {
        mlx_sys::mlx_random_bernoulli(res, p.inner.as_ptr(), dims.as_ptr(), dims.len(), key.0.inner.as_ptr(), s.as_ptr())
    })
}

/// Integers uniform in `[low, high)` of an integer `dtype`.
pub fn randint(shape: &[usize], low: i32, high: i32, dtype: DType, key: &Key) -> Result<Array> {
    if low >= high {
        return Err(Error::arg("random_randint", format!("need low < high, got {low} and {high}")));
    }
    if dtype.is_float() || dtype == DType::Bool {
        return Err(Error::DType { op: "random_randint", expected: "an integer dtype".into(), got: dtype.to_string() });
    }
    let dims = check_shape("random_randint", shape)?;
    let (lo, hi) = (Array::scalar(low), Array::scalar(high));
    let s = stream();
    call("random_randint", |res| unsafe {
        mlx_sys::mlx_random_randint(res, lo.inner.as_ptr(), hi.inner.as_ptr(), dims.as_ptr(), dims.len(), dtype.to_mlx() as mlx_sys::mlx_dtype, key.0.inner.as_ptr(), s.as_ptr())
    })
}
