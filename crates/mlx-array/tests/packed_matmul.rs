//! The CPU kernels over packed weights (`Array::cpu_matmul_bf16`, `Array::cpu_matmul_f32`, `Quantized::cpu_matmul`,
//! `Quantized::cpu_gather_matmul`) against f64 products over weights decoded here independently
//! (bit layout, E2M1 codes, E8M0 scales), against MLX's `dequantize` + f32 matmul, and against
//! MLX's own quantized products, for every kernel, group size and instruction set this CPU runs,
//! with ragged shapes (K not a multiple of the vector width or block, N and M odd).
//!
//! Tolerance: |ours - ref| <= 1e-5 * sum_k |w_k x_k| per output (relative to the magnitude of the
//! terms: f32 accumulation in another order is the only difference).
mod common;
use common::{decode_quantized as decode, kernel_sets};
use mlx_array::ops::{cpu_packed_supports, gather_qmm, set_cpu_kernels_isa};
use mlx_array::{with_device, Array, DType, Device, QuantMode, Quantized};
use proptest::prelude::*;

const REL: f64 = 1e-5;

/// Deterministic values in [-1, 1) (an LCG), with a few larger ones.
fn vals(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if i % 37 == 0 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}


fn f64s(a: &Array) -> Vec<f64> {
    a.astype(DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}


/// Per output: the f64 product and the sum of |terms|.
fn reference(w: &[f64], x: &[f64], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for t in 0..k {
                let p = w[j * k + t] * x[i * k + t];
                y[i * n + j] += p;
                mag[i * n + j] += p.abs();
            }
        }
    }
    (y, mag)
}

fn assert_close(what: &str, got: &[f64], want: &[f64], mag: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = REL * m + 1e-30;
        assert!(
            (g - w).abs() <= tol,
            "{what}: output {i}: {g} vs {w} (|diff| {} > {tol})",
            (g - w).abs()
        );
    }
}


const MODES: [QuantMode; 7] = [
    QuantMode::Affine {
        bits: 4,
        group_size: 32,
    },
    QuantMode::Affine {
        bits: 4,
        group_size: 64,
    },
    QuantMode::Affine {
        bits: 4,
        group_size: 128,
    },
    QuantMode::Affine {
        bits: 8,
        group_size: 32,
    },
    QuantMode::Affine {
        bits: 8,
        group_size: 64,
    },
    QuantMode::Affine {
        bits: 8,
        group_size: 128,
    },
    QuantMode::Mxfp4,
];

/// `q` with float scales and biases as f32 (E8M0 scales as they are): MLX dequantizes in the
/// scales' dtype, so with these it computes in f32, as the kernels do.
fn f32_scales(q: &Quantized) -> Quantized {
    Quantized {
        scales: if q.scales.dtype() == DType::U8 { q.scales.clone() } else { q.scales.astype(DType::F32).unwrap() },
        biases: q.biases.as_ref().map(|b| b.astype(DType::F32).unwrap()),
        ..q.clone()
    }
}

/// One quantized case: ours against the f64 product over our decoding, against MLX's
/// dequantize + f32 matmul, and against MLX's quantized_matmul; also MLX's dequantize against
/// our decoding (the layout).
fn check_quantized(mode: QuantMode, sdt: DType, m: usize, n: usize, k: usize, seed: u64) {
    check_quantized_x(mode, sdt, m, n, k, seed, vals(m * k, seed ^ 0x55));
}

