//! The single-primitive CPU paths of rms_norm, rope and few-query sdpa (`mlx-sys`'s
//! `cpukern/ops.cpp`) beyond what `ops_nn.rs` checks against f64 references: strided inputs
//! (views read in place) give exactly what their contiguous copies give, and gradients flow
//! through them as through the ops they replace (composed from MLX's general ops here).
mod common;
use common::*;
use mlx_array::grad::value_and_grad;
use mlx_array::{Array, AttentionMask, RopeConfig};

fn close_to(what: &str, got: &Array, want: &Array, tol: f32) {
    let (g, w) = (out(got), out(want));
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}: element {i} is {a}, expected {b}"
        );
    }
}

fn seq(n: usize, f: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * f).sin() * 1.7) + 0.1).collect()
}

/// A transposed view (non-contiguous) and its contiguous copy hold the same values.
fn view_and_copy(v: &[f32], shape: &[usize], axes: &[i32]) -> (Array, Array) {
    let view = arr(v, shape).transpose(axes).unwrap();
    let copy = arr(&out(&view), &view.shape());
    (view, copy)
}

/// Two rotations of `dims`-wide heads: NeoX over all of them (base 1e4), and GPT-J pairs over
/// the first 8 (base 100, positions scaled by 2).
fn ropes(dims: usize) -> [RopeConfig<'static>; 2] {
    [
        RopeConfig {
            dims,
            base: 10000.0,
            ..Default::default()
        },
        RopeConfig {
            dims: 8,
            traditional: true,
            base: 100.0,
            scale: 2.0,
            ..Default::default()
        },
    ]
}

#[test]
fn strided_inputs_match_contiguous_copies() {
    // rms_norm over a [4, 3, 8] view of a [3, 4, 8] array, and over a view strided in the last axis
    let (view, copy) = view_and_copy(&seq(96, 0.37), &[3, 4, 8], &[1, 0, 2]);
    let w = arr(&seq(8, 0.11), &[8]);
    assert_eq!(
        out(&view.rms_norm(Some(&w), 1e-5).unwrap()),
        out(&copy.rms_norm(Some(&w), 1e-5).unwrap())
    );
    let (view, copy) = view_and_copy(&seq(96, 0.23), &[8, 12], &[1, 0]);
    assert_eq!(
        out(&view.rms_norm(None, 1e-6).unwrap()),
        out(&copy.rms_norm(None, 1e-6).unwrap())
    );
    // rope over [B, H, L, D] views of [B, L, H, D] (the layout attention transposes from)
    let (view, copy) = view_and_copy(&seq(2 * 3 * 4 * 16, 0.19), &[2, 3, 4, 16], &[0, 2, 1, 3]);
    for cfg in ropes(16) {
        assert_eq!(
            out(&view.rope(&cfg, 7).unwrap()),
            out(&copy.rope(&cfg, 7).unwrap())
        );
    }
    // sdpa over strided q, k and v (k and v: the first positions of a longer cache)
    let (q, qc) = view_and_copy(&seq(2 * 6 * 16, 0.41), &[1, 2, 6, 16], &[0, 2, 1, 3]);
    let cache = arr(&seq(3 * 9 * 16, 0.13), &[1, 3, 9, 16]);
    let k = cache.slice_axis(2, 0, 5).unwrap();
    let v = cache.slice_axis(2, 1, 6).unwrap();
    let (kc, vc) = (arr(&out(&k), &k.shape()), arr(&out(&v), &v.shape()));
    let (q, qc) = (
        q.slice_axis(1, 0, 3).unwrap(),
        qc.slice_axis(1, 0, 3).unwrap(),
    );
    for mask in [AttentionMask::None, AttentionMask::Causal] {
        assert_eq!(
            out(&q.sdpa(&k, &v, 0.25, mask).unwrap()),
            out(&qc.sdpa(&kc, &vc, 0.25, mask).unwrap())
        );
    }
}

#[test]
fn rms_norm_gradients_match_the_composed_op() {
    let x = arr(&seq(3 * 10, 0.7), &[3, 10]);
    let w = arr(&seq(10, 0.3), &[10]);
    let g = arr(&seq(30, 1.3), &[3, 10]);
    let loss = |y: Array| y.mul(&g)?.sum(&[], false);
    let (_, fast) = value_and_grad(
        |p| loss(p[0].rms_norm(Some(&p[1]), 1e-5)?),
        &[x.clone(), w.clone()],
    )
    .unwrap();
    let composed = |p: &[Array]| {
        let n = p[0]
            .square()?
            .mean(&[-1], true)?
            .add_scalar(1e-5)?
            .rsqrt()?;
        loss(p[0].mul(&n)?.mul(&p[1])?)
    };
    let (_, want) = value_and_grad(composed, &[x, w]).unwrap();
    close_to("d/dx", &fast[0], &want[0], 1e-5);
    close_to("d/dw", &fast[1], &want[1], 1e-5);
}

