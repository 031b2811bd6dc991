//! Seeded randomness and value_and_grad against analytic and finite-difference gradients.
use mlx_array::grad::value_and_grad;
use mlx_array::random::{self, Key};
use mlx_array::{Array, DType, Error};

#[test]
fn keys_are_reproducible_and_split_independent() {
    let k = Key::new(7).unwrap();
    let a = random::normal(&[64], DType::F32, &k).unwrap().to_vec::<f32>().unwrap();
    let b = random::normal(&[64], DType::F32, &Key::new(7).unwrap()).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a, b);
    let c = random::normal(&[64], DType::F32, &Key::new(8).unwrap()).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(a, c);
    let ks = k.split_n(3).unwrap();
    let draws: Vec<Vec<f32>> = ks.iter().map(|k| random::uniform(&[16], 0.0, 1.0, DType::F32, k).unwrap().to_vec().unwrap()).collect();
    assert_ne!(draws[0], draws[1]);
    assert_ne!(draws[1], draws[2]);
    let (k1, k2) = k.split().unwrap();
    assert_eq!(k1.as_array().shape(), vec![2]);
    assert_ne!(k1.as_array().to_vec::<u32>().unwrap(), k2.as_array().to_vec::<u32>().unwrap());
    assert!(k.split_n(0).is_err());
}

#[test]
fn distributions_have_the_right_moments() {
    let k = Key::new(1).unwrap();
    let n = random::normal_with(&[20000], 3.0, 2.0, DType::F32, &k).unwrap();
    let v = n.to_vec::<f32>().unwrap();
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
    assert!((mean - 3.0).abs() < 0.06, "{mean}");
    assert!((var.sqrt() - 2.0).abs() < 0.06, "{var}");
    let u = random::uniform(&[20000], -1.0, 3.0, DType::BF16, &k).unwrap();
    assert_eq!(u.dtype(), DType::BF16);
    let u = u.to_vec_f32().unwrap();
    assert!(u.iter().all(|&x| (-1.0..=3.0).contains(&x)));
    let m = u.iter().sum::<f32>() / u.len() as f32;
    assert!((m - 1.0).abs() < 0.05, "{m}");
    let p = Array::from_slice(&[0.2f32], &[1]).unwrap();
    let b = random::bernoulli(&p, &[20000], &k).unwrap().astype(DType::F32).unwrap().mean(&[], false).unwrap().item::<f32>().unwrap();
    assert!((b - 0.2).abs() < 0.02, "{b}");
    let r = random::randint(&[1000], -3, 5, DType::I32, &k).unwrap().to_vec::<i32>().unwrap();
    assert!(r.iter().all(|x| (-3..5).contains(x)) && r.contains(&-3) && r.contains(&4));
    assert!(matches!(random::normal(&[2], DType::I32, &k), Err(Error::DType { .. })));
    assert!(random::uniform(&[2], 1.0, 1.0, DType::F32, &k).is_err());
}

#[test]
fn categorical_follows_logits() {
    let k = Key::new(3).unwrap();
    // Two distributions (rows), probabilities (0.1, 0.2, 0.7) and (0.5, 0.5, 0).
    let p = [[0.1f32, 0.2, 0.7], [0.5, 0.5, 0.0]];
    let logits: Vec<f32> = p.iter().flatten().map(|&x| x.ln()).collect();
    let l = Array::from_slice(&logits, &[2, 3]).unwrap();
    let s = random::categorical_n(&l, -1, 4000, &k).unwrap();
    assert_eq!(s.shape(), vec![2, 4000]);
    let v = s.to_vec::<u32>().unwrap();
    for (row, probs) in p.iter().enumerate() {
        for (c, &pc) in probs.iter().enumerate() {
            let f = v[row * 4000..(row + 1) * 4000].iter().filter(|&&x| x as usize == c).count() as f32 / 4000.0;
            assert!((f - pc).abs() < 0.03, "row {row} class {c}: {f} vs {pc}");
        }
    }
    // Along axis 0 (columns are the distributions), one draw each; same key, same draw.
    let a = random::categorical(&l, 0, &k).unwrap();
    assert_eq!(a.shape(), vec![3]);
    assert_eq!(a.to_vec::<u32>().unwrap(), random::categorical(&l, 0, &k).unwrap().to_vec::<u32>().unwrap());
    assert!(random::categorical(&l, 2, &k).is_err());
}

