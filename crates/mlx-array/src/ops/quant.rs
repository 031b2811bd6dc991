//! Quantization: affine 2-8 bit, and the microscaling float formats mxfp4 / mxfp8.
//!
//! These call mlx-c directly (mlx-rs 0.33 only offers affine): arguments are validated here first,
//! so MLX itself should never reject them; if it does, the error names the operation.
use crate::error::{Error, Result};
use crate::{Array, DType};
use std::ffi::CStr;

/// Quantization format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMode {
    /// `w ≈ scale * q + bias` per group, `bits` in {2, 3, 4, 5, 6, 8}, groups of 32, 64 or 128.
    Affine { bits: u8, group_size: u32 },
    /// OCP MX FP4 (E2M1) with a shared E8M0 scale per 32 elements; no biases.
    Mxfp4,
    /// OCP MX FP8 (E4M3) with a shared E8M0 scale per 32 elements; no biases.
    Mxfp8,
    /// NVIDIA FP4 (E2M1) with an E4M3 scale per 16 elements; no biases.
    Nvfp4,
}

impl QuantMode {
    fn parts(self) -> (i32, i32, &'static CStr) {
        match self {
            QuantMode::Affine { bits, group_size } => (bits as i32, group_size as i32, c"affine"),
            QuantMode::Mxfp4 => (4, 32, c"mxfp4"),
            QuantMode::Mxfp8 => (8, 32, c"mxfp8"),
            QuantMode::Nvfp4 => (4, 16, c"nvfp4"),
        }
    }
    fn validate(self, op: &'static str) -> Result<()> {
        if let QuantMode::Affine { bits, group_size } = self {
            if ![2, 3, 4, 5, 6, 8].contains(&bits) {
                return Err(Error::arg(op, format!("affine bits must be 2, 3, 4, 5, 6 or 8, got {bits}")));
            }
            if ![32, 64, 128].contains(&group_size) {
                return Err(Error::arg(op, format!("group size must be 32, 64 or 128, got {group_size}")));
            }
        }
        Ok(())
    }
    /// Bits per weight element.
    pub fn bits(self) -> u32 {
        self.parts().0 as u32
    }
    /// Elements sharing one scale.
    pub fn group_size(self) -> u32 {
        self.parts().1 as u32
    }
    /// The mode's name in MLX and in mlx-lm's config.json (`affine`, `mxfp4`, `mxfp8`, `nvfp4`).
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine { .. } => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }
    /// The mode mlx-lm's config.json describes (`mode` absent = affine). Sizes the mode cannot
    /// take are errors: the microscaling modes have fixed bits and group sizes.
    pub fn from_parts(mode: &str, bits: u32, group_size: u32) -> Result<Self> {
        let fixed = |m: QuantMode| {
            if m.bits() == bits && m.group_size() == group_size {
                Ok(m)
            } else {
                Err(Error::arg("quantize", format!("{mode} takes {} bits in groups of {}, not {bits} / {group_size}", m.bits(), m.group_size())))
            }
        };
        let m = match mode {
            "affine" => {
                let bits = u8::try_from(bits).map_err(|_| Error::arg("quantize", format!("affine bits {bits}")))?;
                QuantMode::Affine { bits, group_size }
            }
            "mxfp4" => fixed(QuantMode::Mxfp4)?,
            "mxfp8" => fixed(QuantMode::Mxfp8)?,
            "nvfp4" => fixed(QuantMode::Nvfp4)?,
            other => return Err(Error::arg("quantize", format!("unknown quantization mode {other:?} (affine, mxfp4, mxfp8, nvfp4)"))),
        };
        m.validate("quantize")?;
        Ok(m)
    }
}

/// A quantized matrix `[.., out, in]`: packed u32 weights, scales and (affine only) biases.
#[derive(Debug, Clone)]
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub mode: QuantMode,
}

fn opt_int(v: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int { value: v, has_value: true }
}

pub(crate) use crate::ffi::{call as ffi, stream};

fn null_array() -> mlx_sys::mlx_array {
    mlx_sys::mlx_array { ctx: std::ptr::null_mut() }
}

impl Array {
    /// Quantize a float matrix `[.., out, in]` along its last axis.
    pub fn quantize(&self, mode: QuantMode) -> Result<Quantized> {
        self.quantize_scaled(mode, None)
    }

