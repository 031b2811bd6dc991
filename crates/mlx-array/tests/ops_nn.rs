//! conv1d (grouped / depthwise / causal), rms_norm, layer_norm, rope (offset, partial rotary,
//! NeoX and GPT-J layouts, explicit frequencies) and sdpa (causal, additive, boolean and
//! sliding-window masks, GQA) against naive f64 code.
mod common;
use common::*;
use mlx_array::{Array, AttentionMask, DType, RopeConfig};
use proptest::prelude::*;

/// out[n, t, o] = sum_{k, c} x[n, t*s + k*d - p, g*cg + c] * w[o, k, c]
#[allow(clippy::too_many_arguments)]
fn conv_ref(x: &[f32], w: &[f32], n: usize, l: usize, cin: usize, cout: usize, k: usize, s: usize, p: usize, d: usize, groups: usize) -> (usize, Vec<f64>) {
    let lo = (l + 2 * p - d * (k - 1) - 1) / s + 1;
    let (cg, og) = (cin / groups, cout / groups);
    let mut o = vec![0.0; n * lo * cout];
    for b in 0..n {
        for t in 0..lo {
            for oc in 0..cout {
                let g = oc / og;
                let mut acc = 0.0;
                for kk in 0..k {
                    let pos = (t * s + kk * d) as isize - p as isize;
                    if pos < 0 || pos >= l as isize {
                        continue;
                    }
                    for c in 0..cg {
                        acc += x[(b * l + pos as usize) * cin + g * cg + c] as f64 * w[(oc * k + kk) * cg + c] as f64;
                    }
                }
                o[(b * lo + t) * cout + oc] = acc;
            }
        }
    }
    (lo, o)
}

/// NeoX (halves) or GPT-J (adjacent pairs) rotation of the first `rd` of `dd` features.
#[allow(clippy::too_many_arguments)]
fn rope_ref(x: &[f32], rows: usize, dd: usize, rd: usize, base: f64, scale: f64, offset: usize, traditional: bool) -> Vec<f64> {
    let mut o = f64s(x);
    let half = rd / 2;
    // `x` is [.., rows, dd]: row r of every leading slice sits at position offset + r.
    for (row, chunk) in o.chunks_mut(dd).enumerate() {
        let pos = (offset + row % rows) as f64 * scale;
        let orig: Vec<f64> = chunk.to_vec();
        for i in 0..half {
            let theta = pos * base.powf(-2.0 * i as f64 / rd as f64);
            let (c, s) = (theta.cos(), theta.sin());
            let (a, b) = if traditional { (2 * i, 2 * i + 1) } else { (i, i + half) };
            chunk[a] = orig[a] * c - orig[b] * s;
            chunk[b] = orig[b] * c + orig[a] * s;
        }
    }
    o
}

