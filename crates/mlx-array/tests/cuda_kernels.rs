//! The few-row CUDA kernels (`Array::cuda_rows_matmul`, `Array::cuda_few_query_attention`) and
//! the GPU policies that use them (`Array::matmul_weight_t`, `Array::sdpa`) against f64 references.
//! On a CUDA GPU (the default device) the kernels are checked for every mask kind, grouped
//! heads, K/V read through a cache's strides, ragged row and column counts, bf16/f16/f32; on the
//! CPU they must refuse with a typed error and the policies must be MLX's own ops exactly. The
//! policies are switched on (`CudaFewRowKernels::On`) by the tests that go through them.
mod common;
use common::*;
use mlx_array::ops::{set_cuda_few_row_kernels, CudaFewRowKernels};
use mlx_array::{default_device, AttentionMask, DType, Device};


/// The values as `dtype` would hold them.
fn rounded(v: &[f32], dtype: DType) -> Vec<f32> {
    out(&arr_as(v, &[v.len()], dtype))
}

fn gpu() -> bool {
    default_device().unwrap() == Device::Gpu
}

/// Largest |got - want| over the largest |want|.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1e-30);
    got.iter().zip(want).map(|(&g, w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

/// out[m, n] = sum_k x[m, k] w[n, k]
fn rows_ref(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut o = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            o[i * n + j] = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
        }
    }
    o
}

/// Attention of q [hq, l, d] over the first `kn` keys of k/v [hkv, cap, d]; queries are the
/// last `l` positions; `window` 0 = unbounded.
#[allow(clippy::too_many_arguments)]
fn attn_ref(q: &[f32], k: &[f32], v: &[f32], (hq, hkv, l, kn, cap, d): (usize, usize, usize, usize, usize, usize), scale: f64, causal: bool, window: usize) -> Vec<f64> {
    let mut o = vec![0.0; hq * l * d];
    for h in 0..hq {
        let g = h / (hq / hkv);
        for i in 0..l {
            let pos = kn - l + i;
            let vis = |j: usize| (!causal || j <= pos) && (window == 0 || j + window > pos);
            let s: Vec<f64> = (0..kn)
                .map(|j| if vis(j) { scale * (0..d).map(|c| q[(h * l + i) * d + c] as f64 * k[(g * cap + j) * d + c] as f64).sum::<f64>() } else { f64::NEG_INFINITY })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..d {
                o[(h * l + i) * d + c] = (0..kn).map(|j| e[j] / z * v[(g * cap + j) * d + c] as f64).sum();
            }
        }
    }
    o
}

#[test]
fn rows_matmul_against_f64() {
    set_cuda_few_row_kernels(CudaFewRowKernels::On);
    // (K = 12 and 20: the scalar path; the rest 16-byte loads)
    for &(m, n, k) in &[(2usize, 37usize, 8usize), (3, 64, 136), (5, 130, 1024), (8, 300, 264), (9, 17, 64), (16, 129, 512), (1, 40, 24), (4, 33, 12), (7, 9, 20)] {
        for dt in [DType::BF16, DType::F16].into_iter().take(if m % 4 == 0 { 2 } else { 1 }) {
            let (xv, wv) = (rounded(&fixed_vals(m * k, 1 + m as u64), dt), rounded(&fixed_vals(n * k, 7 + n as u64), dt));
            let (x, w) = (arr_as(&xv, &[m, k], dt), arr_as(&wv, &[n, k], dt));
            let want = rows_ref(&xv, &wv, m, n, k);
            let got = x.cuda_rows_matmul(&w);
            // through the policy: [1, m, k] @ the transposed view
            let pol = x.reshape(&[1, m as i32, k as i32]).unwrap().matmul_weight_t(&w.swap_axes(0, 1).unwrap()).unwrap();
            assert_eq!(pol.shape(), vec![1, m, n]);
            if gpu() {
                let e = rel_err(&out(&got.unwrap()), &want);
                assert!(e < 8e-3, "rows_matmul m={m} n={n} k={k} {dt:?}: rel err {e:e}");
            } else {
                assert!(got.is_err(), "rows_matmul off a GPU must refuse");
                let mm = x.matmul(&w.swap_axes(0, 1).unwrap()).unwrap();
                assert_eq!(out(&pol), out(&mm.reshape(&[1, m as i32, n as i32]).unwrap()), "policy off a GPU is MLX's matmul");
            }
            let e = rel_err(&out(&pol), &want);
            assert!(e < 8e-3, "matmul_weight_t m={m} n={n} k={k} {dt:?}: rel err {e:e}");
        }
    }
}