    /// [`Array::quantize`] with nvfp4's per-tensor scale: MLX's `global_scale`, the tensor's
    /// max |x| (a f32 scalar), by which the E4M3 group scales are expressed. Only nvfp4 takes one.
    pub fn quantize_scaled(&self, mode: QuantMode, global_scale: Option<&Array>) -> Result<Quantized> {
        mode.validate("quantize")?;
        check_global_scale("quantize", mode, global_scale)?;
        let (bits, gs, name) = mode.parts();
        if self.ndim() < 2 || !self.dtype().is_float() {
            return Err(Error::shape("quantize", format!("need a float matrix, got {:?} {}", self.shape(), self.dtype())));
        }
        let last = *self.dims().last().unwrap();
        if last % gs != 0 {
            return Err(Error::shape("quantize", format!("last dimension {last} is not a multiple of the group size {gs}")));
        }
        let s = stream();
        let mut vec = unsafe { mlx_sys::mlx_vector_array_new() };
        let st = crate::ffi::status("quantize", || unsafe {
            mlx_sys::mlx_quantize(&mut vec, self.inner.as_ptr(), opt_int(gs), opt_int(bits), name.as_ptr(), global_scale.map(|g| g.inner.as_ptr()).unwrap_or_else(null_array), s.as_ptr())
        });
        let mut parts = Vec::new();
        if st.is_ok() {
            for i in 0..unsafe { mlx_sys::mlx_vector_array_size(vec) } {
                let mut a = unsafe { mlx_sys::mlx_array_new() };
                unsafe { mlx_sys::mlx_vector_array_get(&mut a, vec, i) };
                parts.push(Array::wrap(unsafe { mlx_rs::Array::from_ptr(a) }));
            }
        }
        unsafe { mlx_sys::mlx_vector_array_free(vec) };
        st?;
        if parts.len() < 2 {
            return Err(Error::Mlx { op: "quantize", msg: format!("MLX returned {} arrays", parts.len()) });
        }
        let mut it = parts.into_iter();
        let (weight, scales, biases) = (it.next().unwrap(), it.next().unwrap(), it.next());
        let biases = if matches!(mode, QuantMode::Affine { .. }) { biases } else { None };
        Ok(Quantized { weight, scales, biases, mode })
    }
}

impl Quantized {
    fn check(&self, op: &'static str) -> Result<()> {
        self.mode.validate(op)?;
        if matches!(self.mode, QuantMode::Affine { .. }) && self.biases.is_none() {
            return Err(Error::arg(op, "affine quantization needs biases"));
        }
        if self.weight.dtype() != DType::U32 {
            return Err(Error::DType { op, expected: "u32 packed weights".into(), got: self.weight.dtype().to_string() });
        }
        Ok(())
    }
    fn biases_ptr(&self) -> mlx_sys::mlx_array {
        self.biases.as_ref().map(|b| b.inner.as_ptr()).unwrap_or_else(null_array)
    }
    /// Number of input features (unpacked last dimension).
    pub fn in_features(&self) -> usize {
        let packed = *self.weight.dims().last().unwrap_or(&0) as usize;
        packed * 32 / self.mode.bits() as usize
    }

    /// Output features (rows of the stored `[out, in]` weight; per expert for stacked ones).
    pub fn out_features(&self) -> usize {
        self.weight.dims().iter().rev().nth(1).copied().unwrap_or(1) as usize
    }

    /// The dtype [`Quantized::matmul`] gives an input of dtype `x` (MLX's `quantized_matmul`):
    /// f32 when the input or the scales are f32, else the input's.
    pub fn matmul_dtype(&self, x: DType) -> DType {
        if x == DType::F32 || self.scales.dtype() == DType::F32 {
            DType::F32
        } else {
            x
        }
    }

    /// Back to a float matrix (`dtype` of the scales for affine, f32 otherwise unless given).
    pub fn dequantize(&self, dtype: Option<DType>) -> Result<Array> {
        self.dequantize_scaled(dtype, None)
    }