/// Attention for one batch: q [hq, l, d], k/v [hkv, kl, d]; `allowed(i, j)` and `bias(i, j)`.
#[allow(clippy::too_many_arguments)]
fn sdpa_ref(q: &[f32], k: &[f32], v: &[f32], hq: usize, hkv: usize, l: usize, kl: usize, d: usize, scale: f64, allowed: &dyn Fn(usize, usize) -> bool, bias: &dyn Fn(usize, usize) -> f64) -> Vec<f64> {
    let mut o = vec![0.0; hq * l * d];
    for h in 0..hq {
        let g = h / (hq / hkv);
        for i in 0..l {
            let s: Vec<f64> = (0..kl)
                .map(|j| if allowed(i, j) { scale * (0..d).map(|t| q[(h * l + i) * d + t] as f64 * k[(g * kl + j) * d + t] as f64).sum::<f64>() + bias(i, j) } else { f64::NEG_INFINITY })
                .collect();
            let p = softmax_ref(&s, kl);
            for t in 0..d {
                o[(h * l + i) * d + t] = (0..kl).map(|j| p[j] * v[(g * kl + j) * d + t] as f64).sum();
            }
        }
    }
    o
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn conv1d_grouped(
        (n, l, groups, cg, og, k) in (1usize..3, 1usize..10, 1usize..4, 1usize..4, 1usize..3, 1usize..4),
        (s, p, d) in (1usize..3, 0usize..3, 1usize..3),
        seed in vals(2 * 9 * 9 + 6 * 3 * 3, -1.0, 1.0),
    ) {
        let (cin, cout) = (groups * cg, groups * og);
        prop_assume!(l + 2 * p > d * (k - 1));
        let x = &seed[..n * l * cin];
        let w = &seed[n * l * cin..n * l * cin + cout * k * cg];
        let y = arr(x, &[n, l, cin]).conv1d(&arr(w, &[cout, k, cg]), s, p, d, groups).unwrap();
        let (lo, want) = conv_ref(x, w, n, l, cin, cout, k, s, p, d, groups);
        prop_assert_eq!(y.shape(), vec![n, lo, cout]);
        close("conv1d", &out(&y), &want, Tol { atol: 1e-5, rtol: 1e-5 })?;
    }

    /// Depthwise causal short convolution (LFM2, GatedDeltaNet): groups = channels.
    #[test]
    fn conv1d_depthwise_causal((n, l, c, k) in (1usize..3, 1usize..10, 1usize..6, 1usize..5), seed in vals(2 * 9 * 5 + 5 * 4, -1.0, 1.0)) {
        let x = &seed[..n * l * c];
        let w = &seed[n * l * c..n * l * c + c * k];
        let y = arr(x, &[n, l, c]).conv1d_causal(&arr(w, &[c, k, 1]), 1, c).unwrap();
        prop_assert_eq!(y.shape(), vec![n, l, c]);
        // Same as a left-padded reference: out[t] = sum_k x[t - (K-1) + k] * w[k].
        let mut padded = vec![0.0f32; n * (l + k - 1) * c];
        for b in 0..n { for t in 0..l { for ch in 0..c { padded[(b * (l + k - 1) + t + k - 1) * c + ch] = x[(b * l + t) * c + ch]; } } }
        let (_, want) = conv_ref(&padded, w, n, l + k - 1, c, c, k, 1, 0, 1, c);
        close("conv1d_causal", &out(&y), &want, Tol { atol: 1e-5, rtol: 1e-5 })?;
    }

    #[test]
    fn rms_and_layer_norm((r, c, x, w, b) in (1usize..5, 1usize..33).prop_flat_map(|(r, c)| (Just(r), Just(c), vals(r * c, -3.0, 3.0), vals(c, 0.5, 1.5), vals(c, -1.0, 1.0))), bfl in any::<bool>()) {
        let eps = 1e-5f64;
        let (x, w, b, dtype, tol) = if bfl { (bfv(&x), bfv(&w), bfv(&b), DType::BF16, BF16) } else { (x, w, b, DType::F32, Tol { atol: 1e-5, rtol: 1e-4 }) };
        let (a, wa, ba) = (arr_as(&x, &[r, c], dtype), arr_as(&w, &[c], dtype), arr_as(&b, &[c], dtype));
        let y = a.rms_norm(Some(&wa), eps as f32).unwrap();
        prop_assert_eq!(y.dtype(), dtype);
        let want: Vec<f64> = x.chunks(c).flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
            row.iter().zip(&w).map(move |(&v, &g)| v as f64 / (ms + eps).sqrt() * g as f64).collect::<Vec<_>>()
        }).collect();
        close("rms_norm", &out(&y), &want, tol)?;
        let y = a.layer_norm(Some(&wa), Some(&ba), eps as f32).unwrap();
        let want: Vec<f64> = x.chunks(c).flat_map(|row| {
            let m = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = row.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / c as f64;
            row.iter().zip(w.iter().zip(&b)).map(move |(&v, (&g, &bb))| (v as f64 - m) / (var + eps).sqrt() * g as f64 + bb as f64).collect::<Vec<_>>()
        }).collect();
        // f32 rounds `x - mean` by about eps32 * max|x|, which the division by the row's standard
        // deviation magnifies: a row of nearly equal values is ill-conditioned, and the bound
        // grows with it (one row of [-2.151367, -2.1535554] is 2e-4 relative off in f32).
        let cond = x.chunks(c).map(|row| {
            let m = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = row.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / c as f64;
            let top = row.iter().fold(0f64, |t, &v| t.max((v as f64).abs()));
            8.0 * f32::EPSILON as f64 * top / (var + eps).sqrt() * 1.5
        }).fold(0f64, f64::max);
        let ln_tol = if bfl { Tol { atol: 3e-2, rtol: 2e-2 } } else { Tol { atol: tol.atol + cond, ..tol } };
        close("layer_norm", &out(&y), &want, ln_tol)?;
        // Without weights: plain normalisation.
        let y = a.rms_norm(None, eps as f32).unwrap();
        let want: Vec<f64> = x.chunks(c).flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
            row.iter().map(move |&v| v as f64 / (ms + eps).sqrt()).collect::<Vec<_>>()
        }).collect();
        close("rms_norm no weight", &out(&y), &want, tol)?;
    }

    #[test]
    fn rope_offset_partial(
        (h, l, half_d, rot_frac) in (1usize..3, 1usize..7, 1usize..9, 1usize..5),
        offset in 0usize..50, traditional in any::<bool>(), scale_pick in 0usize..2,
        seed in vals(2 * 6 * 16, -1.0, 1.0),
    ) {
        let dd = 2 * half_d;
        let rd = 2 * (1 + (half_d - 1) * rot_frac / 4); // 2..=dd, even
        let base = 10000.0f32;
        let scale = [1.0f32, 0.5][scale_pick];
        let x = &seed[..h * l * dd];
        let cfg = RopeConfig { dims: rd, traditional, base, scale, freqs: None };
        let y = arr(x, &[1, h, l, dd]).rope(&cfg, offset).unwrap();
        let want = rope_ref(x, l, dd, rd, base as f64, scale as f64, offset, traditional);
        close("rope", &out(&y), &want, Tol { atol: 2e-5, rtol: 1e-4 })?;
        // Explicit frequencies: MLX's `freqs` are the wavelengths base^(2i/rd) (rope uses 1/freqs).
        let f: Vec<f32> = (0..rd / 2).map(|i| base.powf(2.0 * i as f32 / rd as f32)).collect();
        let fa = arr(&f, &[rd / 2]);
        let cfg = RopeConfig { freqs: Some(&fa), ..cfg };
        let y2 = arr(x, &[1, h, l, dd]).rope(&cfg, offset).unwrap();
        close("rope with freqs", &out(&y2), &want, Tol { atol: 2e-5, rtol: 1e-4 })?;
    }

    #[test]
    fn rope_bf16((l, offset) in (1usize..6, 0usize..20), seed in vals(2 * 5 * 8, -1.0, 1.0)) {
        let x = bfv(&seed[..2 * l * 8]);
        let cfg = RopeConfig { dims: 8, ..Default::default() };
        let y = arr_as(&x, &[1, 2, l, 8], DType::BF16).rope(&cfg, offset).unwrap();
        prop_assert_eq!(y.dtype(), DType::BF16);
        close("rope bf16", &out(&y), &rope_ref(&x, l, 8, 8, 10000.0, 1.0, offset, false), BF16)?;
    }

    #[test]
    fn sdpa_masks_and_gqa(
        (b, hkv, rep, l, extra, d) in (1usize..3, 1usize..3, 1usize..4, 1usize..6, 0usize..4, 1usize..9),
        mask_kind in 0usize..5, window in 1usize..5, bfl in any::<bool>(), bucket in 2usize..9,
        seed in vals(2 * 6 * 5 * 8 * 3 + 9 * 5 * 9, -1.0, 1.0),
    ) {
        let hq = hkv * rep;
        let kl = l + extra;
        let (nq, nk) = (b * hq * l * d, b * hkv * kl * d);
        let mut q = seed[..nq].to_vec();
        let mut k = seed[nq..nq + nk].to_vec();
        let mut v = seed[nq + nk..nq + 2 * nk].to_vec();
        let addm: Vec<f32> = seed[nq + 2 * nk..nq + 2 * nk + l * kl].iter().map(|x| 2.0 * x).collect();
        let (dtype, tol) = if bfl { q = bfv(&q); k = bfv(&k); v = bfv(&v); (DType::BF16, Tol { atol: 2e-2, rtol: 2e-2 }) } else { (DType::F32, Tol { atol: 2e-5, rtol: 1e-4 }) };
        let scale = 1.0 / (d as f32).sqrt();
        let (qa, ka, va) = (arr_as(&q, &[b, hq, l, d], dtype), arr_as(&k, &[b, hkv, kl, d], dtype), arr_as(&v, &[b, hkv, kl, d], dtype));
        let boolm: Vec<bool> = (0..l * kl).map(|i| (i * 7 + 3) % 5 != 0 || i % kl == 0).collect(); // every row keeps key 0
        let add_arr = arr_as(&addm, &[l, kl], dtype);
        let bool_arr = Array::from_slice(&boolm, &[l, kl]).unwrap();
        let shift = kl - l; // query i sits at position shift + i
        let mask = match mask_kind {
            0 => AttentionMask::None,
            1 => AttentionMask::Causal,
            2 => AttentionMask::SlidingWindow(window),
            3 => AttentionMask::Array(&add_arr),
            _ => AttentionMask::Array(&bool_arr),
        };
        let allowed = |i: usize, j: usize| match mask_kind {
            1 => j <= shift + i,
            2 => j <= shift + i && j + window > shift + i,
            4 => boolm[i * kl + j],
            _ => true,
        };
        let bias = |i: usize, j: usize| if mask_kind == 3 { addm[i * kl + j] as f64 } else { 0.0 };
        let y = qa.sdpa(&ka, &va, scale, mask).unwrap();
        prop_assert_eq!(y.shape(), vec![b, hq, l, d]);
        let mut want = Vec::new();
        for bb in 0..b {
            want.extend(sdpa_ref(&q[bb * hq * l * d..(bb + 1) * hq * l * d], &k[bb * hkv * kl * d..(bb + 1) * hkv * kl * d], &v[bb * hkv * kl * d..(bb + 1) * hkv * kl * d], hq, hkv, l, kl, d, scale as f64, &allowed, &bias));
        }
        close("sdpa", &out(&y), &want, tol)?;
        // the same attention as matrix products, with the mask per query head too
        let yp = qa.sdpa_by_products(&ka, &va, scale, mask).unwrap();
        prop_assert_eq!(yp.dtype(), dtype);
        close("sdpa_by_products", &out(&yp), &want, tol)?;
        // keys padded to a multiple of `bucket`, the padding masked out
        let yb = qa.sdpa_by_products_bucketed(&ka, &va, scale, mask, bucket).unwrap();
        prop_assert_eq!(yb.shape(), vec![b, hq, l, d]);
        close("sdpa_by_products_bucketed", &out(&yb), &want, tol)?;
        if mask_kind >= 3 {
            let m = if mask_kind == 3 { &add_arr } else { &bool_arr };
            let per_head = m.reshape(&[1, 1, l as i32, kl as i32]).unwrap().broadcast_to(&[b, hq, l, kl]).unwrap();
            let yh = qa.sdpa_by_products(&ka, &va, scale, AttentionMask::Array(&per_head)).unwrap();
            close("sdpa_by_products, [B, Hq, L, K] mask", &out(&yh), &want, tol)?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Real head sizes over long caches: the CPU primitive's vector dot products, their tails (d
    /// not a multiple of the vector width) and its split of the heads over threads.
    #[test]
    fn sdpa_long_caches(
        (b, hkv, rep, l, kl, d) in (1usize..3, 1usize..4, 1usize..4, 1usize..9, 9usize..400, prop_oneof![Just(64usize), Just(80), Just(128), 17usize..40]),
        causal in any::<bool>(), bfl in any::<bool>(), salt in 0u32..1000,
    ) {
        let hq = hkv * rep;
        let (nq, nk) = (b * hq * l * d, b * hkv * kl * d);
        let gen = |n: usize, k: u32| -> Vec<f32> { (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(k * 97 + salt) % 2001) as f32 / 1000.0) - 1.0).collect() };
        let (mut q, mut k, mut v) = (gen(nq, 1), gen(nk, 2), gen(nk, 3));
        let (dtype, tol) = if bfl { q = bfv(&q); k = bfv(&k); v = bfv(&v); (DType::BF16, Tol { atol: 2e-2, rtol: 2e-2 }) } else { (DType::F32, Tol { atol: 2e-5, rtol: 1e-4 }) };
        let scale = 1.0 / (d as f32).sqrt();
        let (qa, ka, va) = (arr_as(&q, &[b, hq, l, d], dtype), arr_as(&k, &[b, hkv, kl, d], dtype), arr_as(&v, &[b, hkv, kl, d], dtype));
        let shift = kl - l;
        let allowed = |i: usize, j: usize| !causal || j <= shift + i;
        let mask = if causal { AttentionMask::Causal } else { AttentionMask::None };
        let y = qa.sdpa(&ka, &va, scale, mask).unwrap();
        let mut want = Vec::new();
        for bb in 0..b {
            want.extend(sdpa_ref(&q[bb * hq * l * d..(bb + 1) * hq * l * d], &k[bb * hkv * kl * d..(bb + 1) * hkv * kl * d], &v[bb * hkv * kl * d..(bb + 1) * hkv * kl * d], hq, hkv, l, kl, d, scale as f64, &allowed, &|_, _| 0.0));
        }
        close("sdpa", &out(&y), &want, tol)?;
        close("sdpa_by_products", &out(&qa.sdpa_by_products(&ka, &va, scale, mask).unwrap()), &want, tol)?;
        close("sdpa_by_products_bucketed 64", &out(&qa.sdpa_by_products_bucketed(&ka, &va, scale, mask, 64).unwrap()), &want, tol)?;
    }
}

