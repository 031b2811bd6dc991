//! Products over bf16 and MLX-quantized weights on the CPU, by our own kernels (an MLX primitive
//! compiled by `mlx-sys`'s build script; AVX-512, AVX2 or portable code chosen at run time).
//!
//! MLX's CPU backend computes bf16 products 10-20x slower than f32 ones, and its quantized
//! products slower than an f32 product over the dequantized weight, so on the CPU the bytes a
//! token reads could not shrink below f32's. These kernels read the stored bytes directly: bf16
//! weights (f32 accumulation), MLX affine 4-bit and 8-bit (groups of 32, 64, 128, `mx.quantize`'s
//! layout) and mxfp4, for inputs of few rows (decode and short prefills; each weight row is read
//! once for all input rows). They run over output rows on as many threads as the BLAS path
//! (`OPENBLAS_NUM_THREADS`, else `OMP_NUM_THREADS`, else all hardware threads) and only on a CPU
//! stream: on the GPU MLX's own kernels stay. The input is converted to f32; the output has
//! the dtype `quantized_matmul` would give (the input's, promoted with float scales).
use super::quant::{ffi, stream};
use crate::error::{Error, Result};
use crate::{Array, DType, QuantMode, Quantized};
use std::ffi::CStr;

/// Inputs of at most this many rows (tokens) go to the f32 kernel in the model layers; more rows
/// keep MLX's own products (OpenBLAS, compute-bound there). Measured with `cargo bench -p
/// mlx-array --bench packed_matmul` (BENCHMARKS.md, "Packed CPU kernels").
pub const CPU_PACKED_MAX_ROWS: usize = 8;

/// Inputs of at most this many rows (tokens) go to the kernels for weights stored narrower than
/// f32 (bf16, affine 4 and 8-bit, mxfp4) in the model layers; more rows run an f32 product over
/// the weight converted to f32 in full on every call. The kernels read the weight again for
/// every 4 input rows, but the conversion costs more up to about 64-100 rows. One forward of
/// SmolLM2-135M on 2 cores (BENCHMARKS.md, "Packed CPU kernels"): 4-bit g64 weights (f32
/// compute) 34 / 47 / 88 / 176 ms for 9 / 16 / 32 / 64 rows by the kernels against 196 / 127 /
/// 161 / 242 converted, 400 against 384 at 128; bf16 weights (bf16 compute) 68 / 97 / 189 / 396
/// against 193 / 186 / 261 / 428, 502 against 470 at 80.
pub const CPU_PACKED_NARROW_MAX_ROWS: usize = 64;

const KIND_BF16: i32 = 0;
const KIND_AFFINE4: i32 = 1;
const KIND_AFFINE8: i32 = 2;
const KIND_MXFP4: i32 = 3;
const KIND_F32: i32 = 4;

/// `a`'s handle, or the empty array (null `ctx`) that stands for an absent input.
fn opt(a: Option<&Array>) -> mlx_sys::mlx_array {
    a.map(|a| a.inner.as_ptr()).unwrap_or(mlx_sys::mlx_array { ctx: std::ptr::null_mut() })
}

/// The kernel code for a quantization mode, if the CPU kernels take it: affine 4 and 8-bit
/// (groups of 32, 64, 128) and mxfp4.
pub fn cpu_packed_supports(mode: QuantMode) -> bool {
    kind_of(mode).is_some()
}

fn kind_of(mode: QuantMode) -> Option<i32> {
    match mode {
        QuantMode::Affine {
            bits: 4,
            group_size: 32 | 64 | 128,
        } => Some(KIND_AFFINE4),
        QuantMode::Affine {
            bits: 8,
            group_size: 32 | 64 | 128,
        } => Some(KIND_AFFINE8),
        QuantMode::Mxfp4 => Some(KIND_MXFP4),
        _ => None,
    }
}

/// The instruction set the kernels use in this process (`avx512vnni`, `avx512`, `avx2` or
/// `portable`): the widest the CPU supports unless [`set_cpu_kernels_isa`] chose another.
pub fn cpu_kernels_isa() -> &'static str {
    let p = unsafe { mlx_sys::mlx_models_cpu_kernels_isa() };
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("unknown")
}

/// Use the kernels of `isa` (`avx512vnni`, `avx512`, `avx2`, `portable`) from now on,
/// process-wide; returns the set in use, a lower one when this CPU lacks `isa`'s instructions (for
/// tests and benches).
pub fn set_cpu_kernels_isa(isa: &str) -> Result<&'static str> {
    if !["avx512vnni", "avx512", "avx2", "portable"].contains(&isa) {
        return Err(Error::arg(
            "set_cpu_kernels_isa",
            format!("unknown instruction set {isa:?} (avx512vnni, avx512, avx2, portable)"),
        ));
    }
    let c = std::ffi::CString::new(isa)
        .map_err(|_| Error::arg("set_cpu_kernels_isa", "NUL in name"))?;
    let p = unsafe { mlx_sys::mlx_models_cpu_kernels_select(c.as_ptr()) };
    Ok(unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("unknown"))
}

/// Threads one packed product uses.
pub fn cpu_kernels_threads() -> usize {
    unsafe { mlx_sys::mlx_models_cpu_kernels_threads() }.max(1) as usize
}