#[test]
fn rope_gradient_is_the_inverse_rotation() {
    // loss = sum(rope(x) * g) is linear in x with gradient R^T g, so rope(gradient) = g
    let x = arr(&seq(2 * 3 * 12, 0.5), &[2, 3, 12]);
    let g = arr(&seq(2 * 3 * 12, 0.9), &[2, 3, 12]);
    for cfg in ropes(12) {
        let (_, grads) = value_and_grad(
            |p| p[0].rope(&cfg, 5)?.mul(&g)?.sum(&[], false),
            &[x.clone()],
        )
        .unwrap();
        close_to("rope(grad)", &grads[0].rope(&cfg, 5).unwrap(), &g, 1e-5);
    }
}

#[test]
fn sdpa_gradients_match_the_composed_op() {
    let q = arr(&seq(2 * 3 * 8, 0.31), &[1, 2, 3, 8]);
    let k = arr(&seq(2 * 5 * 8, 0.17), &[1, 2, 5, 8]);
    let v = arr(&seq(2 * 5 * 8, 0.53), &[1, 2, 5, 8]);
    let g = arr(&seq(2 * 3 * 8, 1.1), &[1, 2, 3, 8]);
    let loss = |y: Array| y.mul(&g)?.sum(&[], false);
    let (_, fast) = value_and_grad(
        |p| loss(p[0].sdpa(&p[1], &p[2], 0.3, AttentionMask::None)?),
        &[q.clone(), k.clone(), v.clone()],
    )
    .unwrap();
    let composed = |p: &[Array]| {
        loss(
            p[0].mul_scalar(0.3)?
                .matmul(&p[1].swap_axes(-1, -2)?)?
                .softmax(-1, true)?
                .matmul(&p[2])?,
        )
    };
    let (_, want) = value_and_grad(composed, &[q, k, v]).unwrap();
    for (i, n) in ["d/dq", "d/dk", "d/dv"].iter().enumerate() {
        close_to(n, &fast[i], &want[i], 1e-5);
    }
}

/// Inside `mlx_ops_only` an untraced forward builds MLX's own ops, as every traced one does
/// (`value_and_grad`): both give the same bits. Outside the scope the primitive's partial sums
/// round differently on this input, so a scope that changed nothing fails here.
#[test]
fn mlx_ops_scope_computes_what_traced_forwards_compute() {
    let d = 4096;
    let x = arr(&seq(4 * d, 0.37), &[4, d]);
    let w = arr(&seq(d, 0.11), &[d]);
    let g = arr(&seq(4 * d, 1.3), &[4, d]);
    let f = |x: &Array, w: &Array| x.rms_norm(Some(w), 1e-5)?.mul(&g)?.sum(&[], false);
    let (traced, _) = value_and_grad(|p| f(&p[0], &p[1]), &[x.clone(), w.clone()]).unwrap();
    let scoped = {
        let _ops = mlx_array::ops::mlx_ops_only();
        f(&x, &w).unwrap()
    };
    let primitive = f(&x, &w).unwrap();
    let bits = |a: &Array| out(a)[0].to_bits();
    assert_eq!(bits(&scoped), bits(&traced), "scoped {:?} vs traced {:?}", out(&scoped), out(&traced));
    assert_ne!(bits(&primitive), bits(&traced), "the primitive rounds as MLX's op does on this input");
}