#[test]
fn nn_argument_errors() {
    let x = Array::zeros(&[1, 4, 8], DType::F32).unwrap();
    assert!(x.rope(&RopeConfig { dims: 3, ..Default::default() }, 0).is_err());
    assert!(x.rope(&RopeConfig { dims: 10, ..Default::default() }, 0).is_err());
    assert!(x.conv1d(&Array::zeros(&[2, 3, 8], DType::F32).unwrap(), 0, 0, 1, 1).is_err());
    assert!(x.conv1d(&Array::zeros(&[2, 3, 3], DType::F32).unwrap(), 1, 0, 1, 1).is_err(), "channel mismatch");
    assert!(x.conv1d_causal(&Array::zeros(&[3, 8], DType::F32).unwrap(), 1, 1).is_err());
    let q = Array::zeros(&[1, 3, 2, 4], DType::F32).unwrap();
    let kv = Array::zeros(&[1, 2, 2, 4], DType::F32).unwrap();
    assert!(q.sdpa(&kv, &kv, 1.0, AttentionMask::None).is_err(), "3 query heads over 2 kv heads");
    assert!(q.sdpa(&kv, &kv, 1.0, AttentionMask::SlidingWindow(0)).is_err());
    assert!(q.sdpa_by_products(&kv, &kv, 1.0, AttentionMask::None).is_err(), "3 query heads over 2 kv heads");
    let q4 = Array::zeros(&[1, 4, 3, 4], DType::F32).unwrap();
    assert!(q4.sdpa_by_products(&kv, &kv, 1.0, AttentionMask::SlidingWindow(0)).is_err());
    assert!(q4.sdpa_by_products(&kv, &kv, 1.0, AttentionMask::Causal).is_err(), "3 causal queries after 2 keys");
    let m3 = Array::zeros(&[1, 3, 3, 2], DType::F32).unwrap();
    assert!(q4.sdpa_by_products(&kv, &kv, 1.0, AttentionMask::Array(&m3)).is_err(), "a mask over 3 heads for 4");
}

