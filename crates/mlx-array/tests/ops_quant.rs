//! quantize / dequantize / quantized_matmul / gather_qmm for affine 4 and 8 bit, mxfp4 and mxfp8.
//!
//! The packed codes are decoded here independently (bit layout, E2M1 / E4M3 codes, E8M0 scales)
//! and that decoding is the reference for `dequantize`; the products are then compared with
//! f64 matmuls over the decoded weights.
mod common;
use common::*;
use mlx_array::{ops, Array, DType, QuantMode, Quantized};
use proptest::prelude::*;

const MODES: [QuantMode; 6] = [
    QuantMode::Affine { bits: 4, group_size: 32 },
    QuantMode::Affine { bits: 4, group_size: 64 },
    QuantMode::Affine { bits: 8, group_size: 64 },
    QuantMode::Mxfp4,
    QuantMode::Mxfp8,
    QuantMode::Nvfp4,
];

/// Worst reconstruction error allowed per group, relative to the group's range / max magnitude.
fn err_bound(mode: QuantMode, group: &[f32]) -> f64 {
    let mx = group.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
    let mn = group.iter().fold(f32::MAX, |a, &b| a.min(b)) as f64;
    let amax = mx.abs().max(mn.abs());
    match mode {
        // One quantization step (MLX may shift the grid so that zero is exact).
        QuantMode::Affine { bits, .. } => (mx - mn) / ((1u32 << bits) - 1) as f64 * 1.01 + 1e-6,
        // E2M1 next to its largest codes is 2 steps of scale apart, scale <= amax / 4.
        QuantMode::Mxfp4 => amax * 0.5 + 1e-6,
        // E2M1 under an E4M3 scale (3 mantissa bits: within 1/8 of amax / 6).
        QuantMode::Nvfp4 => amax * 0.5 + 1e-6,
        // E4M3: 3 mantissa bits and a power-of-two scale.
        QuantMode::Mxfp8 => amax * 0.13 + 1e-6,
    }
}