/// A weight read through a transposed view's strides (the scalar path) and a row slice of a
/// larger weight (an offset base pointer).
#[test]
fn rows_matmul_strided_weights() {
    let (m, n, k) = (3usize, 24usize, 40usize);
    let xv = rounded(&fixed_vals(m * k, 11), DType::BF16);
    let wv = rounded(&fixed_vals(k * (n + 5), 12), DType::BF16);
    let x = arr_as(&xv, &[m, k], DType::BF16);
    // w = wt.T with wt [K, N + 5] row-major: w's strides are (1, N + 5); first N rows of w
    let wt = arr_as(&wv, &[k, n + 5], DType::BF16);
    let w = wt.swap_axes(0, 1).unwrap().slice_axis(0, 0, n).unwrap();
    let wrow: Vec<f32> = (0..n).flat_map(|j| (0..k).map(move |c| (j, c))).map(|(j, c)| wv[c * (n + 5) + j]).collect();
    let want = rows_ref(&xv, &wrow, m, n, k);
    // rows 5.. of a [N + 5, K] weight: a base pointer 5 * K elements in
    let big = rounded(&fixed_vals((n + 5) * k, 13), DType::BF16);
    let wb = arr_as(&big, &[n + 5, k], DType::BF16).slice_axis(0, 5, n + 5).unwrap();
    let want_b = rows_ref(&xv, &big[5 * k..], m, n, k);
    if gpu() {
        let e = rel_err(&out(&x.cuda_rows_matmul(&w).unwrap()), &want);
        assert!(e < 8e-3, "transposed view: rel err {e:e}");
        let e = rel_err(&out(&x.cuda_rows_matmul(&wb).unwrap()), &want_b);
        assert!(e < 8e-3, "row slice: rel err {e:e}");
    } else {
        assert!(x.cuda_rows_matmul(&w).is_err() && x.cuda_rows_matmul(&wb).is_err());
    }
}

#[test]
fn rows_matmul_argument_errors() {
    let x = arr_as(&fixed_vals(17 * 8, 3), &[17, 8], DType::BF16);
    assert!(x.cuda_rows_matmul(&arr_as(&fixed_vals(32, 4), &[4, 8], DType::BF16)).is_err(), "17 rows");
    let x = arr_as(&fixed_vals(16, 3), &[2, 8], DType::F32);
    assert!(x.cuda_rows_matmul(&arr_as(&fixed_vals(32, 4), &[4, 8], DType::F32)).is_err(), "f32");
    let x = arr_as(&fixed_vals(16, 3), &[2, 8], DType::BF16);
    assert!(x.cuda_rows_matmul(&arr_as(&fixed_vals(32, 4), &[4, 8], DType::F16)).is_err(), "mixed dtypes");
    assert!(x.cuda_rows_matmul(&arr_as(&fixed_vals(36, 4), &[4, 9], DType::BF16)).is_err(), "K mismatch");
}

