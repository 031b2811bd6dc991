//! matmul (batched, broadcast), addmm with a non-zero C, linear, gather_mm, against f64 loops.
mod common;
use common::*;
use mlx_array::{ops, Array, DType};
use proptest::prelude::*;

fn dims() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    (1usize..4, 1usize..9, 1usize..17, 1usize..9)
}

/// bf16 products: inputs rounded to bf16, f32 accumulation, one rounding of the result.
const BF16_MM: Tol = Tol { atol: 2e-2, rtol: 1.6e-2 };
const F32_MM: Tol = Tol { atol: 1e-5, rtol: 1e-5 };

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn matmul_batched((bt, m, k, n) in dims(), seed in vals(2 * 3 * 8 * 16 * 8, -1.0, 1.0), bfl in any::<bool>()) {
        let (mut a, mut b) = (seed[..bt * m * k].to_vec(), seed[bt * m * k..bt * m * k + bt * k * n].to_vec());
        let (dtype, tol) = if bfl { a = bfv(&a); b = bfv(&b); (DType::BF16, BF16_MM) } else { (DType::F32, F32_MM) };
        let y = arr_as(&a, &[bt, m, k], dtype).matmul(&arr_as(&b, &[bt, k, n], dtype)).unwrap();
        prop_assert_eq!(y.shape(), vec![bt, m, n]);
        prop_assert_eq!(y.dtype(), dtype);
        close("matmul", &out(&y), &matmul_ref(&a, &b, bt, m, k, n), tol)?;
        // A 2-d right operand broadcasts over the batch.
        let b2 = &b[..k * n];
        let y = arr_as(&a, &[bt, m, k], dtype).matmul(&arr_as(b2, &[k, n], dtype)).unwrap();
        let b_rep: Vec<f32> = (0..bt).flat_map(|_| b2.iter().copied()).collect();
        close("matmul broadcast", &out(&y), &matmul_ref(&a, &b_rep, bt, m, k, n), tol)?;
        // Transposed views multiply as their logical values.
        let at = arr_as(&a, &[bt, m, k], dtype).swap_axes(1, 2).unwrap().swap_axes(1, 2).unwrap();
        let y = at.matmul(&arr_as(&b, &[bt, k, n], dtype)).unwrap();
        close("matmul of a view", &out(&y), &matmul_ref(&a, &b, bt, m, k, n), tol)?;
    }

    #[test]
    fn addmm_alpha_beta((_, m, k, n) in dims(), seed in vals(8 * 16 * 2 + 64, -1.0, 1.0), alpha in -2.0f32..2.0, beta in -2.0f32..2.0, bias_row in any::<bool>()) {
        let a = &seed[..m * k];
        let b = &seed[m * k..m * k + k * n];
        // C is either a full [m, n] matrix or a broadcast [n] row: both must be added.
        let cshape = if bias_row { vec![n] } else { vec![m, n] };
        let c: Vec<f32> = seed[256..256 + cshape.iter().product::<usize>()].iter().map(|v| v + 0.5).collect();
        let y = arr(a, &[m, k]).addmm(&arr(b, &[k, n]), &arr(&c, &cshape), alpha, beta).unwrap();
        let p = matmul_ref(a, b, 1, m, k, n);
        let want: Vec<f64> = (0..m * n).map(|i| alpha as f64 * p[i] + beta as f64 * c[if bias_row { i % n } else { i }] as f64).collect();
        close("addmm", &out(&y), &want, Tol { atol: 2e-5, rtol: 2e-5 })?;
    }

    #[test]
    fn linear_layer((_, m, k, n) in dims(), seed in vals(8 * 16 * 2 + 8, -1.0, 1.0)) {
        let x = &seed[..m * k];
        let w = &seed[m * k..m * k + n * k]; // [out = n, in = k]
        let bias = &seed[256..256 + n];
        let y = arr(x, &[m, k]).linear(&arr(w, &[n, k]), Some(&arr(bias, &[n]))).unwrap();
        let want: Vec<f64> = (0..m * n).map(|i| (0..k).map(|p| x[(i / n) * k + p] as f64 * w[(i % n) * k + p] as f64).sum::<f64>() + bias[i % n] as f64).collect();
        close("linear", &out(&y), &want, F32_MM)?;
    }

    /// MoE dispatch: `out[i] = a[lhs[i]] @ b[rhs[i]]`, checked against a loop of plain products.
    #[test]
    fn gather_mm_matches_loop(
        (ea, eb, m, k, n) in (1usize..4, 1usize..5, 1usize..4, 1usize..9, 1usize..9),
        seed in vals(3 * 3 * 8 + 4 * 8 * 8, -1.0, 1.0),
        picks in prop::collection::vec((0usize..100, 0usize..100), 1..6),
        bfl in any::<bool>(),
    ) {
        // bf16 operands too (MLX's CPU kernel takes only f32: they are multiplied in f32)
        let (dtype, tol) = if bfl { (DType::BF16, BF16_MM) } else { (DType::F32, F32_MM) };
        let seed: Vec<f32> = if bfl { bfv(&seed) } else { seed };
        let a = &seed[..ea * m * k];
        let b = &seed[ea * m * k..ea * m * k + eb * k * n];
        let arr = |v: &[f32], shape: &[usize]| arr_as(v, shape, dtype);
        let lhs: Vec<u32> = picks.iter().map(|p| (p.0 % ea) as u32).collect();
        let rhs: Vec<u32> = picks.iter().map(|p| (p.1 % eb) as u32).collect();
        let np = picks.len();
        let y = ops::gather_mm(&arr(a, &[ea, m, k]), &arr(b, &[eb, k, n]), Some(&Array::from_slice(&lhs, &[np]).unwrap()), Some(&Array::from_slice(&rhs, &[np]).unwrap()), false).unwrap();
        prop_assert_eq!(y.shape(), vec![np, m, n]);
        prop_assert_eq!(y.dtype(), dtype);
        let mut want = Vec::new();
        for i in 0..np {
            let (l, r) = (lhs[i] as usize, rhs[i] as usize);
            want.extend(matmul_ref(&a[l * m * k..(l + 1) * m * k], &b[r * k * n..(r + 1) * k * n], 1, m, k, n));
        }
        close("gather_mm", &out(&y), &want, tol)?;
        // Sorted rhs indices (the fast MoE path) give the same products.
        let mut order: Vec<usize> = (0..np).collect();
        order.sort_by_key(|&i| rhs[i]);
        let (ls, rs): (Vec<u32>, Vec<u32>) = order.iter().map(|&i| (lhs[i], rhs[i])).unzip();
        let ys = ops::gather_mm(&arr(a, &[ea, m, k]), &arr(b, &[eb, k, n]), Some(&Array::from_slice(&ls, &[np]).unwrap()), Some(&Array::from_slice(&rs, &[np]).unwrap()), true).unwrap();
        let want_sorted: Vec<f64> = order.iter().flat_map(|&i| want[i * m * n..(i + 1) * m * n].to_vec()).collect();
        close("gather_mm sorted", &out(&ys), &want_sorted, tol)?;
    }
}

