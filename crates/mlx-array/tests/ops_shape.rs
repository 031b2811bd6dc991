//! reshape, transpose, slicing, concatenation, splitting and padding against index arithmetic.
mod common;
use common::*;
use mlx_array::{ops, Array};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn reshape_transpose((shape, x) in cube(6), keys in vals(3, 0.0, 1.0)) {
        let a = arr(&x, &shape);
        let flat = a.reshape(&[-1]).unwrap();
        prop_assert_eq!(flat.to_vec::<f32>().unwrap(), x.clone(), "reshape keeps row-major order");
        let r = a.reshape(&[shape[0] as i32 * shape[1] as i32, shape[2] as i32]).unwrap();
        prop_assert_eq!(r.shape(), vec![shape[0] * shape[1], shape[2]]);
        let p = perm(&keys);
        let t = a.transpose(&p.iter().map(|&i| i as i32).collect::<Vec<_>>()).unwrap();
        let tshape: Vec<usize> = p.iter().map(|&i| shape[i]).collect();
        prop_assert_eq!(t.shape(), tshape.clone());
        let want: Vec<f32> = (0..x.len()).map(|i| {
            let m = unravel(i, &tshape);
            let mut src = vec![0; 3];
            for (d, &pd) in p.iter().enumerate() { src[pd] = m[d]; }
            x[ravel(&src, &shape)]
        }).collect();
        prop_assert_eq!(t.to_vec::<f32>().unwrap(), want.clone());
        // a transposed view made contiguous keeps its shape and values
        let c = t.contiguous().unwrap();
        prop_assert_eq!(c.shape(), tshape);
        prop_assert_eq!(c.to_vec::<f32>().unwrap(), want);
        prop_assert!(a.reshape(&[x.len() as i32 + 1]).is_err());
    }

    #[test]
    fn strided_slice((shape, x) in cube(6), b in prop::collection::vec((0usize..6, 0usize..6, 1usize..4), 3)) {
        let start: Vec<usize> = (0..3).map(|d| b[d].0.min(b[d].1) % (shape[d] + 1)).collect();
        let stop: Vec<usize> = (0..3).map(|d| (b[d].0.max(b[d].1)).min(shape[d]).max(start[d])).collect();
        let step: Vec<usize> = b.iter().map(|t| t.2).collect();
        let y = arr(&x, &shape).slice(&start, &stop, &step).unwrap();
        let oshape: Vec<usize> = (0..3).map(|d| (stop[d] - start[d]).div_ceil(step[d])).collect();
        prop_assert_eq!(y.shape(), oshape.clone());
        let want: Vec<f32> = (0..oshape.iter().product()).map(|i| {
            let m = unravel(i, &oshape);
            let src: Vec<usize> = (0..3).map(|d| start[d] + m[d] * step[d]).collect();
            x[ravel(&src, &shape)]
        }).collect();
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), want.clone());
        prop_assert_eq!(y.contiguous().unwrap().to_vec::<f32>().unwrap(), want, "a strided view made contiguous");
        // slice_axis is the single-axis case.
        let s1 = arr(&x, &shape).slice_axis(2, start[2], stop[2]).unwrap();
        prop_assert_eq!(s1.shape(), vec![shape[0], shape[1], stop[2] - start[2]]);
    }

    #[test]
    fn concat_split_stack((shape, x) in cube(6), axis in 0usize..3, extra in 1usize..4, fill in vals(100, -1.0, 1.0)) {
        let mut s2 = shape.clone();
        s2[axis] = extra;
        let y2: Vec<f32> = fill[..s2.iter().product()].to_vec();
        let (a, b) = (arr(&x, &shape), arr(&y2, &s2));
        let c = ops::concatenate(&[&a, &b], axis as i32).unwrap();
        let mut cs = shape.clone();
        cs[axis] += extra;
        prop_assert_eq!(c.shape(), cs.clone());
        let want: Vec<f32> = (0..cs.iter().product()).map(|i| {
            let mut m = unravel(i, &cs);
            if m[axis] < shape[axis] { x[ravel(&m, &shape)] } else { m[axis] -= shape[axis]; y2[ravel(&m, &s2)] }
        }).collect();
        prop_assert_eq!(c.to_vec::<f32>().unwrap(), want);
        // split_at undoes the concatenation.
        let parts = c.split_at(&[shape[axis]], axis as i32).unwrap();
        prop_assert_eq!(parts.len(), 2);
        prop_assert_eq!(parts[0].to_vec::<f32>().unwrap(), x.clone());
        prop_assert_eq!(parts[1].to_vec::<f32>().unwrap(), y2);
        // Equal split of [a, a] gives a twice; stack adds an axis.
        let aa = ops::concatenate(&[&a, &a], axis as i32).unwrap().split(2, axis as i32).unwrap();
        prop_assert_eq!(aa[1].to_vec::<f32>().unwrap(), x.clone());
        let st = ops::stack(&[&a, &a, &a], 0).unwrap();
        prop_assert_eq!(st.shape()[0], 3);
        prop_assert_eq!(st.to_vec::<f32>().unwrap(), [x.clone(), x.clone(), x.clone()].concat());
        prop_assert!(c.split(cs[axis] + 1, axis as i32).is_err());
    }

    #[test]
    fn pad_with_value((shape, x) in cube(6), w in prop::collection::vec((0usize..3, 0usize..3), 3), v in -5.0f32..5.0) {
        let widths: Vec<(usize, usize)> = w.clone();
        let y = arr(&x, &shape).pad(&widths, v).unwrap();
        let ps: Vec<usize> = (0..3).map(|d| shape[d] + w[d].0 + w[d].1).collect();
        prop_assert_eq!(y.shape(), ps.clone());
        let want: Vec<f32> = (0..ps.iter().product()).map(|i| {
            let m = unravel(i, &ps);
            if (0..3).all(|d| m[d] >= w[d].0 && m[d] < w[d].0 + shape[d]) {
                x[ravel(&(0..3).map(|d| m[d] - w[d].0).collect::<Vec<_>>(), &shape)]
            } else { v }
        }).collect();
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), want);
    }
}

#[test]
fn shape_argument_errors() {
    let a = Array::zeros(&[2, 3], mlx_array::DType::F32).unwrap();
    assert!(a.pad(&[(1, 1)], 0.0).is_err());
    assert!(a.slice(&[0, 0], &[2, 4], &[1, 1]).is_err());
    assert!(ops::concatenate(&[], 0).is_err());
    assert!(ops::concatenate(&[&a, &Array::zeros(&[3, 3], mlx_array::DType::F32).unwrap()], 1).is_err());
}
