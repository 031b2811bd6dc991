//! Shared helpers for the proptest op suites: inputs, naive f64 references, tolerances.
#![allow(dead_code)]
use mlx_array::{bf16, Array, DType, QuantMode, Quantized};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Cases per property: small shapes, so the whole suite stays well under a minute.
pub const CASES: u32 = 32;

/// `n` floats uniform in `[lo, hi)`.
pub fn vals(n: usize, lo: f32, hi: f32) -> BoxedStrategy<Vec<f32>> {
    prop::collection::vec(lo..hi, n).boxed()
}

/// Round to the nearest bf16 (what the bf16 tests feed both MLX and the reference).
/// A 3-d shape with sides in `1..max_side` and values in [-9, 9] to fill it.
pub fn cube(max_side: usize) -> impl Strategy<Value = (Vec<usize>, Vec<f32>)> {
    prop::collection::vec(1usize..max_side, 3).prop_flat_map(|s| {
        let n = s.iter().product();
        (Just(s), vals(n, -9.0, 9.0))
    })
}

pub fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

pub fn bfv(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf(x)).collect()
}

/// An f32 array, or the same values in `dtype`.
pub fn arr(v: &[f32], shape: &[usize]) -> Array {
    Array::from_slice(v, shape).unwrap()
}

pub fn arr_as(v: &[f32], shape: &[usize], dtype: DType) -> Array {
    arr(v, shape).astype(dtype).unwrap()
}

pub fn out(a: &Array) -> Vec<f32> {
    a.to_vec_f32().unwrap()
}

/// Tolerance `atol + rtol * |want|` per element.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub atol: f64,
    pub rtol: f64,
}

pub const F32: Tol = Tol {
    atol: 1e-5,
    rtol: 1e-5,
};
/// bf16 has an 8-bit significand: one rounding is a relative 2^-9; allow a few.
pub const BF16: Tol = Tol {
    atol: 1e-2,
    rtol: 1.6e-2,
};

pub fn close(what: &str, got: &[f32], want: &[f64], tol: Tol) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "{}: length", what);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        prop_assert!(
            err <= tol.atol + tol.rtol * w.abs(),
            "{}: element {} is {} but the reference is {} (err {:e}, tol {:?})",
            what,
            i,
            g,
            w,
            err,
            tol
        );
    }
    Ok(())
}

/// Row-major strides.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Multi-index of flat position `i`.
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}

/// `[b, m, k] @ [b, k, n]` in f64.
pub fn matmul_ref(a: &[f32], b: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut o = vec![0.0; batch * m * n];
    for z in 0..batch {
        for i in 0..m {
            for j in 0..n {
                o[(z * m + i) * n + j] = (0..k)
                    .map(|p| a[(z * m + i) * k + p] as f64 * b[(z * k + p) * n + j] as f64)
                    .sum();
            }
        }
    }
    o
}

/// Softmax over rows of length `n`.
pub fn softmax_ref(x: &[f64], n: usize) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|r| {
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = r.iter().map(|v| (v - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(move |v| v / s)
        })
        .collect()
}

pub fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// A permutation of `0..n` from random sort keys.
pub fn perm(keys: &[f32]) -> Vec<usize> {
    let mut p: Vec<usize> = (0..keys.len()).collect();
    p.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]).then(a.cmp(&b)));
    p
}

/// E2M1 (fp4) code to its value.
pub fn e2m1(c: u32) -> f64 {
    let mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(c & 7) as usize];
    if c & 8 != 0 {
        -mag
    } else {
        mag
    }
}

pub fn e4m3(c: u32) -> f64 {
    let (s, e, m) = ((c >> 7) & 1, (c >> 3) & 15, c & 7);
    let mag = if e == 0 {
        m as f64 / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// Decode `q` (rows of `cols` elements) with our own reading of the format.
pub fn decode_quantized(q: &Quantized, rows: usize, cols: usize) -> Vec<f64> {
    let bits = q.mode.bits() as usize;
    let gs = q.mode.group_size() as usize;
    let words = q.weight.to_vec::<u32>().unwrap();
    let per_word = 32 / bits;
    let code = |r: usize, j: usize| -> u32 {
        let w = words[r * cols / per_word + j / per_word];
        (w >> ((j % per_word) * bits)) & ((1u32 << bits) - 1)
    };
    let mut res = vec![0.0; rows * cols];
    match q.mode {
        QuantMode::Affine { .. } => {
            let s = f64s(&out(&q.scales));
            let b = f64s(&out(q.biases.as_ref().unwrap()));
            for r in 0..rows {
                for j in 0..cols {
                    let g = r * cols / gs + j / gs;
                    res[r * cols + j] = s[g] * code(r, j) as f64 + b[g];
                }
            }
        }
        QuantMode::Nvfp4 => {
            // E4M3 scale per 16 elements, E2M1 codes
            let s = q.scales.to_vec::<u8>().unwrap();
            for r in 0..rows {
                for j in 0..cols {
                    res[r * cols + j] = e4m3(s[r * cols / gs + j / gs] as u32) * e2m1(code(r, j));
                }
            }
        }
        QuantMode::Mxfp4 | QuantMode::Mxfp8 => {
            let s = q.scales.to_vec::<u8>().unwrap();
            for r in 0..rows {
                for j in 0..cols {
                    let scale = 2f64.powi(s[r * cols / gs + j / gs] as i32 - 127);
                    let c = code(r, j);
                    res[r * cols + j] = scale * if bits == 4 { e2m1(c) } else { e4m3(c) };
                }
            }
        }
    }
    res
}

/// The CPU kernel sets this machine runs (each a distinct kernel copy; the portable one always).
pub fn kernel_sets() -> Vec<&'static str> {
    let mut v = Vec::new();
    for isa in ["avx512vnni", "avx512", "avx2", "portable"] {
        if mlx_array::ops::set_cpu_kernels_isa(isa).unwrap() == isa {
            v.push(isa);
        }
    }
    assert!(v.contains(&"portable"), "the portable kernels run everywhere");
    v
}

/// `f(isa)` with each of [`kernel_sets`] selected in turn, then the set in use before again.
pub fn on_each_kernel_set(mut f: impl FnMut(&'static str)) {
    let before = mlx_array::ops::cpu_kernels_isa();
    for isa in kernel_sets() {
        mlx_array::ops::set_cpu_kernels_isa(isa).unwrap();
        f(isa);
    }
    mlx_array::ops::set_cpu_kernels_isa(before).unwrap();
}

/// Deterministic values in [-1, 1), without end, from a xorshift generator seeded with `seed`.
pub fn fixed_stream(seed: u64) -> impl Iterator<Item = f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    })
}

/// The first `n` values of [`fixed_stream`].
pub fn fixed_vals(n: usize, seed: u64) -> Vec<f32> {
    fixed_stream(seed).take(n).collect()
}