    /// [`Quantized::dequantize`] of nvfp4 quantized with a `global_scale`
    /// ([`Array::quantize_scaled`]).
    pub fn dequantize_scaled(&self, dtype: Option<DType>, global_scale: Option<&Array>) -> Result<Array> {
        self.check("dequantize")?;
        check_global_scale("dequantize", self.mode, global_scale)?;
        // Float scales of another dtype than the output's are converted first, so the result is
        // computed in `dtype` (bf16 scales widen to f32 exactly).
        if let Some(dt) = dtype {
            if self.scales.dtype().is_float() && self.scales.dtype() != dt {
                let q = Quantized {
                    weight: self.weight.clone(),
                    scales: self.scales.astype(dt)?,
                    biases: self.biases.as_ref().map(|b| b.astype(dt)).transpose()?,
                    mode: self.mode,
                };
                return q.dequantize_scaled(dtype, global_scale);
            }
        }
        let (bits, gs, name) = self.mode.parts();
        let dt = mlx_sys::mlx_optional_dtype {
            value: dtype.map(|d| d.to_mlx() as mlx_sys::mlx_dtype).unwrap_or(0),
            has_value: dtype.is_some(),
        };
        let s = stream();
        ffi("dequantize", |res| unsafe {
            mlx_sys::mlx_dequantize(res, self.weight.inner.as_ptr(), self.scales.inner.as_ptr(), self.biases_ptr(), opt_int(gs), opt_int(bits), name.as_ptr(), global_scale.map(|g| g.inner.as_ptr()).unwrap_or_else(null_array), dt, s.as_ptr())
        })
    }

    /// `x @ W.T` (`transpose = true`, weights stored `[out, in]`) or `x @ W`.
    pub fn matmul(&self, x: &Array, transpose: bool) -> Result<Array> {
        self.check("quantized_matmul")?;
        let (bits, gs, name) = self.mode.parts();
        let k = *x.dims().last().ok_or_else(|| Error::shape("quantized_matmul", "0-d input"))? as usize;
        if transpose && k != self.in_features() {
            return Err(Error::shape("quantized_matmul", format!("input has {k} features, weights expect {}", self.in_features())));
        }
        if transpose && self.sm90_route_on_gpu(x, k)? {
            let dt = self.matmul_dtype(x.dtype());
            return x.astype(dt)?.matmul(&self.dequantize(Some(dt))?.swap_axes(-1, -2)?);
        }
        let s = stream();
        ffi("quantized_matmul", |res| unsafe {
            mlx_sys::mlx_quantized_matmul(res, x.inner.as_ptr(), self.weight.inner.as_ptr(), self.scales.inner.as_ptr(), self.biases_ptr(), transpose, opt_int(gs), opt_int(bits), name.as_ptr(), s.as_ptr())
        })
    }

    /// Whether `x @ W.T` runs on a GPU and is one [`libmlx_sm90_product`] names.
    fn sm90_route_on_gpu(&self, x: &Array, k: usize) -> Result<bool> {
        Ok(libmlx_sm90_product(self.mode, self.out_features(), k, x.size() / k.max(1)) && crate::default_device()? == crate::Device::Gpu)
    }
}

/// Whether libmlx 0.32's CUDA dispatch gives `x @ W.T` (`rows` rows of `k` inputs, `n` outputs)
/// to its sm90 kernel (`supports_qmm_sm90` in `quantized/qmm/qmm.cu`: affine 4 or 8 bits, `k` a
/// multiple of 64 and at most one group, `n` a multiple of 4, more than one row). Such products
/// run over the dequantized weight on a GPU instead. On an H100 that kernel returned garbage for
/// them: 4 bf16 outputs fail its TMA descriptor set-up ("Failed to initialize the TMA
/// descriptor", strides (2, 8); `scripts/gpu/qmm_probe.py --only narrow`), and the Gemma 4 MoE
/// test checkpoint, whose projections are all 64 wide in groups of 64, came out of its first layer
/// off by 6.1 where the CPU's values reach 6.5 (`logits_probe --against-cpu`). Only weights whose
/// input is a single group qualify, so no real checkpoint's layers do (their inputs are hundreds
/// wide in groups of at most 128), and dequantizing the few that do is cheap.
pub(crate) fn libmlx_sm90_product(mode: QuantMode, n: usize, k: usize, rows: usize) -> bool {
    let QuantMode::Affine { bits: 4 | 8, group_size } = mode else { return false };
    k % 64 == 0 && k <= group_size as usize && n % 4 == 0 && rows > 1
}