/// `Array::greedy_pick` (one primitive for f32 logits on the CPU) against an f64 reference and
/// against MLX's ops (`argmax`, `take_along_axis`, `logsumexp`): the first index of the maximum,
/// and its log-prob within 2e-6 of f64 (MLX's own: 1e-4), with every kernel set this CPU runs,
/// for vocabularies that are not multiples of the vector width, masked (-inf) entries, ties, a
/// transposed view, and the rows MLX maps to NaN (all -inf, +inf).
#[test]
fn greedy_pick_matches_reference_and_mlx_ops() {
    // values in [0, 1)
    let mut u = fixed_stream(41).map(|e| (e + 1.0) / 2.0);
    let mut uniform = move || u.next().unwrap();
    on_each_kernel_set(|isa| {
        for &v in &[1usize, 7, 16, 33, 100, 4099, 49152] {
            let b = 3;
            let mut x: Vec<f32> = (0..b * v).map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 6.0).collect(); // roughly normal
            // row 1: masked entries and a tie for the maximum at two places
            for i in (2..v).step_by(3) {
                x[v + i] = f32::NEG_INFINITY;
            }
            if v >= 5 {
                x[v + 1] = 30.0;
                x[v + 4] = 30.0;
            }
            let a = Array::from_slice(&x, &[b, v]).unwrap();
            let (t, lp) = a.greedy_pick().unwrap();
            let (t, lp) = (t.to_vec::<u32>().unwrap(), lp.to_vec::<f32>().unwrap());
            let (mt, mlp) = {
                let _scope = mlx_array::ops::mlx_ops_only();
                let (t, lp) = a.greedy_pick().unwrap();
                (t.to_vec::<u32>().unwrap(), lp.to_vec::<f32>().unwrap())
            };
            for r in 0..b {
                let row = &x[r * v..(r + 1) * v];
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let at = row.iter().position(|&e| e == m).unwrap();
                let lse = m as f64 + row.iter().map(|&e| ((e - m) as f64).exp()).sum::<f64>().ln();
                let want = row[at] as f64 - lse;
                assert_eq!(t[r] as usize, at, "{isa} V {v} row {r}: token");
                assert_eq!(mt[r], t[r], "V {v} row {r}: token against MLX's argmax");
                assert!((lp[r] as f64 - want).abs() <= 2e-6 * want.abs().max(1.0), "{isa} V {v} row {r}: {} against {want}", lp[r]);
                // MLX sums the exps one after another in f32 (1.3e-5 relative off at V = 49152)
                assert!((lp[r] - mlp[r]).abs() <= 1e-4 * mlp[r].abs().max(1.0), "V {v} row {r}: {} against MLX's {}", lp[r], mlp[r]);
            }
        }
    });
    // a transposed view (rows of stride 2) gives what its contiguous copy gives
    let x: Vec<f32> = (0..2 * 64).map(|i| ((i * 37) % 101) as f32 * 0.1).collect();
    let view = Array::from_slice(&x, &[64, 2]).unwrap().transpose(&[1, 0]).unwrap();
    let (t, lp) = view.greedy_pick().unwrap();
    let dense = Array::from_slice(&view.to_vec::<f32>().unwrap(), &[2, 64]).unwrap();
    let (td, lpd) = dense.greedy_pick().unwrap();
    assert_eq!(t.to_vec::<u32>().unwrap(), td.to_vec::<u32>().unwrap());
    assert_eq!(lp.to_vec::<f32>().unwrap(), lpd.to_vec::<f32>().unwrap());
    // MLX's rule: rows whose maximum is infinite give NaN log-probs
    let x = [f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0, f32::INFINITY];
    let a = Array::from_slice(&x, &[2, 2]).unwrap();
    let (t, lp) = a.greedy_pick().unwrap();
    assert_eq!(t.to_vec::<u32>().unwrap(), vec![0, 1]);
    assert!(lp.to_vec::<f32>().unwrap().iter().all(|l| l.is_nan()));
    let _scope = mlx_array::ops::mlx_ops_only();
    let (_, mlp) = a.greedy_pick().unwrap();
    assert!(mlp.to_vec::<f32>().unwrap().iter().all(|l| l.is_nan()), "MLX's ops: {:?}", mlp.to_vec::<f32>().unwrap());
    assert!(Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap().greedy_pick().is_err());
}

/// Few-query attention over f32 rows read in place (the kernel sets' `attend`: scores, a
/// vectorised softmax and the weighted sum in one call) against MLX's attention op, with every
/// kernel set this CPU runs: head sizes with and without a scalar tail, key counts below and
/// above a vector, grouped heads, causal and not, a K/V cache's slice.
#[test]
fn f32_attention_rows_match_mlx_on_every_kernel_set() {
    on_each_kernel_set(|isa| {
        for &(d, keys, l) in &[(64usize, 1usize, 1usize), (64, 37, 1), (40, 130, 3), (128, 17, 8)] {
            let (hq, hk, cap) = (6, 2, keys + 5);
            let q = arr(&seq(hq * l * d, 0.37), &[1, hq, l, d]);
            // the cache's buffer holds `cap` positions; attention reads the first `keys`
            let kb = arr(&seq(hk * cap * d, 0.11), &[1, hk, cap, d]);
            let vb = arr(&seq(hk * cap * d, 0.23), &[1, hk, cap, d]);
            let (k, v) = (kb.slice_axis(2, 0, keys).unwrap(), vb.slice_axis(2, 0, keys).unwrap());
            for mask in [AttentionMask::None, AttentionMask::Causal] {
                if matches!(mask, AttentionMask::Causal) && l > keys {
                    continue;
                }
                let got = q.sdpa(&k, &v, 0.125, mask).unwrap();
                let want = {
                    let _scope = mlx_array::ops::mlx_ops_only();
                    q.sdpa(&k, &v, 0.125, mask).unwrap()
                };
                close_to(&format!("{isa} d {d} keys {keys} queries {l} {mask:?}"), &got, &want, 2e-6);
            }
        }
    });
}