#[test]
fn gradients_match_analytic_and_finite_differences() {
    // loss(w, b) = sum((x @ w + b - y)^2) / n ; d/dw = 2/n x^T r, d/db = 2/n sum(r)
    let x = Array::from_slice(&[1.0f32, 2., -1., 0.5, 3., -2.], &[3, 2]).unwrap();
    let y = Array::from_slice(&[1.0f32, -1., 2.], &[3, 1]).unwrap();
    let w = Array::from_slice(&[0.3f32, -0.7], &[2, 1]).unwrap();
    let b = Array::from_slice(&[0.1f32], &[1]).unwrap();
    let loss = |p: &[Array]| x.matmul(&p[0])?.add(&p[1])?.sub(&y)?.square()?.mean(&[], false);
    let (l, g) = value_and_grad(loss, &[w.clone(), b.clone()]).unwrap();
    let (xv, yv, wv, bv) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let r: Vec<f64> = (0..3).map(|i| xv[2 * i] as f64 * wv[0] as f64 + xv[2 * i + 1] as f64 * wv[1] as f64 + bv[0] as f64 - yv[i] as f64).collect();
    let l_ref = r.iter().map(|v| v * v).sum::<f64>() / 3.0;
    assert!((l.item::<f32>().unwrap() as f64 - l_ref).abs() < 1e-5);
    let gw: Vec<f64> = (0..2).map(|j| 2.0 / 3.0 * (0..3).map(|i| xv[2 * i + j] as f64 * r[i]).sum::<f64>()).collect();
    let gb = 2.0 / 3.0 * r.iter().sum::<f64>();
    let gwv = g[0].to_vec::<f32>().unwrap();
    assert_eq!(g[0].shape(), vec![2, 1]);
    for j in 0..2 {
        assert!((gwv[j] as f64 - gw[j]).abs() < 1e-5, "{gwv:?} vs {gw:?}");
    }
    assert!((g[1].item::<f32>().unwrap() as f64 - gb).abs() < 1e-5);

    // A non-polynomial loss against central differences in f64 arithmetic on the same function.
    let f = |v: &[f64]| v.iter().map(|&t| (t.tanh() * t.exp()).sin()).sum::<f64>() + v[0] * v[1];
    let p0 = [0.3f64, -0.8, 1.1];
    let pa = Array::from_slice(&p0.map(|v| v as f32), &[3]).unwrap();
    let (val, g) = value_and_grad(
        |p| {
            let t = &p[0];
            let s = t.tanh()?.mul(&t.exp()?)?.sin()?.sum(&[], false)?;
            let prod = t.slice_axis(0, 0, 1)?.mul(&t.slice_axis(0, 1, 2)?)?.sum(&[], false)?;
            s.add(&prod)
        },
        &[pa],
    )
    .unwrap();
    assert!((val.item::<f32>().unwrap() as f64 - f(&p0)).abs() < 1e-5);
    let gv = g[0].to_vec::<f32>().unwrap();
    for i in 0..3 {
        let h = 1e-5;
        let (mut up, mut dn) = (p0, p0);
        up[i] += h;
        dn[i] -= h;
        let fd = (f(&up) - f(&dn)) / (2.0 * h);
        assert!((gv[i] as f64 - fd).abs() < 1e-4, "param {i}: {} vs {fd}", gv[i]);
    }
}

#[test]
fn closure_errors_come_back_as_our_errors() {
    let a = Array::ones(&[2, 3], DType::F32).unwrap();
    let r = value_and_grad(|p| p[0].matmul(&p[0]), std::slice::from_ref(&a));
    match r {
        Err(Error::Mlx { op, msg }) => assert!(op == "matmul" && msg.contains("must match"), "{op}: {msg}"),
        other => panic!("{other:?}"),
    }
    let r = value_and_grad(|_| Err(Error::InvalidArgument { op: "mine", msg: "custom".into() }), std::slice::from_ref(&a));
    assert!(matches!(r, Err(Error::InvalidArgument { op: "mine", .. })));
    assert!(matches!(value_and_grad(|p| p[0].square(), std::slice::from_ref(&a)), Err(Error::Shape { .. })), "non-scalar loss");
    assert!(value_and_grad(|p| p[0].sum(&[], false), &[]).is_err());
    // And a good call afterwards still works (no stale error state).
    let (_, g) = value_and_grad(|p| p[0].sum(&[], false), &[a]).unwrap();
    assert_eq!(g[0].to_vec::<f32>().unwrap(), vec![1.0; 6]);
}