#[allow(clippy::too_many_arguments)] // the C entry point's arguments, one for one
fn call(
    op: &'static str,
    x: &Array,
    w: &Array,
    scales: Option<&Array>,
    biases: Option<&Array>,
    idx: Option<&Array>,
    kind: i32,
    gs: i32,
) -> Result<Array> {
    let s = stream();
    ffi(op, |res| unsafe {
        mlx_sys::mlx_models_cpu_packed_matmul(
            res,
            x.inner.as_ptr(),
            w.inner.as_ptr(),
            opt(scales),
            opt(biases),
            opt(idx),
            kind,
            gs,
            s.as_ptr(),
        )
    })
}

impl Array {
    /// `self @ w^T` for a bf16 weight `w` `[N, K]` (as stored, not transposed) on the CPU, with
    /// f32 accumulation. `self` is `[..., K]`, of any float dtype; the result has its dtype.
    /// The thread's stream must be a CPU stream.
    pub fn cpu_matmul_bf16(&self, w: &Array) -> Result<Array> {
        self.cpu_matmul_float("cpu_matmul_bf16", w, DType::BF16, "a bf16 weight", KIND_BF16)
    }

    /// `self @ w^T` for an f32 weight `w` `[N, K]` (as stored, not transposed) on the CPU: each
    /// weight row read once for all of `self`'s rows (BLAS's product of a few rows repacks the
    /// whole weight: 2 rows cost 1.7x one). `self` is `[..., K]`, of any float dtype; the result
    /// has its dtype. The thread's stream must be a CPU stream.
    pub fn cpu_matmul_f32(&self, w: &Array) -> Result<Array> {
        self.cpu_matmul_float("cpu_matmul_f32", w, DType::F32, "an f32 weight", KIND_F32)
    }

    /// The product over an unpacked float weight of dtype `want` (kernel `kind`).
    fn cpu_matmul_float(&self, op: &'static str, w: &Array, want: DType, expected: &str, kind: i32) -> Result<Array> {
        if w.dtype() != want {
            return Err(Error::DType { op, expected: expected.into(), got: w.dtype().to_string() });
        }
        call(op, self, w, None, None, None, kind, 0)
    }
}

impl Quantized {
    /// `x @ W^T` over the packed weight `[N, K*bits/32]` on the CPU (modes of
    /// [`cpu_packed_supports`]); the same product as [`Quantized::matmul`]`(x, true)`. The
    /// thread's stream must be a CPU stream.
    pub fn cpu_matmul(&self, x: &Array) -> Result<Array> {
        self.cpu_call("cpu_packed_matmul", x, None)
    }

    /// `silu(x @ Wg^T) * (x @ Wu^T)` (SwiGLU) where this weight is `[Wg; Wu]` (`2N` rows, gate
    /// rows first): `[..., N]`, one primitive instead of a product, two slices and the gate's
    /// ops. The thread's stream must be a CPU stream.
    pub fn cpu_swiglu(&self, x: &Array) -> Result<Array> {
        let kind = self.cpu_kind("cpu_packed_swiglu")?;
        let (s, gs) = (stream(), self.mode.group_size() as i32);
        ffi("cpu_packed_swiglu", |res| unsafe {
            mlx_sys::mlx_models_cpu_packed_swiglu(res, x.inner.as_ptr(), self.weight.inner.as_ptr(), self.scales.inner.as_ptr(), opt(self.biases.as_ref()), kind, gs, s.as_ptr())
        })
    }

    /// The weight as f32 `[.., N, K]`, on the CPU (modes of [`cpu_packed_supports`]): the same
    /// values as [`Quantized::dequantize`]`(Some(DType::F32))` with the scales and biases taken to
    /// f32 first, in one pass (MLX's CPU dequantize is a graph of shifts and broadcasts, ~8x
    /// slower). For products of more rows than [`CPU_PACKED_MAX_ROWS`]. The thread's stream must
    /// be a CPU stream.
    pub fn cpu_dequantize(&self) -> Result<Array> {
        let kind = self.cpu_kind("cpu_dequantize")?;
        let (s, gs) = (stream(), self.mode.group_size() as i32);
        ffi("cpu_dequantize", |res| unsafe {
            mlx_sys::mlx_models_cpu_dequantize(res, self.weight.inner.as_ptr(), self.scales.inner.as_ptr(), opt(self.biases.as_ref()), kind, gs, s.as_ptr())
        })
    }

    /// MoE expert products: `x` `[..., 1, K]`, `idx` integer expert ids broadcast with `x`'s
    /// leading dims, `W` `[E, N, ..]`: row r is `x[r] @ W[idx[r]]^T`, out `[..., 1, N]` (the same
    /// product as [`crate::ops::gather_qmm`] with `rhs_indices = idx`, `transpose = true`).
    pub fn cpu_gather_matmul(&self, x: &Array, idx: &Array) -> Result<Array> {
        self.cpu_call("cpu_packed_gather_matmul", x, Some(idx))
    }

    fn cpu_call(&self, op: &'static str, x: &Array, idx: Option<&Array>) -> Result<Array> {
        let kind = self.cpu_kind(op)?;
        call(op, x, &self.weight, Some(&self.scales), self.biases.as_ref(), idx, kind, self.mode.group_size() as i32)
    }

    /// The kernels' weight kind of this mode, or `op`'s error for a mode they do not take.
    fn cpu_kind(&self, op: &'static str) -> Result<i32> {
        kind_of(self.mode).ok_or_else(|| Error::arg(op, format!("the CPU kernels do not take {:?}", self.mode)))
    }
}