/// `Array::nucleus` (the CPU primitive: no sort) keeps what mlx-lm's sort-based top-p (MLX's ops)
/// keeps, with every kernel set this CPU runs: peaked and flat rows, ties at the cut, masked
/// entries, several p; rows where the two differ only by the rounding of a mass at the cut
/// (within 1e-5 of p * total) are skipped.
#[test]
fn nucleus_matches_the_sorted_top_p() {
    let mut u = fixed_stream(7).map(|e| (e + 1.0) / 2.0);
    let mut uniform = move || u.next().unwrap();
    let mut compared = 0;
    on_each_kernel_set(|isa| {
        for &(v, spread) in &[(5usize, 1.0f32), (300, 0.3), (3000, 8.0), (4099, 2.0), (20000, 12.0)] {
            let b = 2;
            let mut x: Vec<f32> = (0..b * v).map(|_| ((uniform() * 8.0).floor() / 8.0) * spread).collect();
            for i in (1..v).step_by(7) {
                x[i] = f32::NEG_INFINITY;
            }
            let a = Array::from_slice(&x, &[b, v]).unwrap();
            for p in [0.1f32, 0.5, 0.9, 0.99] {
                let got = a.nucleus(p).unwrap().to_vec::<f32>().unwrap();
                let want = {
                    let _scope = mlx_array::ops::mlx_ops_only();
                    a.nucleus(p).unwrap().to_vec::<f32>().unwrap()
                };
                for r in 0..b {
                    let row = &x[r * v..(r + 1) * v];
                    // the masses at every distinct value, most likely first (f64), to spot cuts
                    // that rounding may move
                    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut vals: Vec<f32> = row.iter().copied().filter(|e| e.is_finite()).collect();
                    vals.sort_by(|a, b| b.total_cmp(a));
                    let total: f64 = vals.iter().map(|&e| ((e - m) as f64).exp()).sum();
                    let mut acc = 0.0f64;
                    let near = vals.iter().any(|&e| {
                        acc += ((e - m) as f64).exp();
                        (acc - p as f64 * total).abs() <= 1e-5 * total
                    });
                    if near {
                        continue;
                    }
                    compared += 1;
                    assert_eq!(&got[r * v..(r + 1) * v], &want[r * v..(r + 1) * v], "{isa} V {v} p {p} row {r}");
                }
            }
        }
    });
    assert!(compared > 20, "only {compared} rows compared");
    assert!(Array::from_slice(&[1.0f32, 2.0], &[1, 2]).unwrap().nucleus(1.0).is_err());
    assert!(Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap().nucleus(0.5).is_err());
}

/// `log_softmax` over the last axis of f32 `[B, V]` (the CPU primitive) against MLX's ops, with
/// every kernel set this CPU runs: vocabularies with a scalar tail, masked entries, a row of
/// -inf (NaN on both sides, MLX's rule).
#[test]
fn log_softmax_rows_match_mlx_ops() {
    let mut u = fixed_stream(3).map(|e| (e + 1.0) / 2.0);
    let mut uniform = move || u.next().unwrap();
    on_each_kernel_set(|isa| {
        for &v in &[1usize, 19, 4099, 151936] {
            let mut x: Vec<f32> = (0..3 * v).map(|_| (uniform() - 0.5) * 30.0).collect();
            for i in (0..v).step_by(5) {
                x[v + i] = f32::NEG_INFINITY;
            }
            x[2 * v..].iter_mut().for_each(|e| *e = f32::NEG_INFINITY);
            let a = Array::from_slice(&x, &[3, v]).unwrap();
            let got = a.log_softmax(-1).unwrap().to_vec::<f32>().unwrap();
            let want = {
                let _scope = mlx_array::ops::mlx_ops_only();
                a.log_softmax(-1).unwrap().to_vec::<f32>().unwrap()
            };
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= 2e-5 * w.abs().max(1.0);
                assert!(same, "{isa} V {v} element {i}: {g} against MLX's {w}");
            }
        }
    });
}