#[test]
fn matmul_shape_errors() {
    let a = Array::zeros(&[2, 3], DType::F32).unwrap();
    assert!(a.matmul(&Array::zeros(&[2, 3], DType::F32).unwrap()).is_err());
    assert!(ops::gather_mm(&Array::zeros(&[3], DType::F32).unwrap(), &a, None, None, false).is_err());
}

/// Single-row and single-column products (every decode-step projection), which the default Linux
/// build sends to `cblas_sgemv` (mlx-sys `src/blas_route.c`): every operand layout MLX can hand
/// to BLAS (transposed views, row slices of wider matrices, batches, beta != 0 through addmm),
/// against f64 loops; and the router really took them.
#[test]
fn single_row_and_column_products() {
    let before = mlx_sys::blas_routed_products();
    if mlx_sys::BLAS == "openblas-routed" {
        assert!(before.is_some(), "built with the BLAS router, but its library is not the one MLX loaded");
    }
    let vals = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.7548 + s).sin() * 0.9).collect() };
    let tol = Tol { atol: 1e-5, rtol: 1e-4 };
    for &(k, n) in &[(1usize, 1usize), (1, 37), (300, 1), (257, 129), (1024, 96)] {
        let x = vals(k, 0.3);
        let w = vals(n * k, 1.1); // [n, k]
        let want: Vec<f64> = (0..n).map(|j| (0..k).map(|p| x[p] as f64 * w[j * k + p] as f64).sum()).collect();
        // x[1, k] @ W^T (the Linear layout: a transposed view of [n, k]).
        let wt = arr(&w, &[n, k]).transpose(&[1, 0]).unwrap();
        close("row @ W^T", &out(&arr(&x, &[1, k]).matmul(&wt).unwrap()), &want, tol).unwrap();
        // x[1, k] @ B with B stored [k, n].
        let b: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
        close("row @ B", &out(&arr(&x, &[1, k]).matmul(&arr(&b, &[k, n])).unwrap()), &want, tol).unwrap();
        // The row as a transposed [k, 1] column, and as a row slice of a wider matrix.
        let xt = arr(&x, &[k, 1]).transpose(&[1, 0]).unwrap();
        close("row view @ W^T", &out(&xt.matmul(&wt).unwrap()), &want, tol).unwrap();
        let mut wide = vals(3 * (k + 5), 2.0);
        wide[(k + 5)..(k + 5) + k].copy_from_slice(&x);
        let row = arr(&wide, &[3, k + 5]).slice(&[1, 0], &[2, k], &[1, 1]).unwrap();
        close("sliced row @ W^T", &out(&row.matmul(&wt).unwrap()), &want, tol).unwrap();
        // The row as column 2 of a [k, k + 5] matrix, transposed (a strided [1, k] view).
        let mut tall = vals(k * (k + 5), 3.0);
        for p in 0..k {
            tall[p * (k + 5) + 2] = x[p];
        }
        let col = arr(&tall, &[k, k + 5]).slice(&[0, 2], &[k, 3], &[1, 1]).unwrap().transpose(&[1, 0]).unwrap();
        close("strided row @ W^T", &out(&col.matmul(&wt).unwrap()), &want, tol).unwrap();
        // W @ a strided column (column 2 of the same matrix).
        let colv = arr(&tall, &[k, k + 5]).slice(&[0, 2], &[k, 3], &[1, 1]).unwrap();
        close("W @ strided column", &out(&arr(&w, &[n, k]).matmul(&colv).unwrap()), &want, tol).unwrap();
        // W[n, k] @ x[k, 1] (one column), and W^T's view times the column.
        close("W @ column", &out(&arr(&w, &[n, k]).matmul(&arr(&x, &[k, 1])).unwrap()), &want, tol).unwrap();
        let wtt = arr(&b, &[k, n]).transpose(&[1, 0]).unwrap();
        close("W view @ column", &out(&wtt.matmul(&arr(&x, &[k, 1])).unwrap()), &want, tol).unwrap();
        // A batch of rows, each against its own matrix.
        let x2: Vec<f32> = x.iter().chain(x.iter()).map(|v| -v).collect();
        let w2: Vec<f32> = w.iter().chain(w.iter()).copied().collect();
        let y = arr(&x2, &[2, 1, k]).matmul(&arr(&w2, &[2, n, k]).swap_axes(1, 2).unwrap()).unwrap();
        let want2: Vec<f64> = want.iter().chain(want.iter()).map(|v| -v).collect();
        close("batched rows", &out(&y), &want2, tol).unwrap();
        // addmm: alpha * x @ W^T + beta * c with a non-zero C.
        let c = vals(n, 0.5);
        let y = arr(&x, &[1, k]).addmm(&wt, &arr(&c, &[1, n]), 1.5, -0.75).unwrap();
        let want3: Vec<f64> = (0..n).map(|j| 1.5 * want[j] - 0.75 * c[j] as f64).collect();
        close("addmm row", &out(&y), &want3, tol).unwrap();
    }
    if let (Some(b), Some(a)) = (before, mlx_sys::blas_routed_products()) {
        assert!(a > b, "no product went through the router ({b} -> {a})");
    }
}