/// 2-d convolution from the 1-d reference: output row `y` sums, over kernel rows `i`, the 1-d
/// convolution of input row `y*s + i*d - p` (zeros outside the input) with kernel row `i`.
#[allow(clippy::too_many_arguments)]
fn conv2d_ref(x: &[f32], w: &[f32], n: usize, (h, wd): (usize, usize), (cin, cout, groups): (usize, usize, usize), (kh, kw): (usize, usize), s: (usize, usize), p: (usize, usize), d: (usize, usize)) -> (usize, usize, Vec<f64>) {
    let oh = (h + 2 * p.0 - d.0 * (kh - 1) - 1) / s.0 + 1;
    let cg = cin / groups;
    let mut o: Vec<f64> = Vec::new();
    for b in 0..n {
        for y in 0..oh {
            let mut acc: Vec<f64> = Vec::new();
            for i in 0..kh {
                let r = (y * s.0 + i * d.0) as isize - p.0 as isize;
                let row: Vec<f32> = if r < 0 || r >= h as isize { vec![0.0; wd * cin] } else { x[(b * h + r as usize) * wd * cin..(b * h + r as usize + 1) * wd * cin].to_vec() };
                let wi: Vec<f32> = (0..cout).flat_map(|oc| (0..kw).flat_map(move |k| (0..cg).map(move |c| ((oc * kh + i) * kw + k) * cg + c))).map(|j| w[j]).collect();
                let (_, part) = conv_ref(&row, &wi, 1, wd, cin, cout, kw, s.1, p.1, d.1, groups);
                acc = if acc.is_empty() { part } else { acc.iter().zip(&part).map(|(a, b)| a + b).collect() };
            }
            o.extend(acc);
        }
    }
    let ow = o.len() / (n * oh * cout);
    (oh, ow, o)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Strides, zero padding, groups and dilations up to twice the input size (MLX's own padding
    /// corrupts the heap there; `conv2d` pads separately, and dilated ungrouped kernels run as im2col).
    #[test]
    fn conv2d_strided_dilated_grouped(
        (n, h, wd, groups, cg, og) in (1usize..3, 1usize..7, 1usize..7, 1usize..3, 1usize..3, 1usize..3),
        (kh, kw, s, p, d) in (1usize..4, 1usize..4, (1usize..3, 1usize..3), (0usize..9, 0usize..9), (1usize..13, 1usize..13)),
        seed in vals(2 * 6 * 6 * 4 + 4 * 3 * 3 * 2, -1.0, 1.0),
    ) {
        let (cin, cout) = (groups * cg, groups * og);
        prop_assume!(h + 2 * p.0 > d.0 * (kh - 1) && wd + 2 * p.1 > d.1 * (kw - 1));
        let x = &seed[..n * h * wd * cin];
        let w = &seed[n * h * wd * cin..n * h * wd * cin + cout * kh * kw * cg];
        let y = arr(x, &[n, h, wd, cin]).conv2d(&arr(w, &[cout, kh, kw, cg]), s, p, d, groups).unwrap();
        let (oh, ow, want) = conv2d_ref(x, w, n, (h, wd), (cin, cout, groups), (kh, kw), s, p, d);
        prop_assert_eq!(y.shape(), vec![n, oh, ow, cout]);
        close("conv2d", &out(&y), &want, Tol { atol: 1e-5, rtol: 1e-5 })?;
    }
}

/// The matrix-product attention makes its position masks once per shape: a second call over the
/// same shapes (the next layer of a forward) has no node building one, and the same result.
#[test]
fn products_attention_reuses_its_masks() {
    let mk = |n: usize, shape: &[usize], k: u32| arr_as(&(0..n).map(|i| ((i as u32 * 37 + k) % 19) as f32 / 9.0 - 1.0).collect::<Vec<_>>(), shape, DType::F32);
    let (q, kv) = (mk(2 * 3 * 4, &[1, 2, 3, 4], 1), mk(2 * 7 * 4, &[1, 2, 7, 4], 2));
    let builds = |y: &Array| {
        let (_, kinds) = mlx_array::graph_nodes(&[y]).unwrap();
        kinds.iter().filter(|(k, _)| k == "Arange").map(|(_, n)| n).sum::<usize>()
    };
    for (mask, bucket) in [(AttentionMask::Causal, 0), (AttentionMask::Causal, 4), (AttentionMask::None, 4), (AttentionMask::SlidingWindow(2), 4)] {
        let first = q.sdpa_by_products_bucketed(&kv, &kv, 0.5, mask, bucket).unwrap();
        assert!(builds(&first) > 0, "{mask:?}, bucket {bucket}: the first call builds its mask");
        let a = out(&first);
        let second = q.sdpa_by_products_bucketed(&kv, &kv, 0.5, mask, bucket).unwrap();
        assert_eq!(builds(&second), 0, "{mask:?}, bucket {bucket}: the second call reuses it");
        assert_eq!(out(&second), a);
        // the mask is this call's, not another kind's of the same shapes: against the same
        // attention under an explicit mask (3 queries at positions 4..7 of 7 keys)
        let allowed: Vec<bool> = (0..3 * 7)
            .map(|i| {
                let (p, j) = (4 + i / 7, i % 7);
                match mask {
                    AttentionMask::Causal => j <= p,
                    AttentionMask::SlidingWindow(w) => j <= p && j + w > p,
                    _ => true,
                }
            })
            .collect();
        let explicit = Array::from_slice(&allowed, &[3, 7]).unwrap();
        let want = out(&q.sdpa_by_products(&kv, &kv, 0.5, AttentionMask::Array(&explicit)).unwrap());
        let worst = a.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-6, "{mask:?}, bucket {bucket}: {worst} from the explicit mask's result");
    }
    // masks of more than 2^21 elements are made per call, not kept
    let (q, kv) = (mk(8 * 64 * 4, &[1, 8, 64, 4], 3), mk(8 * 4200 * 4, &[1, 8, 4200, 4], 4));
    let first = q.sdpa_by_products(&kv, &kv, 0.5, AttentionMask::Causal).unwrap();
    let a = out(&first);
    let second = q.sdpa_by_products(&kv, &kv, 0.5, AttentionMask::Causal).unwrap();
    assert!(builds(&second) > 0, "a large mask is not kept");
    assert_eq!(out(&second), a);
}