fn check_quantized_x(mode: QuantMode, sdt: DType, m: usize, n: usize, k: usize, seed: u64, xv: Vec<f32>) {
    let w = Array::from_slice(&vals(n * k, seed), &[n, k])
        .unwrap()
        .astype(sdt)
        .unwrap();
    let q = w.quantize(mode).unwrap();
    let x = Array::from_slice(&xv, &[m, k]).unwrap();
    let ours = q.cpu_matmul(&x).unwrap();
    assert_eq!(ours.shape(), vec![m, n]);
    assert_eq!(
        ours.dtype(),
        DType::F32,
        "{mode:?} with {sdt} scales: output dtype"
    );
    let dec = decode(&q, n, k);
    let q32 = f32_scales(&q);
    let deq = f64s(&q32.dequantize(Some(DType::F32)).unwrap());
    // f32 rounding of scale * q + bias: relative to the largest weight
    let big = dec.iter().fold(0f64, |a, v| a.max(v.abs()));
    for (i, (a, b)) in dec.iter().zip(&deq).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * big,
            "{mode:?}: dequantize element {i}: {b} vs our decoding {a}"
        );
    }
    let xd: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    let (want, mag) = reference(&dec, &xd, m, n, k);
    let what = format!("{mode:?} {sdt} scales, M={m} N={n} K={k}");
    let got = f64s(&ours);
    assert_close(&format!("{what} vs f64"), &got, &want, &mag);
    let mlx = f64s(
        &x.matmul(
            &q32.dequantize(Some(DType::F32))
                .unwrap()
                .swap_axes(0, 1)
                .unwrap(),
        )
        .unwrap(),
    );
    assert_close(
        &format!("{what} vs dequantize + f32 matmul"),
        &got,
        &mlx,
        &mag,
    );
    let qmm = f64s(&q.matmul(&x, true).unwrap());
    assert_close(&format!("{what} vs quantized_matmul"), &got, &qmm, &mag);
}

fn check_bf16(m: usize, n: usize, k: usize, seed: u64) {
    let w = Array::from_slice(&vals(n * k, seed), &[n, k])
        .unwrap()
        .astype(DType::BF16)
        .unwrap();
    let xv = vals(m * k, seed ^ 0x33);
    let x = Array::from_slice(&xv, &[m, k]).unwrap();
    let got = f64s(&x.cpu_matmul_bf16(&w).unwrap());
    let wd = f64s(&w);
    let xd: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    let (want, mag) = reference(&wd, &xd, m, n, k);
    let what = format!("bf16 M={m} N={n} K={k}");
    assert_close(&format!("{what} vs f64"), &got, &want, &mag);
    let f32p = f64s(
        &x.matmul(&w.astype(DType::F32).unwrap().swap_axes(0, 1).unwrap())
            .unwrap(),
    );
    assert_close(
        &format!("{what} vs f32 matmul of the bf16 weight"),
        &got,
        &f32p,
        &mag,
    );
}

fn check_f32(m: usize, n: usize, k: usize, seed: u64) {
    let wv = vals(n * k, seed);
    let w = Array::from_slice(&wv, &[n, k]).unwrap();
    let xv = vals(m * k, seed ^ 0x55);
    let x = Array::from_slice(&xv, &[m, k]).unwrap();
    let got = f64s(&x.cpu_matmul_f32(&w).unwrap());
    let wd: Vec<f64> = wv.iter().map(|&v| v as f64).collect();
    let xd: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    let (want, mag) = reference(&wd, &xd, m, n, k);
    let what = format!("f32 M={m} N={n} K={k}");
    assert_close(&format!("{what} vs f64"), &got, &want, &mag);
    let blas = f64s(&x.matmul(&w.swap_axes(0, 1).unwrap()).unwrap());
    assert_close(&format!("{what} vs MLX's f32 matmul"), &got, &blas, &mag);
    // a bf16 input gives a bf16 result
    let xb = x.astype(DType::BF16).unwrap();
    assert_eq!(xb.cpu_matmul_f32(&w).unwrap().dtype(), DType::BF16);
}