#[test]
fn few_query_attention_against_f64() {
    set_cuda_few_row_kernels(CudaFewRowKernels::On);
    // (hq, hkv, queries, keys, d)
    for &(hq, hkv, l, kn, d) in &[(4usize, 2usize, 2usize, 5usize, 32usize), (8, 2, 8, 37, 64), (4, 4, 16, 300, 128), (6, 3, 3, 130, 96), (2, 1, 7, 7, 256)] {
        let cap = kn + 11;
        // f32 and f16 on two shapes (each dtype, head size and mask is a kernel compiled at first use)
        for dt in [DType::BF16, DType::F32, DType::F16].into_iter().take(if d == 32 || d == 128 { 3 } else { 1 }) {
            let seed = (hq * 31 + l * 7 + kn) as u64;
            let qv = rounded(&fixed_vals(hq * l * d, seed), dt);
            let kv = rounded(&fixed_vals(hkv * cap * d, seed + 1), dt);
            let vv = rounded(&fixed_vals(hkv * cap * d, seed + 2), dt);
            let q = arr_as(&qv, &[1, hq, l, d], dt);
            // keys and values: the first kn positions of a larger buffer (a cache's view)
            let kb = arr_as(&kv, &[1, hkv, cap, d], dt);
            let vb = arr_as(&vv, &[1, hkv, cap, d], dt);
            let (k, v) = (kb.slice_axis(2, 0, kn).unwrap(), vb.slice_axis(2, 0, kn).unwrap());
            let scale = 0.125;
            let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            for (mask, causal, window) in [(AttentionMask::None, false, 0), (AttentionMask::Causal, true, 0), (AttentionMask::SlidingWindow(3), true, 3), (AttentionMask::SlidingWindow(kn + 5), true, 0)] {
                let want = attn_ref(&qv, &kv, &vv, (hq, hkv, l, kn, cap, d), scale as f64, causal, window);
                let got = q.cuda_few_query_attention(&k, &v, scale, mask);
                let pol = q.sdpa(&k, &v, scale, mask).unwrap();
                if gpu() {
                    let e = rel_err(&out(&got.unwrap()), &want);
                    assert!(e < tol, "kernel hq={hq} hkv={hkv} l={l} kn={kn} d={d} {dt:?} {mask:?}: rel err {e:e}");
                } else {
                    assert!(got.is_err(), "few-query attention off a GPU must refuse");
                }
                let e = rel_err(&out(&pol), &want);
                assert!(e < tol, "sdpa hq={hq} hkv={hkv} l={l} kn={kn} d={d} {dt:?} {mask:?}: rel err {e:e}");
            }
        }
    }
}

#[test]
fn few_query_attention_argument_errors() {
    let q = arr_as(&fixed_vals(4 * 2 * 32, 1), &[1, 4, 2, 32], DType::BF16);
    let k = arr_as(&fixed_vals(2 * 5 * 32, 2), &[1, 2, 5, 32], DType::BF16);
    let mask = arr(&[0.0; 10], &[2, 5]);
    assert!(q.cuda_few_query_attention(&k, &k, 1.0, AttentionMask::Array(&mask)).is_err(), "array masks");
    assert!(q.cuda_few_query_attention(&k, &k, 1.0, AttentionMask::SlidingWindow(0)).is_err(), "window 0");
    let q3 = arr_as(&fixed_vals(3 * 2 * 32, 1), &[1, 3, 2, 32], DType::BF16);
    assert!(q3.cuda_few_query_attention(&k, &k, 1.0, AttentionMask::None).is_err(), "3 query heads over 2");
    let q48 = arr_as(&fixed_vals(4 * 2 * 48, 1), &[1, 4, 2, 48], DType::BF16);
    let k48 = arr_as(&fixed_vals(2 * 5 * 48, 2), &[1, 2, 5, 48], DType::BF16);
    assert!(q48.cuda_few_query_attention(&k48, &k48, 1.0, AttentionMask::None).is_err(), "head dim 48");
    let q6 = arr_as(&fixed_vals(4 * 6 * 32, 1), &[1, 4, 6, 32], DType::BF16);
    assert!(q6.cuda_few_query_attention(&k, &k, 1.0, AttentionMask::Causal).is_err(), "6 causal queries after 5 keys");
    assert!(q.cuda_few_query_attention(&k, &k.astype(DType::F16).unwrap(), 1.0, AttentionMask::None).is_err(), "mixed dtypes");
}

/// The setting's names (what `generate --cuda-few-row-kernels` and `verify_probe --modes` take).
#[test]
fn few_row_kernel_settings_parse_by_name() {
    for (name, want) in [
        ("off", CudaFewRowKernels::Off),
        ("products", CudaFewRowKernels::Products),
        ("attention", CudaFewRowKernels::Attention),
        ("on", CudaFewRowKernels::On),
    ] {
        assert_eq!(name.parse::<CudaFewRowKernels>().unwrap(), want);
    }
    assert!("On".parse::<CudaFewRowKernels>().is_err());
    assert!("".parse::<CudaFewRowKernels>().is_err());
}
