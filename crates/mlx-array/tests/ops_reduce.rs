//! Reductions, softmax, logsumexp, cumsum and the selection ops (argmax, argsort, argpartition,
//! top-k) against naive references.
mod common;
use common::*;
use mlx_array::{Array, DType};
use proptest::prelude::*;

fn mat() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1usize..5, 1usize..12).prop_flat_map(|(r, c)| (Just(r), Just(c), vals(r * c, -4.0, 4.0)))
}

/// Row `i` of an `[r, c]` matrix, or column `i` when `axis == 0`.
fn lane(v: &[f32], r: usize, c: usize, axis: i32, i: usize) -> Vec<f32> {
    if axis == 1 { v[i * c..(i + 1) * c].to_vec() } else { (0..r).map(|j| v[j * c + i]).collect() }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn softmax_logsumexp((r, c, x) in mat(), bfl in any::<bool>(), precise in any::<bool>()) {
        let (x, dtype, tol) = if bfl { (bfv(&x), DType::BF16, BF16) } else { (x, DType::F32, Tol { atol: 1e-6, rtol: 1e-5 }) };
        let a = arr_as(&x, &[r, c], dtype);
        let s = a.softmax(-1, precise).unwrap();
        prop_assert_eq!(s.dtype(), dtype);
        close("softmax", &out(&s), &softmax_ref(&f64s(&x), c), tol)?;
        let lse = a.logsumexp(&[1], false).unwrap();
        let want: Vec<f64> = x.chunks(c).map(|row| row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln()).collect();
        close("logsumexp", &out(&lse), &want, tol)?;
        let ls = a.log_softmax(1).unwrap();
        let want: Vec<f64> = softmax_ref(&f64s(&x), c).into_iter().map(f64::ln).collect();
        close("log_softmax", &out(&ls), &want, Tol { atol: tol.atol * 4.0, rtol: tol.rtol })?;
        // Along axis 0.
        let s0 = a.softmax(0, precise).unwrap();
        let t: Vec<f64> = (0..c * r).map(|i| x[(i % r) * c + i / r] as f64).collect(); // transposed
        let st = softmax_ref(&t, r);
        let want: Vec<f64> = (0..r * c).map(|i| st[(i % c) * r + i / c]).collect();
        close("softmax axis 0", &out(&s0), &want, tol)?;
    }

    #[test]
    fn sums_means_extrema((r, c, x) in mat()) {
        let a = arr(&x, &[r, c]);
        let rows: Vec<&[f32]> = x.chunks(c).collect();
        close("sum", &out(&a.sum(&[1], false).unwrap()), &rows.iter().map(|w| w.iter().map(|&v| v as f64).sum()).collect::<Vec<_>>(), Tol { atol: 1e-5, rtol: 1e-5 })?;
        close("mean all", &out(&a.mean(&[], false).unwrap()), &[x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64], Tol { atol: 1e-5, rtol: 1e-5 })?;
        close("max", &out(&a.max(&[1], false).unwrap()), &rows.iter().map(|w| w.iter().map(|&v| v as f64).fold(f64::MIN, f64::max)).collect::<Vec<_>>(), F32)?;
        close("min axis 0", &out(&a.min(&[0], true).unwrap()), &(0..c).map(|j| (0..r).map(|i| x[i * c + j] as f64).fold(f64::MAX, f64::min)).collect::<Vec<_>>(), F32)?;
        prop_assert_eq!(a.min(&[0], true).unwrap().shape(), vec![1, c]);
        let var: Vec<f64> = rows.iter().map(|w| { let m = w.iter().map(|&v| v as f64).sum::<f64>() / c as f64; w.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / c as f64 }).collect();
        close("var", &out(&a.var(&[1], false).unwrap()), &var, Tol { atol: 1e-5, rtol: 1e-4 })?;
    }

    #[test]
    fn cumsum_variants((r, c, x) in mat(), reverse in any::<bool>(), inclusive in any::<bool>()) {
        let y = out(&arr(&x, &[r, c]).cumsum(1, reverse, inclusive).unwrap());
        let mut want = vec![0.0f64; r * c];
        for i in 0..r {
            for j in 0..c {
                let range: Vec<usize> = match (reverse, inclusive) {
                    (false, true) => (0..=j).collect(),
                    (false, false) => (0..j).collect(),
                    (true, true) => (j..c).collect(),
                    (true, false) => (j + 1..c).collect(),
                };
                want[i * c + j] = range.iter().map(|&t| x[i * c + t] as f64).sum();
            }
        }
        close("cumsum", &y, &want, Tol { atol: 1e-5, rtol: 1e-5 })?;
        let cm = out(&arr(&x, &[r, c]).cummax(1, false, true).unwrap());
        let want: Vec<f64> = (0..r * c).map(|i| x[i - i % c..=i].iter().map(|&v| v as f64).fold(f64::MIN, f64::max)).collect();
        close("cummax", &cm, &want, F32)?;
    }

    #[test]
    fn argmax_argmin((r, c, x) in mat(), axis in 0i32..2) {
        let a = arr(&x, &[r, c]);
        let lanes = if axis == 1 { r } else { c };
        let am = a.argmax(axis, false).unwrap().to_vec::<u32>().unwrap();
        let an = a.argmin(axis, false).unwrap().to_vec::<u32>().unwrap();
        for i in 0..lanes {
            let l = lane(&x, r, c, axis, i);
            // The first index of the extreme value (ties keep the lowest index).
            let mx = l.iter().cloned().fold(f32::MIN, f32::max);
            let mn = l.iter().cloned().fold(f32::MAX, f32::min);
            prop_assert_eq!(am[i] as usize, l.iter().position(|&v| v == mx).unwrap());
            prop_assert_eq!(an[i] as usize, l.iter().position(|&v| v == mn).unwrap());
        }
    }

    #[test]
    fn sort_argsort((r, c, x) in mat(), axis in 0i32..2) {
        let a = arr(&x, &[r, c]);
        let idx = a.argsort(axis).unwrap();
        let sorted = a.sort(axis).unwrap().to_vec::<f32>().unwrap();
        let gathered = a.take_along_axis(&idx, axis).unwrap().to_vec::<f32>().unwrap();
        prop_assert_eq!(&gathered, &sorted);
        let iv = idx.to_vec::<u32>().unwrap();
        let lanes = if axis == 1 { r } else { c };
        for i in 0..lanes {
            let mut want = lane(&x, r, c, axis, i);
            want.sort_by(f32::total_cmp);
            prop_assert_eq!(lane(&sorted, r, c, axis, i), want);
            let mut p: Vec<u32> = lane(&iv.iter().map(|&v| v as f32).collect::<Vec<_>>(), r, c, axis, i).iter().map(|&v| v as u32).collect();
            p.sort();
            prop_assert_eq!(p, (0..(if axis == 1 { c } else { r }) as u32).collect::<Vec<_>>(), "argsort is a permutation");
        }
    }

    #[test]
    fn argpartition_and_topk((r, c, x) in mat(), kth_seed in 0usize..100) {
        let a = arr(&x, &[r, c]);
        let kth = kth_seed % c;
        let p = a.argpartition(kth as i32, 1).unwrap().to_vec::<u32>().unwrap();
        let k = kth + 1;
        let tv = a.topk(k, 1).unwrap();
        prop_assert_eq!(tv.shape(), vec![r, k]);
        let tv = tv.to_vec::<f32>().unwrap();
        let ti = a.topk_indices(k, 1).unwrap().to_vec::<u32>().unwrap();
        for i in 0..r {
            let row = &x[i * c..(i + 1) * c];
            let mut s = row.to_vec();
            s.sort_by(f32::total_cmp);
            let pr: Vec<f32> = p[i * c..(i + 1) * c].iter().map(|&j| row[j as usize]).collect();
            let mut perm: Vec<u32> = p[i * c..(i + 1) * c].to_vec();
            perm.sort();
            prop_assert_eq!(perm, (0..c as u32).collect::<Vec<_>>());
            prop_assert_eq!(pr[kth], s[kth], "kth in sorted position");
            prop_assert!(pr[..kth].iter().all(|&v| v <= s[kth]) && pr[kth + 1..].iter().all(|&v| v >= s[kth]));
            let largest: Vec<f32> = s[c - k..].to_vec();
            let mut got = tv[i * k..(i + 1) * k].to_vec();
            got.sort_by(f32::total_cmp);
            prop_assert_eq!(&got, &largest, "topk values");
            let mut got: Vec<f32> = ti[i * k..(i + 1) * k].iter().map(|&j| row[j as usize]).collect();
            got.sort_by(f32::total_cmp);
            prop_assert_eq!(&got, &largest, "topk indices");
        }
    }
}

#[test]
fn selection_argument_errors() {
    let a = Array::zeros(&[2, 3], DType::F32).unwrap();
    assert!(a.topk(0, 1).is_err() && a.topk(4, 1).is_err() && a.topk_indices(4, -1).is_err());
    assert!(a.argpartition(3, 1).is_err() && a.argmax(2, false).is_err() && a.cumsum(-3, false, true).is_err());
}