/// Every kernel, group size, scale dtype and instruction set over fixed ragged shapes.
#[test]
fn every_kernel_and_instruction_set_matches_f64_and_mlx() {
    with_device(Device::Cpu, || {
        for isa in kernel_sets() {
            set_cpu_kernels_isa(isa).unwrap();
            for (m, n, k) in [
                (1, 1, 1),
                (1, 3, 7),
                (2, 5, 31),
                (3, 9, 33),
                (1, 17, 64),
                (5, 4, 100),
                (4, 7, 577),
                (8, 3, 1030),
                (13, 6, 200),
                (64, 3, 577),
            ] {
                check_bf16(m, n, k, (m * 1000 + n * 10 + k) as u64);
                check_f32(m, n, k, (m * 1000 + n * 10 + k) as u64 + 7);
            }
            for mode in MODES {
                let gs = mode.group_size() as usize;
                let sdts: &[DType] = if matches!(mode, QuantMode::Mxfp4) {
                    &[DType::F32]
                } else {
                    &[DType::F32, DType::BF16, DType::F16]
                };
                for &sdt in sdts {
                    // K: one group, ragged against the 64/128-element blocks, and 576 (SmolLM2's width)
                    for (m, n, k) in [
                        (1, 1, gs),
                        (1, 5, 3 * gs),
                        (3, 7, 5 * gs),
                        (2, 3, 576),
                        (5, 2, 2 * gs),
                        (13, 3, 2 * gs),
                        (64, 2, 576),
                    ] {
                        if k % gs == 0 {
                            check_quantized(mode, sdt, m, n, k, (n * 31 + k) as u64);
                        }
                    }
                }
            }
        }
        set_cpu_kernels_isa("avx512vnni").unwrap();
    })
}

