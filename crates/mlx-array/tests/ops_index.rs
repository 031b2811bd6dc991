//! take, take_along_axis, put_along_axis and scatter_rows against index loops.
mod common;
use common::*;
use mlx_array::{ops, Array};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn take_along_any_axis((shape, x) in cube(5), axis in 0usize..3, raw in prop::collection::vec(0usize..100, 1..7)) {
        let idx: Vec<i32> = raw.iter().map(|&i| (i % shape[axis]) as i32).collect();
        let y = arr(&x, &shape).take(&Array::from_slice(&idx, &[idx.len()]).unwrap(), axis as i32).unwrap();
        let mut oshape = shape.clone();
        oshape[axis] = idx.len();
        prop_assert_eq!(y.shape(), oshape.clone());
        let want: Vec<f32> = (0..oshape.iter().product()).map(|i| {
            let mut m = unravel(i, &oshape);
            m[axis] = idx[m[axis]] as usize;
            x[ravel(&m, &shape)]
        }).collect();
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), want);
    }

    #[test]
    fn take_and_put_along_axis((shape, x) in cube(5), axis in 0usize..3, keys in vals(64, 0.0, 1.0), fill in vals(64, 100.0, 200.0)) {
        // For every lane a permutation of the axis (distinct indices, so put is well defined).
        let n = shape[axis];
        let total: usize = shape.iter().product();
        let idx: Vec<i32> = (0..total).map(|i| {
            let m = unravel(i, &shape);
            let lane = (ravel(&m, &shape) - m[axis] * strides(&shape)[axis]) % 61;
            let p = perm(&keys[lane..lane + n]);
            p[m[axis]] as i32
        }).collect();
        let ia = Array::from_slice(&idx, &shape).unwrap();
        let a = arr(&x, &shape);
        let y = a.take_along_axis(&ia, axis as i32).unwrap().to_vec::<f32>().unwrap();
        let want: Vec<f32> = (0..total).map(|i| { let mut m = unravel(i, &shape); m[axis] = idx[i] as usize; x[ravel(&m, &shape)] }).collect();
        prop_assert_eq!(&y, &want);
        let vals_ = &fill[..total.min(64)];
        let v: Vec<f32> = (0..total).map(|i| vals_[i % vals_.len()]).collect();
        let p = a.put_along_axis(&ia, &arr(&v, &shape), axis as i32).unwrap().to_vec::<f32>().unwrap();
        let mut want = x.clone();
        for i in 0..total {
            let mut m = unravel(i, &shape);
            m[axis] = idx[i] as usize;
            want[ravel(&m, &shape)] = v[i];
        }
        prop_assert_eq!(p, want);
    }

    #[test]
    fn scatter_rows_replaces((rows, cols, x) in (1usize..8, 1usize..5).prop_flat_map(|(r, c)| (Just(r), Just(c), vals(r * c, -1.0, 1.0))), keys in vals(8, 0.0, 1.0), m_seed in 0usize..100) {
        let p = perm(&keys[..rows]);
        let m = 1 + m_seed % rows;
        let picked: Vec<i32> = p[..m].iter().map(|&i| i as i32).collect();
        let upd: Vec<f32> = (0..m * cols).map(|i| 10.0 + i as f32).collect();
        let y = ops::scatter_rows(&arr(&x, &[rows, cols]), &Array::from_slice(&picked, &[m]).unwrap(), &arr(&upd, &[m, cols])).unwrap();
        let mut want = x.clone();
        for (i, &r) in picked.iter().enumerate() {
            want[r as usize * cols..(r as usize + 1) * cols].copy_from_slice(&upd[i * cols..(i + 1) * cols]);
        }
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), want);
    }
}