/// Quantized [`crate::ops::gather_mm`]: `x[lhs_indices] @ W[rhs_indices].T` for MoE experts.
pub fn gather_qmm(x: &Array, w: &Quantized, lhs_indices: Option<&Array>, rhs_indices: Option<&Array>, transpose: bool, sorted_indices: bool) -> Result<Array> {
    w.check("gather_qmm")?;
    let (bits, gs, name) = w.mode.parts();
    let ptr = |a: Option<&Array>| a.map(|a| a.inner.as_ptr()).unwrap_or_else(null_array);
    let s = stream();
    ffi("gather_qmm", |res| unsafe {
        mlx_sys::mlx_gather_qmm(res, x.inner.as_ptr(), w.weight.inner.as_ptr(), w.scales.inner.as_ptr(), w.biases_ptr(), ptr(lhs_indices), ptr(rhs_indices), transpose, opt_int(gs), opt_int(bits), name.as_ptr(), sorted_indices, s.as_ptr())
    })
}

/// A global scale is a f32 scalar, and nvfp4's alone.
fn check_global_scale(op: &'static str, mode: QuantMode, g: Option<&Array>) -> Result<()> {
    let Some(g) = g else { return Ok(()) };
    if mode != QuantMode::Nvfp4 {
        return Err(Error::arg(op, format!("a global scale applies to nvfp4, not {}", mode.name())));
    }
    if g.dtype() != DType::F32 || g.size() != 1 {
        return Err(Error::arg(op, format!("the global scale must be one f32, got {} {:?}", g.dtype(), g.shape())));
    }
    Ok(())
}

impl Array {
    /// Round a float array to OCP FP8 E4M3 (MLX's `to_fp8`): one `u8` code per element, no
    /// scale. Pair with [`Array::from_fp8`] for a quantize-dequantize round trip.
    pub fn to_fp8(&self) -> Result<Array> {
        if !self.dtype().is_float() {
            return Err(Error::DType { op: "to_fp8", expected: "a float array".into(), got: self.dtype().to_string() });
        }
        let s = stream();
        ffi("to_fp8", |res| unsafe { mlx_sys::mlx_to_fp8(res, self.inner.as_ptr(), s.as_ptr()) })
    }

    /// E4M3 codes (`u8`, from [`Array::to_fp8`]) back to floats of `dtype` (MLX's `from_fp8`).
    pub fn from_fp8(&self, dtype: DType) -> Result<Array> {
        if self.dtype() != DType::U8 {
            return Err(Error::DType { op: "from_fp8", expected: "u8 E4M3 codes".into(), got: self.dtype().to_string() });
        }
        if !dtype.is_float() {
            return Err(Error::DType { op: "from_fp8", expected: "a float output dtype".into(), got: dtype.to_string() });
        }
        let s = stream();
        ffi("from_fp8", |res| unsafe { mlx_sys::mlx_from_fp8(res, self.inner.as_ptr(), dtype.to_mlx() as mlx_sys::mlx_dtype, s.as_ptr()) })
    }
}

#[cfg(test)]
mod tests {
    use super::{libmlx_sm90_product, QuantMode};

    #[test]
    fn libmlx_sm90_products_are_those_of_one_group_of_a_multiple_of_64_inputs() {
        let q = |bits, group_size| QuantMode::Affine { bits, group_size };
        // the test checkpoints' 4-expert router (8 bits, group 64) and 64-wide projections
        assert!(libmlx_sm90_product(q(8, 64), 4, 64, 2));
        assert!(libmlx_sm90_product(q(4, 64), 32, 64, 33));
        assert!(libmlx_sm90_product(q(4, 128), 256, 128, 8));
        // inputs of several groups (every real checkpoint), groups of 32, or not a multiple of 64
        assert!(!libmlx_sm90_product(q(4, 64), 128, 128, 33));
        assert!(!libmlx_sm90_product(q(4, 32), 128, 64, 33));
        assert!(!libmlx_sm90_product(q(4, 64), 128, 32, 33));
        // other bit widths and formats, outputs not a multiple of 4, one row (the vector kernel)
        assert!(!libmlx_sm90_product(q(3, 64), 128, 64, 33));
        assert!(!libmlx_sm90_product(QuantMode::Mxfp4, 128, 32, 33));
        assert!(!libmlx_sm90_product(q(4, 64), 6, 64, 33));
        assert!(!libmlx_sm90_product(q(4, 64), 128, 64, 1));
    }
}
