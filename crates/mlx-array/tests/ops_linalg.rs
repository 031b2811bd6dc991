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
    ) {
        let a = &seed[..ea * m * k];
        let b = &seed[ea * m * k..ea * m * k + eb * k * n];
        let lhs: Vec<u32> = picks.iter().map(|p| (p.0 % ea) as u32).collect();
        let rhs: Vec<u32> = picks.iter().map(|p| (p.1 % eb) as u32).collect();
        let np = picks.len();
        let y = ops::gather_mm(&arr(a, &[ea, m, k]), &arr(b, &[eb, k, n]), Some(&Array::from_slice(&lhs, &[np]).unwrap()), Some(&Array::from_slice(&rhs, &[np]).unwrap()), false).unwrap();
        prop_assert_eq!(y.shape(), vec![np, m, n]);
        let mut want = Vec::new();
        for i in 0..np {
            let (l, r) = (lhs[i] as usize, rhs[i] as usize);
            want.extend(matmul_ref(&a[l * m * k..(l + 1) * m * k], &b[r * k * n..(r + 1) * k * n], 1, m, k, n));
        }
        close("gather_mm", &out(&y), &want, F32_MM)?;
        // Sorted rhs indices (the fast MoE path) give the same products.
        let mut order: Vec<usize> = (0..np).collect();
        order.sort_by_key(|&i| rhs[i]);
        let (ls, rs): (Vec<u32>, Vec<u32>) = order.iter().map(|&i| (lhs[i], rhs[i])).unzip();
        let ys = ops::gather_mm(&arr(a, &[ea, m, k]), &arr(b, &[eb, k, n]), Some(&Array::from_slice(&ls, &[np]).unwrap()), Some(&Array::from_slice(&rs, &[np]).unwrap()), true).unwrap();
        let want_sorted: Vec<f64> = order.iter().flat_map(|&i| want[i * m * n..(i + 1) * m * n].to_vec()).collect();
        close("gather_mm sorted", &out(&ys), &want_sorted, F32_MM)?;
    }
}

#[test]
fn matmul_shape_errors() {
    let a = Array::zeros(&[2, 3], DType::F32).unwrap();
    assert!(a.matmul(&Array::zeros(&[2, 3], DType::F32).unwrap()).is_err());
    assert!(ops::gather_mm(&Array::zeros(&[3], DType::F32).unwrap(), &a, None, None, false).is_err());
}
