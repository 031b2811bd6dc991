//! Core behaviour: creation, readback, errors as values, views, the ops other crates rely on most.
use mlx_array::{ops, Array, AttentionMask, DType, Error, QuantMode};

#[test]
fn roundtrip_and_dtype_checks() {
    let a = Array::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
    assert_eq!(a.shape(), vec![2, 3]);
    assert_eq!(a.dtype(), DType::I32);
    assert_eq!(a.to_vec::<i32>().unwrap(), vec![1, 2, 3, 4, 5, 6]);
    assert!(matches!(a.to_vec::<f32>(), Err(Error::DType { .. })));
    assert!(matches!(Array::from_slice(&[1.0f32; 5], &[2, 3]), Err(Error::Shape { .. })));
    // A transposed view reads back in logical (row-major) order.
    let t = a.transpose(&[1, 0]).unwrap();
    assert_eq!(t.to_vec::<i32>().unwrap(), vec![1, 4, 2, 5, 3, 6]);
    let b = a.astype(DType::BF16).unwrap();
    assert_eq!(b.to_vec_f32().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
}

#[test]
fn mlx_errors_are_values_with_messages() {
    let a = Array::zeros(&[2, 3], DType::F32).unwrap();
    match a.matmul(&a) {
        Err(Error::Mlx { op, msg }) => {
            assert_eq!(op, "matmul");
            assert!(msg.contains("must match"), "{msg}");
        }
        other => panic!("expected an MLX error, got {other:?}"),
    }
    assert!(a.reshape(&[4, 2]).is_err());
    assert!(a.slice_axis(1, 2, 4).is_err());
    assert!(a.softmax(2, false).is_err());
}

#[test]
fn slices_and_scatter_rows() {
    let a = Array::arange(0, 12, DType::F32).unwrap().reshape(&[4, 3]).unwrap();
    assert_eq!(a.slice_axis(0, 1, 3).unwrap().to_vec::<f32>().unwrap(), vec![3., 4., 5., 6., 7., 8.]);
    assert_eq!(a.slice(&[0, 1], &[4, 3], &[2, 1]).unwrap().to_vec::<f32>().unwrap(), vec![1., 2., 7., 8.]);
    let rows = Array::from_slice(&[3i32, 0], &[2]).unwrap();
    let upd = Array::full(&[2, 3], -1.0, DType::F32).unwrap();
    let s = ops::scatter_rows(&a, &rows, &upd).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![-1., -1., -1., 3., 4., 5., 6., 7., 8., -1., -1., -1.]);
    assert!(ops::scatter_rows(&a, &rows, &Array::zeros(&[2, 2], DType::F32).unwrap()).is_err());
}

#[test]
fn addmm_applies_c() {
    let a = Array::from_slice(&[1.0f32, 2., 3., 4.], &[2, 2]).unwrap();
    let i = Array::from_slice(&[1.0f32, 0., 0., 1.], &[2, 2]).unwrap();
    let c = Array::from_slice(&[10.0f32, 20., 30., 40.], &[2, 2]).unwrap();
    let y = a.addmm(&i, &c, 2.0, 0.5).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![7., 14., 21., 28.]);
}

#[test]
fn sliding_window_attention_matches_explicit_mask() {
    let q = Array::arange(0, 2 * 5 * 4, DType::F32).unwrap().reshape(&[1, 2, 5, 4]).unwrap().mul_scalar(0.01).unwrap();
    let causal = q.sdpa(&q, &q, 0.5, AttentionMask::Causal).unwrap();
    let wide = q.sdpa(&q, &q, 0.5, AttentionMask::SlidingWindow(5)).unwrap();
    let a = causal.to_vec::<f32>().unwrap();
    let b = wide.to_vec::<f32>().unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-5);
    }
    let narrow = q.sdpa(&q, &q, 0.5, AttentionMask::SlidingWindow(1)).unwrap();
    // window 1: each query attends only to itself, so the output is V itself.
    let v = q.to_vec::<f32>().unwrap();
    for (x, y) in narrow.to_vec::<f32>().unwrap().iter().zip(&v) {
        assert!((x - y).abs() < 1e-5);
    }
}

#[test]
fn quantize_modes_roundtrip() {
    let w = Array::arange(0, 64 * 64, DType::F32).unwrap().reshape(&[64, 64]).unwrap().mul_scalar(1.0 / 4096.0).unwrap();
    // Values lie in [0, 1); tolerances follow each format's step size near 1.
    for (mode, tol) in [(QuantMode::Affine { bits: 4, group_size: 64 }, 0.04), (QuantMode::Affine { bits: 8, group_size: 32 }, 0.002), (QuantMode::Mxfp4, 0.26), (QuantMode::Mxfp8, 0.07)] {
        let q = w.quantize(mode).unwrap();
        let d = q.dequantize(Some(DType::F32)).unwrap();
        let err = d.sub(&w).unwrap().abs().unwrap().max(&[], false).unwrap().item::<f32>().unwrap();
        assert!(err < tol, "{mode:?}: max error {err}");
        assert!(err > 0.0, "{mode:?}: lossless quantization is implausible");
        let x = Array::ones(&[1, 64], DType::F32).unwrap();
        let y = q.matmul(&x, true).unwrap();
        assert_eq!(y.shape(), vec![1, 64]);
    }
    assert!(matches!(w.quantize(QuantMode::Affine { bits: 7, group_size: 64 }), Err(Error::InvalidArgument { .. })));
}