/// The router's fallback for a missing OpenBLAS sgemm (one sgemv per row of C), called directly:
/// every transpose combination, padded leading dimensions, beta 0 (C not read) and not, K = 0.
#[cfg(target_os = "linux")]
#[test]
fn blas_router_fallback_by_rows() {
    type Sgemm = extern "C" fn(i32, i32, i32, i32, i32, i32, f32, *const f32, i32, *const f32, i32, f32, *mut f32, i32);
    unsafe extern "C" {
        fn dlsym(handle: *mut std::ffi::c_void, symbol: *const std::ffi::c_char) -> *mut std::ffi::c_void;
    }
    // Make MLX load its BLAS (the router, in the default build) before looking the symbol up.
    let _ = out(&arr(&[1.0, 2.0], &[1, 2]).matmul(&arr(&[3.0, 4.0], &[2, 1])).unwrap());
    let f = unsafe { dlsym(std::ptr::null_mut(), c"mlx_models_blas_sgemm_rows".as_ptr()) };
    if f.is_null() {
        assert_ne!(mlx_sys::BLAS, "openblas-routed", "built with the BLAS router, but its fallback is not exported");
        return; // another BLAS build: no router
    }
    let sgemm: Sgemm = unsafe { std::mem::transmute::<*mut std::ffi::c_void, Sgemm>(f) };
    let (row_major, no_trans, trans) = (101, 111, 112);
    let (m, n) = (3usize, 5usize);
    for k in [4usize, 0] {
        for (ta, tb) in [(no_trans, no_trans), (no_trans, trans), (trans, no_trans), (trans, trans)] {
            for beta in [0.0f32, 1.5] {
                // op(A) is m x k, op(B) is k x n; stored with 2 extra columns (padded leading dims).
                let (ar, ac) = if ta == no_trans { (m, k) } else { (k, m) };
                let (br, bc) = if tb == no_trans { (k, n) } else { (n, k) };
                let (lda, ldb, ldc) = (ac + 2, bc + 2, n + 2);
                let a: Vec<f32> = (0..ar.max(1) * lda).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..br.max(1) * ldb).map(|i| (i as f32 * 0.53).cos()).collect();
                let c0: Vec<f32> = (0..m * ldc).map(|i| if beta == 0.0 { f32::NAN } else { i as f32 * 0.1 }).collect();
                let opa = |i: usize, p: usize| if ta == no_trans { a[i * lda + p] } else { a[p * lda + i] } as f64;
                let opb = |p: usize, j: usize| if tb == no_trans { b[p * ldb + j] } else { b[j * ldb + p] } as f64;
                let mut c = c0.clone();
                sgemm(row_major, ta, tb, m as i32, n as i32, k as i32, 0.5, a.as_ptr(), lda as i32, b.as_ptr(), ldb as i32, beta, c.as_mut_ptr(), ldc as i32);
                for i in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..k).map(|p| opa(i, p) * opb(p, j)).sum();
                        let prev = if beta == 0.0 { 0.0 } else { beta as f64 * c0[i * ldc + j] as f64 };
                        let want = 0.5 * dot + prev;
                        let got = c[i * ldc + j] as f64;
                        assert!((got - want).abs() < 1e-5, "k {k} ta {ta} tb {tb} beta {beta} C[{i},{j}] = {got}, want {want}");
                    }
                    // the padding columns of C are not touched
                    for j in n..ldc {
                        assert!(c[i * ldc + j].to_bits() == c0[i * ldc + j].to_bits(), "padding C[{i},{j}] written");
                    }
                }
            }
        }
    }
}