fn matmul_t(x: &[f32], w: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    (0..m * n).map(|i| (0..k).map(|p| x[(i / n) * k + p] as f64 * w[(i % n) * k + p]).sum()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn quantize_dequantize_matmul(mode_i in 0usize..6, (n, kg, m) in (1usize..5, 1usize..3, 1usize..4), seed in vals(4 * 128 + 3 * 128, -1.0, 1.0), bfl in any::<bool>()) {
        let mode = MODES[mode_i];
        let k = 64 * kg; // a multiple of every group size used
        let w = &seed[..n * k];
        let x = &seed[4 * 128..4 * 128 + m * k];
        let (w, x, dtype) = if bfl { (bfv(w), bfv(x), DType::BF16) } else { (w.to_vec(), x.to_vec(), DType::F32) };
        let q = arr_as(&w, &[n, k], dtype).quantize(mode).unwrap();
        prop_assert_eq!(q.weight.dtype(), DType::U32);
        prop_assert_eq!(q.in_features(), k);
        let deq_ref = decode_quantized(&q, n, k);
        // dequantize == our decoding of the packed codes.
        let d = q.dequantize(Some(DType::F32)).unwrap();
        prop_assert_eq!(d.shape(), vec![n, k]);
        // (With bf16 scales and biases MLX's `scale * q + bias` rounds differently from f64.)
        let dtol = if bfl { Tol { atol: 4e-3, rtol: 8e-3 } } else { Tol { atol: 1e-6, rtol: 1e-6 } };
        close("dequantize", &out(&d), &deq_ref, dtol)?;
        // ... and close to the original weights.
        let gs = mode.group_size() as usize;
        for (gi, g) in w.chunks(gs).enumerate() {
            let bound = err_bound(mode, g);
            for (j, &v) in g.iter().enumerate() {
                let e = (deq_ref[gi * gs + j] - v as f64).abs();
                prop_assert!(e <= bound, "{:?}: element {} error {} > {}", mode, gi * gs + j, e, bound);
            }
        }
        // quantized_matmul == x @ dequantized(W).T
        let y = q.matmul(&arr_as(&x, &[m, k], dtype), true).unwrap();
        prop_assert_eq!(y.shape(), vec![m, n]);
        let want = matmul_t(&x, &deq_ref, m, k, n);
        if bfl {
            // MLX's CPU bf16 quantized kernels accumulate in bf16 (seen: 3% off where a bf16
            // matmul over the dequantized weights is 0.3% off), so the bound scales with
            // sum |x_k w_k|, the size of the partial sums, rather than with the result.
            let y = out(&y);
            for i in 0..m * n {
                let mag: f64 = (0..k).map(|p| (x[(i / n) * k + p] as f64 * deq_ref[(i % n) * k + p]).abs()).sum();
                let err = (y[i] as f64 - want[i]).abs();
                prop_assert!(err <= 0.02 * mag + 0.02, "bf16 quantized_matmul element {}: {} vs {} (scale {})", i, y[i], want[i], mag);
            }
        } else {
            close("quantized_matmul", &out(&y), &want, Tol { atol: 1e-4, rtol: 1e-4 })?;
        }
    }

    /// `transpose = false`: weights stored `[in, out]`, quantized along `out`.
    #[test]
    fn quantized_matmul_untransposed(mode_i in 0usize..6, (m, kin) in (1usize..4, 1usize..6), seed in vals(5 * 64 + 3 * 5, -1.0, 1.0)) {
        let mode = MODES[mode_i];
        let nout = 64;
        let w = &seed[..kin * nout];
        let x = &seed[5 * 64..5 * 64 + m * kin];
        let q = arr(w, &[kin, nout]).quantize(mode).unwrap();
        let deq = decode_quantized(&q, kin, nout);
        let y = q.matmul(&arr(x, &[m, kin]), false).unwrap();
        prop_assert_eq!(y.shape(), vec![m, nout]);
        let want: Vec<f64> = (0..m * nout).map(|i| (0..kin).map(|p| x[(i / nout) * kin + p] as f64 * deq[p * nout + i % nout]).sum()).collect();
        close("quantized_matmul (no transpose)", &out(&y), &want, Tol { atol: 1e-4, rtol: 1e-4 })?;
    }

    /// MoE: `out[i] = x[lhs[i]] @ dequantized(W[rhs[i]]).T`, against a per-row loop.
    #[test]
    fn gather_qmm_matches_loop(mode_i in 0usize..6, (ex, e, n, m) in (1usize..3, 1usize..4, 1usize..4, 1usize..3), picks in prop::collection::vec((0usize..10, 0usize..10), 1..5), seed in vals(3 * 3 * 64 + 2 * 2 * 64, -1.0, 1.0)) {
        let mode = MODES[mode_i];
        let k = 64;
        let w = &seed[..e * n * k];
        let x = &seed[3 * 3 * 64..3 * 3 * 64 + ex * m * k];
        let q = arr(w, &[e, n, k]).quantize(mode).unwrap();
        let deq = decode_quantized(&q, e * n, k); // experts are consecutive row blocks
        let lhs: Vec<u32> = picks.iter().map(|p| (p.0 % ex) as u32).collect();
        let rhs: Vec<u32> = picks.iter().map(|p| (p.1 % e) as u32).collect();
        let np = picks.len();
        let y = ops::gather_qmm(&arr(x, &[ex, m, k]), &q, Some(&Array::from_slice(&lhs, &[np]).unwrap()), Some(&Array::from_slice(&rhs, &[np]).unwrap()), true, false).unwrap();
        prop_assert_eq!(y.shape(), vec![np, m, n]);
        let mut want = Vec::new();
        for i in 0..np {
            let (l, r) = (lhs[i] as usize, rhs[i] as usize);
            want.extend(matmul_t(&x[l * m * k..(l + 1) * m * k], &deq[r * n * k..(r + 1) * n * k], m, k, n));
        }
        close("gather_qmm", &out(&y), &want, Tol { atol: 1e-4, rtol: 1e-4 })?;
    }
}

/// `matmul_dtype` and `out_features` are what `matmul` gives, for f32 and bf16 inputs against
/// f32 and bf16 scales, affine and mxfp4.
#[test]
fn matmul_dtype_is_the_products() {
    for mode in [QuantMode::Affine { bits: 4, group_size: 64 }, QuantMode::Mxfp4] {
        for wdt in [DType::F32, DType::BF16] {
            let q = Array::zeros(&[3, 64], wdt).unwrap().quantize(mode).unwrap();
            assert_eq!(q.out_features(), 3);
            for xdt in [DType::F32, DType::BF16] {
                let y = q.matmul(&Array::zeros(&[2, 64], xdt).unwrap(), true).unwrap();
                assert_eq!(y.dtype(), q.matmul_dtype(xdt), "{mode:?}, weights {wdt:?}, input {xdt:?}");
                assert_eq!(y.shape(), vec![2, 3]);
            }
        }
    }
}

#[test]
fn quant_argument_errors() {
    let w = Array::zeros(&[4, 48], DType::F32).unwrap();
    assert!(w.quantize(QuantMode::Affine { bits: 4, group_size: 32 }).is_err(), "48 is not a multiple of 32");
    assert!(w.quantize(QuantMode::Affine { bits: 4, group_size: 48 }).is_err());
    assert!(Array::zeros(&[64], DType::F32).unwrap().quantize(QuantMode::Mxfp4).is_err());
    let q = Array::zeros(&[4, 64], DType::F32).unwrap().quantize(QuantMode::Affine { bits: 8, group_size: 64 }).unwrap();
    assert!(q.matmul(&Array::zeros(&[1, 32], DType::F32).unwrap(), true).is_err());
    let no_bias = Quantized { biases: None, ..q.clone() };
    assert!(no_bias.dequantize(None).is_err());
    // An MLX-side rejection (x's features do not match) carries MLX's message, not a status code.
    let bad = ops::gather_qmm(&Array::zeros(&[1, 1, 32], DType::F32).unwrap(), &q, None, None, true, false);
    match bad {
        Err(mlx_array::Error::Mlx { op, msg }) => assert!(op == "gather_qmm" && !msg.contains("status"), "{op}: {msg}"),
        other => panic!("{other:?}"),
    }
}