#[test]
fn slice_update_writes_block() {
    let a = Array::zeros(&[2, 3], DType::F32).unwrap();
    let u = Array::from_slice(&[1.0f32, 2.], &[1, 2]).unwrap();
    let b = a.slice_update(&u, &[1, 1]).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![0., 0., 0., 0., 1., 2.]);
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.; 6], "the source is not modified");
    assert!(a.slice_update(&u, &[1, 2]).is_err());
    assert!(a.slice_update(&u.astype(DType::BF16).unwrap(), &[0, 0]).is_err());
}

#[test]
fn graph_nodes_counts_each_pending_primitive_once() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = a.add(&a).unwrap();
    let parts = b.split(2, 0).unwrap();
    // both outputs of the split and the shared `b` below them: two primitives (Add, Split)
    let (n, by) = mlx_array::graph_nodes(&[&parts[0], &parts[1]]).unwrap();
    assert_eq!(n, 2, "{by:?}");
    let c = parts[0].mul(&parts[1]).unwrap();
    let (n, by) = mlx_array::graph_nodes(&[&c]).unwrap();
    assert_eq!(n, 3, "{by:?}");
    assert_eq!(by.iter().map(|(_, c)| c).sum::<usize>(), 3);
    assert!(by.iter().any(|(name, c)| name == "Multiply" && *c == 1), "{by:?}");
    // evaluated arrays are no longer pending
    c.eval().unwrap();
    assert_eq!(mlx_array::graph_nodes(&[&c]).unwrap().0, 0);
    assert_eq!(mlx_array::graph_nodes(&[]).unwrap().0, 0);
}

/// `matmul_weight_t` of a `[1, L, in]` input: the product of the flattened input, bit for bit
/// (f32 and bf16, one row and eight, a stored `[out, in]` weight read transposed), in one
/// graph node besides the weight's view (MLX's matmul of a 3-D input and a 2-D weight adds a
/// flatten and an unflatten).
#[test]
fn matmul_weight_t_of_one_batch_is_one_node() {
    use mlx_array::random::{normal, Key};
    let key = Key::new(5).unwrap();
    let ks = key.split_n(2).unwrap();
    for dt in [DType::F32, DType::BF16] {
        let w = normal(&[48, 40], DType::F32, &ks[0]).unwrap().astype(dt).unwrap();
        let wt = w.swap_axes(0, 1).unwrap();
        wt.eval().unwrap();
        for l in [1usize, 8] {
            let x = normal(&[1, l, 40], DType::F32, &ks[1]).unwrap().astype(dt).unwrap();
            x.eval().unwrap();
            let y = x.matmul_weight_t(&wt).unwrap();
            assert_eq!(y.dims(), vec![1, l as i32, 48]);
            let (_, by) = mlx_array::graph_nodes(&[&y]).unwrap();
            assert!(by.iter().all(|(name, _)| name != "Flatten" && name != "Unflatten"), "{by:?}");
            assert!(by.iter().any(|(name, c)| name == "Matmul" && *c == 1), "{by:?}");
            let flat = x.reshape(&[l as i32, 40]).unwrap().matmul(&wt).unwrap();
            let (a, b) = (y.astype(DType::F32).unwrap().to_vec::<f32>().unwrap(), flat.astype(DType::F32).unwrap().to_vec::<f32>().unwrap());
            assert!(a == b, "{dt:?} L={l}: differs from the flattened product");
            // with the caller's evaluated [1, in, out] view: the product alone, the same bits
            let held = wt.expand_dims(0).unwrap();
            held.eval().unwrap();
            let yh = x.matmul_weight_t_held(&wt, Some(&held)).unwrap();
            assert_eq!(mlx_array::graph_nodes(&[&yh]).unwrap().0, 1);
            assert!(yh.astype(DType::F32).unwrap().to_vec::<f32>().unwrap() == a, "{dt:?} L={l}: the held view's product differs");
        }
        // a view that is not the weight's [1, in, out] is refused
        assert!(normal(&[1, 1, 40], DType::F32, &ks[1]).unwrap().matmul_weight_t_held(&wt, Some(&wt)).is_err());
        assert!(normal(&[1, 1, 40], DType::F32, &ks[1]).unwrap().matmul_weight_t_held(&wt, Some(&wt.expand_dims(2).unwrap())).is_err());
    }
}
