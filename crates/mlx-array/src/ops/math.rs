//! Elementwise arithmetic, comparisons and activations (NumPy broadcasting).
use crate::error::{OpExt, Result};
use crate::Array;
use mlx_rs::ops as m;

macro_rules! unary {
    ($($(#[$doc:meta])* $name:ident => $f:path;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> Result<Array> {
            $f(&self.inner).op(stringify!($name)).map(Array::wrap)
        }
    )*};
}

macro_rules! binary {
    ($($(#[$doc:meta])* $name:ident => $f:path;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self, other: &Array) -> Result<Array> {
            $f(&self.inner, &other.inner).op(stringify!($name)).map(Array::wrap)
        }
    )*};
}

impl Array {
    unary! {
        neg => m::negative; abs => m::abs; exp => m::exp; log => m::log; sqrt => m::sqrt;
        rsqrt => m::rsqrt; square => m::square; sin => m::sin; cos => m::cos; tanh => m::tanh;
        sigmoid => m::sigmoid; sign => m::sign; floor => m::floor; ceil => m::ceil;
        reciprocal => m::reciprocal;
        /// Gauss error function.
        erf => m::erf;
        erfinv => m::erfinv;
        is_nan => m::is_nan; is_inf => m::is_inf;
        logical_not => m::logical_not;
    }
    binary! {
        add => m::add; sub => m::subtract; mul => m::multiply; div => m::divide;
        pow => m::power; maximum => m::maximum; minimum => m::minimum; remainder => m::remainder;
        eq => m::eq; ne => m::ne; lt => m::lt; le => m::le; gt => m::gt; ge => m::ge;
        logical_and => m::logical_and; logical_or => m::logical_or;
        logaddexp => m::logaddexp;
    }

    /// `self + s`, with `s` in this array's dtype.
    pub fn add_scalar(&self, s: f32) -> Result<Array> {
        self.add(&Array::scalar_as(s, self.dtype())?)
    }
    /// `self * s`, with `s` in this array's dtype.
    pub fn mul_scalar(&self, s: f32) -> Result<Array> {
        self.mul(&Array::scalar_as(s, self.dtype())?)
    }
    /// `min(max(self, lo), hi)`.
    pub fn clip(&self, lo: f32, hi: f32) -> Result<Array> {
        let d = self.dtype();
        self.maximum(&Array::scalar_as(lo, d)?)?.minimum(&Array::scalar_as(hi, d)?)
    }
    /// `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Array> {
        self.mul(&self.sigmoid()?)
    }
    /// Exact GELU: `0.5 x (1 + erf(x / sqrt 2))`.
    pub fn gelu(&self) -> Result<Array> {
        let d = self.dtype();
        let inner = self.mul_scalar(std::f32::consts::FRAC_1_SQRT_2)?.erf()?.add_scalar(1.0)?;
        self.mul(&inner)?.mul(&Array::scalar_as(0.5, d)?)
    }
    /// GELU, tanh approximation (`gelu_pytorch_tanh`, Gemma's `hidden_activation`).
    pub fn gelu_tanh(&self) -> Result<Array> {
        let c = (2.0f32 / std::f32::consts::PI).sqrt();
        let x3 = self.mul(&self.square()?)?;
        let t = self.add(&x3.mul_scalar(0.044715)?)?.mul_scalar(c)?.tanh()?;
        self.mul(&t.add_scalar(1.0)?)?.mul_scalar(0.5)
    }
    /// `tanh(x / cap) * cap` (logit soft-capping).
    pub fn softcap(&self, cap: f32) -> Result<Array> {
        self.mul_scalar(1.0 / cap)?.tanh()?.mul_scalar(cap)
    }
}

/// `cond ? a : b`, elementwise with broadcasting.
pub fn where_(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    m::select(&cond.inner, &a.inner, &b.inner).op("where").map(Array::wrap)
}