/// Inputs spanning many orders of magnitude next to each other (the VNNI kernels write x as
/// integers scaled per 4 or 8 consecutive elements), all-zero and tiny stretches, and a row
/// holding an infinity (its outputs are not finite, the other rows' still match f64).
#[test]
fn wide_ranges_zeros_and_infinities_in_x() {
    with_device(Device::Cpu, || {
        let (m, n, k) = (3, 7, 256);
        let base = vals(m * k, 11);
        let wide: Vec<f32> = base
            .iter()
            .enumerate()
            .map(|(i, &v)| match (i / 8) % 4 {
                0 => v * if i % 8 == 3 { 1e4 } else { 1e-3 },
                1 => 0.0,
                2 => v * 1e-30,
                _ => v * 10f32.powi((i % 13) as i32 - 6),
            })
            .collect();
        for isa in kernel_sets() {
            set_cpu_kernels_isa(isa).unwrap();
            for mode in [
                QuantMode::Affine { bits: 4, group_size: 32 },
                QuantMode::Affine { bits: 4, group_size: 128 },
                QuantMode::Affine { bits: 8, group_size: 64 },
                QuantMode::Mxfp4,
            ] {
                check_quantized_x(mode, DType::F32, m, n, k, 5, wide.clone());
                let mut inf = base.clone();
                inf[k + 17] = f32::INFINITY;
                let w = Array::from_slice(&vals(n * k, 5), &[n, k]).unwrap();
                let q = w.quantize(mode).unwrap();
                let y = q.cpu_matmul(&Array::from_slice(&inf, &[m, k]).unwrap()).unwrap();
                let y = y.to_vec::<f32>().unwrap();
                let xd: Vec<f64> = base.iter().map(|&v| v as f64).collect();
                let (want, mag) = reference(&decode(&q, n, k), &xd, m, n, k);
                for i in 0..m * n {
                    if i / n == 1 {
                        assert!(!y[i].is_finite(), "{isa} {mode:?}: output {i} of the row with an infinity: {}", y[i]);
                    } else {
                        let tol = REL * mag[i];
                        assert!((y[i] as f64 - want[i]).abs() <= tol, "{isa} {mode:?}: output {i} of a finite row: {} vs {}", y[i], want[i]);
                    }
                }
            }
        }
        set_cpu_kernels_isa("avx512vnni").unwrap();
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random shapes: M 1..=64 (the most rows the model layers give the kernels), N 1..40, K any
    /// (bf16) or any multiple of the group size.
    #[test]
    fn random_shapes(m in 1usize..65, n in 1usize..40, groups in 1usize..12, extra in 0usize..40, mode_i in 0usize..8, seed in 0u64..1000) {
        with_device(Device::Cpu, || {
            if mode_i == 7 {
                check_bf16(m, n, groups * 32 + extra, seed);
                check_f32(m, n, groups * 32 + extra, seed);
            } else {
                let mode = MODES[mode_i];
                check_quantized(mode, DType::BF16.min_if(mode), m, n, groups * mode.group_size() as usize, seed);
            }
        });
    }
}

trait ScaleDtype {
    fn min_if(self, mode: QuantMode) -> DType;
}
impl ScaleDtype for DType {
    /// mxfp4 is quantized from f32 here (its scales are u8 either way).
    fn min_if(self, mode: QuantMode) -> DType {
        if matches!(mode, QuantMode::Mxfp4) {
            DType::F32
        } else {
            self
        }
    }
}

/// Batched leading dims, bf16 inputs (bf16 output), and the output dtype rule of
/// quantized_matmul (the input's, promoted with float scales).
#[test]
fn leading_dims_and_dtypes() {
    with_device(Device::Cpu, || {
        let (n, k) = (6, 128);
        let w = Array::from_slice(&vals(n * k, 7), &[n, k]).unwrap();
        let q = w
            .astype(DType::BF16)
            .unwrap()
            .quantize(QuantMode::Affine {
                bits: 4,
                group_size: 64,
            })
            .unwrap();
        let x = Array::from_slice(&vals(2 * 3 * k, 8), &[2, 3, k]).unwrap();
        let y = q.cpu_matmul(&x).unwrap();
        assert_eq!(y.shape(), vec![2, 3, n]);
        assert_eq!(y.dtype(), DType::F32);
        let want = q.matmul(&x, true).unwrap();
        assert_eq!(want.dtype(), DType::F32);
        let (a, b) = (y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        for (p, r) in a.iter().zip(&b) {
            assert!((p - r).abs() <= 1e-4 * r.abs().max(1.0), "{p} vs {r}");
        }
        let xb = x.astype(DType::BF16).unwrap();
        assert_eq!(q.cpu_matmul(&xb).unwrap().dtype(), DType::BF16);
        // inputs are read in place: a strided view and a bf16 input give what their
        // contiguous f32 copies give
        let xt = Array::from_slice(&vals(3 * 2 * k, 9), &[3, 2, k]).unwrap().transpose(&[1, 0, 2]).unwrap();
        let xt_copy = Array::from_slice(&xt.to_vec::<f32>().unwrap(), &[2, 3, k]).unwrap();
        assert_eq!(q.cpu_matmul(&xt).unwrap().to_vec::<f32>().unwrap(), q.cpu_matmul(&xt_copy).unwrap().to_vec::<f32>().unwrap());
        let from_bf16 = q.cpu_matmul(&xb).unwrap().astype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        let from_f32 = q.cpu_matmul(&xb.astype(DType::F32).unwrap()).unwrap().astype(DType::BF16).unwrap().astype(DType::F32).unwrap();
        assert_eq!(from_bf16, from_f32.to_vec::<f32>().unwrap());
        let wb = w.astype(DType::BF16).unwrap();
        assert_eq!(xb.cpu_matmul_bf16(&wb).unwrap().dtype(), DType::BF16);
        assert_eq!(x.cpu_matmul_bf16(&wb).unwrap().shape(), vec![2, 3, n]);
    })
}

/// `Quantized::cpu_dequantize` gives MLX's `dequantize` to f32 (scales and biases taken to f32
/// first) bit for bit, for every mode and scales dtype, with leading axes (expert weights) and
/// large values; and refuses what it cannot read.
#[test]
fn dequantize_matches_mlx_bit_for_bit() {
    with_device(Device::Cpu, || {
        for mode in MODES {
            let sdts: &[DType] = if mode == QuantMode::Mxfp4 { &[DType::F32] } else { &[DType::F32, DType::BF16, DType::F16] };
            for &sdt in sdts {
                for (shape, seed) in [(vec![5usize, 256usize], 3u64), (vec![2, 3, 384], 4), (vec![1, 128], 5)] {
                    let n: usize = shape.iter().product();
                    let w = Array::from_slice(&vals(n, seed), &shape).unwrap().astype(sdt).unwrap();
                    let q = w.quantize(mode).unwrap();
                    let want = f32_scales(&q).dequantize(Some(DType::F32)).unwrap();
                    let got = q.cpu_dequantize().unwrap();
                    assert_eq!(got.shape(), shape, "{mode:?} {sdt}");
                    assert_eq!(got.dtype(), DType::F32);
                    let (g, r) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
                    for (i, (a, b)) in g.iter().zip(&r).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{mode:?} {sdt} scales {shape:?}: element {i}: {a} vs MLX {b}");
                    }
                }
            }
        }
        let w = Array::from_slice(&vals(4 * 64, 1), &[4, 64]).unwrap();
        let q = w.quantize(QuantMode::Affine { bits: 4, group_size: 32 }).unwrap();
        assert!(Quantized { biases: None, ..q.clone() }.cpu_dequantize().is_err(), "affine without biases");
        let short = Quantized { scales: q.scales.slice_axis(1, 0, 1).unwrap(), ..q.clone() };
        assert!(short.cpu_dequantize().is_err(), "scales of the wrong shape");
        let q3 = w.quantize(QuantMode::Affine { bits: 3, group_size: 32 }).unwrap();
        assert!(q3.cpu_dequantize().is_err(), "3-bit is not a CPU kernel");
        let ints = Quantized { weight: q.weight.astype(DType::I32).unwrap(), ..q.clone() };
        assert!(ints.cpu_dequantize().is_err(), "a weight that is not u32");
    })
}

/// Expert-indexed products against MLX's gather_qmm (the MoE decode path).
#[test]
fn gather_matches_gather_qmm() {
    with_device(Device::Cpu, || {
        for mode in [
            QuantMode::Affine {
                bits: 4,
                group_size: 64,
            },
            QuantMode::Affine {
                bits: 8,
                group_size: 32,
            },
            QuantMode::Mxfp4,
        ] {
            let (e, n, k, t, top) = (5, 12, 192, 3, 2);
            let w = Array::from_slice(&vals(e * n * k, 11), &[e, n, k]).unwrap();
            let q = w.quantize(mode).unwrap();
            let x = Array::from_slice(&vals(t * k, 12), &[t, 1, 1, k]).unwrap();
            let idx = Array::from_slice(&[4u32, 0, 2, 2, 1, 3], &[t, top]).unwrap();
            let ours = q.cpu_gather_matmul(&x, &idx).unwrap();
            assert_eq!(ours.shape(), vec![t, top, 1, n]);
            let want = gather_qmm(&x, &q, None, Some(&idx), true, false).unwrap();
            assert_eq!(want.shape(), ours.shape());
            // f64 reference per (token, slot) from our decoding
            let dec = decode(
                &Quantized {
                    weight: q.weight.reshape(&[(e * n) as i32, -1]).unwrap(),
                    scales: q.scales.reshape(&[(e * n) as i32, -1]).unwrap(),
                    biases: q
                        .biases
                        .as_ref()
                        .map(|b| b.reshape(&[(e * n) as i32, -1]).unwrap()),
                    mode,
                },
                e * n,
                k,
            );
            let xv: Vec<f64> = f64s(&x);
            let ids = [4usize, 0, 2, 2, 1, 3];
            let got = f64s(&ours);
            let g2 = f64s(&want);
            for r in 0..t * top {
                let ex = ids[r];
                let (yr, mag) = reference(
                    &dec[ex * n * k..(ex + 1) * n * k],
                    &xv[(r / top) * k..(r / top + 1) * k],
                    1,
                    n,
                    k,
                );
                assert_close(
                    &format!("{mode:?} gather row {r}"),
                    &got[r * n..(r + 1) * n],
                    &yr,
                    &mag,
                );
                assert_close(
                    &format!("{mode:?} gather_qmm row {r}"),
                    &got[r * n..(r + 1) * n],
                    &g2[r * n..(r + 1) * n],
                    &mag,
                );
            }
            // per-row inputs (the down projection: one input row per slot)
            let xs = Array::from_slice(&vals(t * top * k, 13), &[t, top, 1, k]).unwrap();
            let a = f64s(&q.cpu_gather_matmul(&xs, &idx).unwrap());
            let b = f64s(&gather_qmm(&xs, &q, None, Some(&idx), true, false).unwrap());
            let mag: Vec<f64> = b.iter().map(|v| v.abs().max(1.0) * 100.0).collect();
            assert_close(&format!("{mode:?} gather per-row inputs"), &a, &b, &mag);
        }
    })
}

/// Gradients reach the input (LoRA over a packed base), and only the input.
#[test]
fn gradient_with_respect_to_the_input() {
    with_device(Device::Cpu, || {
        let (n, k) = (5, 64);
        let w = Array::from_slice(&vals(n * k, 21), &[n, k]).unwrap();
        let q = w
            .quantize(QuantMode::Affine {
                bits: 8,
                group_size: 32,
            })
            .unwrap();
        let x = Array::from_slice(&vals(2 * k, 22), &[2, k]).unwrap();
        let (_, g) =
            mlx_array::grad::value_and_grad(|p| q.cpu_matmul(&p[0])?.sum(&[], false), std::slice::from_ref(&x))
                .unwrap();
        let (_, g2) =
            mlx_array::grad::value_and_grad(|p| q.matmul(&p[0], true)?.sum(&[], false), &[x])
                .unwrap();
        let (a, b) = (
            g[0].to_vec::<f32>().unwrap(),
            g2[0].to_vec::<f32>().unwrap(),
        );
        for (p, r) in a.iter().zip(&b) {
            assert!((p - r).abs() <= 1e-5 * r.abs().max(1.0), "{p} vs {r}");
        }
    })
}

/// The f32 kernel's gradients, to the input and to the weight, equal MLX's matmul's.
#[test]
fn f32_gradients_match_the_matmul() {
    with_device(Device::Cpu, || {
        let (m, n, k) = (3, 5, 70);
        let w = Array::from_slice(&vals(n * k, 31), &[n, k]).unwrap();
        let x = Array::from_slice(&vals(m * k, 32), &[m, k]).unwrap();
        let c = Array::from_slice(&vals(m * n, 33), &[m, n]).unwrap();
        let ours = |p: &[Array]| p[0].cpu_matmul_f32(&p[1])?.mul(&c)?.sum(&[], false);
        let mlx = |p: &[Array]| p[0].matmul(&p[1].swap_axes(0, 1)?)?.mul(&c)?.sum(&[], false);
        let (_, g) = mlx_array::grad::value_and_grad(ours, &[x.clone(), w.clone()]).unwrap();
        let (_, g2) = mlx_array::grad::value_and_grad(mlx, &[x, w]).unwrap();
        for (a, b) in g.iter().zip(&g2) {
            assert_eq!(a.shape(), b.shape());
            for (p, r) in a.to_vec::<f32>().unwrap().iter().zip(&b.to_vec::<f32>().unwrap()) {
                assert!((p - r).abs() <= 1e-5 * r.abs().max(1.0), "{p} vs {r}");
            }
        }
    })
}

/// Bad inputs are errors, never aborts.
#[test]
fn bad_inputs_are_errors() {
    with_device(Device::Cpu, || {
        let w = Array::from_slice(&vals(4 * 64, 1), &[4, 64]).unwrap();
        let q = w
            .quantize(QuantMode::Affine {
                bits: 4,
                group_size: 32,
            })
            .unwrap();
        let x = Array::from_slice(&vals(63, 2), &[1, 63]).unwrap();
        assert!(q.cpu_matmul(&x).is_err(), "K mismatch");
        let x = Array::from_slice(&vals(64, 2), &[1, 64]).unwrap();
        assert!(
            x.cpu_matmul_bf16(&w).is_err(),
            "f32 weight for the bf16 kernel"
        );
        let wb = w.astype(DType::BF16).unwrap();
        let x3 = Array::from_slice(&vals(65, 2), &[1, 65]).unwrap();
        assert!(x3.cpu_matmul_bf16(&wb).is_err(), "K mismatch (bf16)");
        assert!(x.cpu_matmul_f32(&wb).is_err(), "bf16 weight for the f32 kernel");
        assert!(x3.cpu_matmul_f32(&w).is_err(), "K mismatch (f32)");
        let q3 = w
            .quantize(QuantMode::Affine {
                bits: 3,
                group_size: 32,
            })
            .unwrap();
        assert!(!cpu_packed_supports(q3.mode));
        assert!(q3.cpu_matmul(&x).is_err(), "3-bit is not a CPU kernel");
        let bad = Quantized {
            biases: None,
            ..q.clone()
        };
        assert!(bad.cpu_matmul(&x).is_err(), "affine without biases");
        let idx = Array::from_slice(&[0u32], &[1]).unwrap();
        assert!(
            q.cpu_gather_matmul(&x, &idx).is_err(),
            "2-d weight for a gathered product"
        );
        let xi = Array::from_slice(&[1i32; 64], &[1, 64]).unwrap();
        assert!(q.cpu_matmul(&xi).is_err(), "integer input");
    })
}

/// Packed weights written by Python MLX's `mx.quantize` (tests/fixtures/packed, made by
/// `make_packed_reference.py`) against the products Python MLX computed on the same bytes.
#[test]
fn python_mlx_quantize_output() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/packed/packed_reference.safetensors");
    let t = mlx_array::io::load_safetensors(&path, None).unwrap();
    with_device(Device::Cpu, || {
        let x = &t["x"];
        let xv = f64s(x);
        let (m, k) = (x.shape()[0], x.shape()[1]);
        let modes = [
            ("affine4_g32", QuantMode::Affine { bits: 4, group_size: 32 }),
            ("affine4_g64", QuantMode::Affine { bits: 4, group_size: 64 }),
            ("affine4_g128", QuantMode::Affine { bits: 4, group_size: 128 }),
            ("affine8_g32", QuantMode::Affine { bits: 8, group_size: 32 }),
            ("affine8_g64", QuantMode::Affine { bits: 8, group_size: 64 }),
            ("affine8_g128", QuantMode::Affine { bits: 8, group_size: 128 }),
            ("mxfp4_g32", QuantMode::Mxfp4),
        ];
        for isa in kernel_sets() {
            set_cpu_kernels_isa(isa).unwrap();
            for (name, mode) in modes {
                let q = Quantized { weight: t[&format!("{name}.weight")].clone(), scales: t[&format!("{name}.scales")].clone(), biases: t.get(&format!("{name}.biases")).cloned(), mode };
                let n = q.weight.shape()[0];
                let got = f64s(&q.cpu_matmul(x).unwrap());
                let (_, mag) = reference(&decode(&q, n, k), &xv, m, n, k);
                assert_close(&format!("{isa} {name} vs Python mx.quantized_matmul"), &got, &f64s(&t[&format!("{name}.y_qmm")]), &mag);
                assert_close(&format!("{isa} {name} vs Python dequantize + matmul"), &got, &f64s(&t[&format!("{name}.y_deq")]), &mag);
            }
            let w = &t["bf16.weight"];
            let n = w.shape()[0];
            let got = f64s(&x.cpu_matmul_bf16(w).unwrap());
            let (_, mag) = reference(&f64s(w), &xv, m, n, k);
            assert_close(&format!("{isa} bf16 vs Python f32 matmul"), &got, &f64s(&t["bf16.y"]), &mag);
        }
        set_cpu_kernels_isa("avx512vnni").unwrap();
    })
}

/// Products large enough to be split over threads (and expert products over many rows) give the
/// same values as MLX's.
#[test]
fn products_split_over_threads() {
    with_device(Device::Cpu, || {
        let (n, k) = (1536, 256);
        let w = Array::from_slice(&vals(n * k, 41), &[n, k]).unwrap();
        let x = Array::from_slice(&vals(3 * k, 42), &[3, k]).unwrap();
        let close = |a: &Array, b: &Array, what: &str| {
            let (a, b) = (f64s(a), f64s(b));
            let mag = f64s(&x.abs().unwrap().matmul(&w.abs().unwrap().swap_axes(0, 1).unwrap()).unwrap());
            let mag: Vec<f64> = mag.iter().map(|v| v * 2.0).collect();
            assert_close(what, &a, &b, &mag);
        };
        for mode in [QuantMode::Affine { bits: 4, group_size: 64 }, QuantMode::Affine { bits: 8, group_size: 128 }, QuantMode::Mxfp4] {
            let q = w.quantize(mode).unwrap();
            close(&q.cpu_matmul(&x).unwrap(), &q.matmul(&x, true).unwrap(), &format!("{mode:?}"));
        }
        let wb = w.astype(DType::BF16).unwrap();
        close(&x.cpu_matmul_bf16(&wb).unwrap(), &x.matmul(&wb.astype(DType::F32).unwrap().swap_axes(0, 1).unwrap()).unwrap(), "bf16");
        // 40 expert rows of 4 experts [E, 96, 256]
        let we = Array::from_slice(&vals(4 * 96 * k, 43), &[4, 96, k]).unwrap();
        let q = we.quantize(QuantMode::Affine { bits: 4, group_size: 32 }).unwrap();
        let xs = Array::from_slice(&vals(20 * k, 44), &[20, 1, 1, k]).unwrap();
        let ids: Vec<u32> = (0..40).map(|i| (i * 7 % 4) as u32).collect();
        let idx = Array::from_slice(&ids, &[20, 2]).unwrap();
        let (a, b) = (f64s(&q.cpu_gather_matmul(&xs, &idx).unwrap()), f64s(&gather_qmm(&xs, &q, None, Some(&idx), true, false).unwrap()));
        for (i, (p, r)) in a.iter().zip(&b).enumerate() {
            assert!((p - r).abs() <= 1e-4 * r.abs().max(1.0), "expert row output {i}: {p} vs {r}");
        }
    })
}

/// The gated product `cpu_swiglu` over `[Wg; Wu]` against the plain product's halves through
/// MLX's silu and multiply, in value and in gradient, for f32 and bf16 inputs. Tolerances are
/// relative to the largest output (gradient): the products differ in f32 accumulation order
/// only, which moves every element by a share of the magnitudes summed into it.
#[test]
fn swiglu_matches_the_plain_product() {
    with_device(Device::Cpu, || {
        let (n, k) = (2 * 96, 128);
        let w = Array::from_slice(&vals(n * k, 51), &[n, k]).unwrap();
        let q = w.quantize(QuantMode::Affine { bits: 4, group_size: 32 }).unwrap();
        let x = Array::from_slice(&vals(3 * k, 52), &[1, 3, k]).unwrap();
        let plain = |x: &Array| -> mlx_array::Result<Array> {
            let y = q.cpu_matmul(x)?;
            let h = y.split_at(&[n / 2], -1)?;
            h[0].silu()?.mul(&h[1])
        };
        for dt in [DType::F32, DType::BF16] {
            let xd = x.astype(dt).unwrap();
            let (got, want) = (q.cpu_swiglu(&xd).unwrap(), plain(&xd).unwrap());
            assert_eq!((got.shape(), got.dtype()), (vec![1, 3, n / 2], want.dtype()));
            let tol = if dt == DType::F32 { 1e-5 } else { 1.6e-2 };
            let (got, want) = (f64s(&got), f64s(&want));
            let top = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= tol * (b.abs() + top), "{dt:?} output {i}: {a} vs {b}");
            }
        }
        let (_, g) = mlx_array::grad::value_and_grad(|p| q.cpu_swiglu(&p[0])?.sum(&[], false), std::slice::from_ref(&x)).unwrap();
        let (_, g2) = mlx_array::grad::value_and_grad(|p| plain(&p[0])?.sum(&[], false), std::slice::from_ref(&x)).unwrap();
        let (g, g2) = (f64s(&g[0]), f64s(&g2[0]));
        let top = g2.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (a, b) in g.iter().zip(&g2) {
            assert!((a - b).abs() <= 1e-5 * top, "gradient {a} vs {b} (largest {top})");
        }
        let rows = |a: &Array| a.slice_axis(0, 0, n - 1).unwrap();
        let odd = Quantized { weight: rows(&q.weight), scales: rows(&q.scales), biases: q.biases.as_ref().map(rows), mode: q.mode };
        assert!(odd.cpu_matmul(&x).is_ok() && odd.cpu_swiglu(&x).is_err(), "odd row count");
    })
}
