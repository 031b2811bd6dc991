//! Exactness at temperature > 0: speculative sampling's tokens are distributed as plain
//! sampling's, checked with chi-square tests (p = 0.001 critical values) against the exact
//! distributions, for drafts that disagree often.
mod common;
use common::*;
use mlx_array::random::Key;
use mlx_array::Array;
use mlx_models::{KvCacheMode, Logits, Model, Speculator};
use mlx_speculative::verify::verify_sampled;
use mlx_speculative::{DraftModel, SpeculativeDecoder};
use sampling::{Sampler, SamplingConfig};
use std::collections::BTreeMap;

/// Upper 0.001 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn critical(df: usize) -> f64 {
    let d = df as f64;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + 3.0902 * h.sqrt()).powi(3)
}

/// Pearson's statistic of `counts` against probabilities `probs` (bins with an expected count
/// below 5 pooled into one), and its degrees of freedom.
fn chi_square(counts: &BTreeMap<Vec<u32>, usize>, probs: &BTreeMap<Vec<u32>, f64>) -> (f64, usize) {
    let n: usize = counts.values().sum();
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pool_obs, mut pool_exp) = (0.0, 0.0);
    for (k, &p) in probs {
        let e = p * n as f64;
        let o = *counts.get(k).unwrap_or(&0) as f64;
        if e < 5.0 {
            pool_obs += o;
            pool_exp += e;
        } else {
            stat += (o - e) * (o - e) / e;
            bins += 1;
        }
    }
    let outside: usize = counts
        .iter()
        .filter(|(k, _)| !probs.contains_key(*k))
        .map(|(_, &c)| c)
        .sum();
    pool_obs += outside as f64;
    if pool_exp > 0.0 {
        stat += (pool_obs - pool_exp) * (pool_obs - pool_exp) / pool_exp;
        bins += 1;
    } else if outside > 0 {
        return (f64::INFINITY, bins.max(2) - 1); // tokens outside the distribution's support
    }
    (stat, bins - 1)
}

fn probs(lp: &Array) -> Vec<f64> {
    lp.reshape(&[-1])
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&x| (x as f64).exp())
        .collect()
}

/// The verifier alone, on fixed distributions over 6 tokens: the first token is distributed as
/// `p_0`, the second (when the first draft was accepted) as `p_1`.
#[test]
fn rejection_sampling_matches_the_target_distribution() {
    let p = [
        [0.40, 0.25, 0.15, 0.10, 0.10, 0.0],
        [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
        [0.3, 0.3, 0.1, 0.1, 0.1, 0.1f32],
    ];
    let q = [
        [0.05, 0.10, 0.05, 0.30, 0.20, 0.30],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10f32],
    ];
    let ln = |rows: &[[f32; 6]]| {
        Array::from_slice(
            &rows.iter().flatten().map(|x| x.ln()).collect::<Vec<f32>>(),
            &[rows.len(), 6],
        )
        .unwrap()
    };
    let (target, draft) = (ln(&p), ln(&q));
    let mut key = Key::new(3).unwrap();
    let mut rng = Rng(11);
    let draw = |rng: &mut Rng, row: &[f32; 6]| -> u32 {
        let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        for (i, &x) in row.iter().enumerate() {
            acc += x as f64;
            if u < acc {
                return i as u32;
            }
        }
        5
    };
    let (mut first, mut second) = (BTreeMap::new(), BTreeMap::new());
    let n = 6000;
    let mut rejected = 0;
    for _ in 0..n {
        let drafts = [draw(&mut rng, &q[0]), draw(&mut rng, &q[1])];
        let v = verify_sampled(&target, &draft, &drafts, &mut key).unwrap();
        assert_eq!(v.tokens.len(), v.accepted + 1);
        assert_eq!(
            v.tokens[..v.accepted]
                .iter()
                .map(|t| t.id)
                .collect::<Vec<_>>(),
            drafts[..v.accepted]
        );
        rejected += usize::from(v.accepted == 0);
        *first.entry(vec![v.tokens[0].id]).or_insert(0) += 1;
        if v.accepted >= 1 {
            *second.entry(vec![v.tokens[1].id]).or_insert(0) += 1;
        }
    }
    let dist = |row: &[f32; 6]| {
        row.iter()
            .enumerate()
            .filter(|(_, &x)| x > 0.0)
            .map(|(i, &x)| (vec![i as u32], x as f64))
            .collect::<BTreeMap<_, _>>()
    };
    let (s1, df1) = chi_square(&first, &dist(&p[0]));
    let (s2, df2) = chi_square(&second, &dist(&p[1]));
    eprintln!("first: chi2 {s1:.1} df {df1} (critical {:.1}); second: chi2 {s2:.1} df {df2}; rejected first draft {rejected}/{n}", critical(df1));
    assert!(rejected > n / 3, "the draft must disagree often");
    assert!(s1 < critical(df1) && s2 < critical(df2));
    // the test has power: the draft distribution itself is rejected
    let (sq, dfq) = chi_square(&first, &dist(&q[0]));
    assert!(sq > critical(dfq), "q_0 should be rejected, chi2 {sq}");
}

/// End to end with models, for two pairs: a random Qwen3 drafting for another (they almost
/// never agree: the residual draws dominate) and an 8-bit quantization drafting for its original
/// at temperature 1.5 (they mostly agree: acceptance at every position). Top-k 6, repetition and
/// presence penalties. The first two tokens of speculative cycles are distributed as plain
/// sampling's joint `p(t0) p(t1 | t0)`.
#[test]
fn speculative_sampling_matches_plain_sampling_with_models() {
    for (t, d, temp, seed, agrees) in [
        ("qwen3", "qwen3_untied", 0.8, 9, false),
        ("qwen3_untied", "qwen3_untied_q8g32", 1.5, 4, true),
    ] {
        check_pair(t, d, temp, seed, agrees);
    }
}

fn check_pair(t: &str, d: &str, temperature: f32, seed: u64, agrees: bool) {
    let target = load(t, KvCacheMode::Flat);
    let draft = load(d, KvCacheMode::Flat);
    let history: Vec<u32> = vec![17, 230, 5, 99, 230, 17, 410, 88, 3, 230];
    let cfg = SamplingConfig::default()
        .with_temperature(temperature)
        .with_top_k(6)
        .with_repetition_penalty(1.5)
        .with_presence_penalty(0.5)
        .with_seed(seed);
    let sampler = Sampler::new(cfg.clone()).unwrap();
    // the exact joint distribution from the target, step by step
    let dist_after = |m: &Model, h: &[u32]| -> Vec<f64> {
        let mut c = m.new_cache();
        let l = m
            .forward(
                &Array::from_slice(h, &[1, h.len()]).unwrap(),
                &mut c,
                Logits::Last,
                false,
            )
            .unwrap()
            .logits
            .unwrap()
            .reshape(&[1, -1])
            .unwrap();
        probs(&sampler.distribution(&l, &[h]).unwrap())
    };
    let p0 = dist_after(&target, &history);
    let mut joint = BTreeMap::new();
    for (t0, &a) in p0.iter().enumerate().filter(|(_, &a)| a > 0.0) {
        let mut h = history.clone();
        h.push(t0 as u32);
        for (t1, &b) in dist_after(&target, &h)
            .iter()
            .enumerate()
            .filter(|(_, &b)| b > 0.0)
        {
            joint.insert(vec![t0 as u32, t1 as u32], a * b);
        }
    }
    let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(draft.clone())), Some(3));
    spec.start();
    let mut cache = target.new_cache();
    let before = &history[..history.len() - 1];
    target
        .forward(
            &Array::from_slice(before, &[1, before.len()]).unwrap(),
            &mut cache,
            Logits::None,
            false,
        )
        .unwrap();
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let n = 600;
    let mut counts = BTreeMap::new();
    let clock = std::time::Instant::now();
    for _ in 0..n {
        // each sample starts from the same history: the next cycle rolls the cache back
        let mut toks: Vec<u32> = spec
            .cycle(&target, &mut cache, &history, &mut sampler, 8)
            .unwrap()
            .iter()
            .map(|t| t.id)
            .collect();
        if toks.len() == 1 {
            let h: Vec<u32> = history.iter().chain(&toks).copied().collect();
            toks.push(
                spec.cycle(&target, &mut cache, &h, &mut sampler, 8)
                    .unwrap()[0]
                    .id,
            );
        }
        *counts.entry(toks[..2].to_vec()).or_insert(0) += 1;
    }
    let st = spec.stats();
    let (s, df) = chi_square(&counts, &joint);
    eprintln!("{t} <- {d}: joint of 2 tokens chi2 {s:.1}, df {df}, critical {:.1}; {n} samples in {:.1} s; {st:?}", critical(df), clock.elapsed().as_secs_f64());
    if agrees {
        assert!(
            st.acceptance_by_position.iter().all(|&a| a > 0.5),
            "the quantized draft mostly agrees: {st:?}"
        );
    } else {
        assert!(
            st.acceptance_by_position[0] < 0.5,
            "the draft must disagree often: {st:?}"
        );
    }
    assert!(
        s < critical(df),
        "{t} <- {d}: chi2 {s} >= {} with {df} degrees of freedom",
        critical(df)
    );
    // power: the draft's own first-token distribution is rejected
    let q0 = dist_after(&draft, &history);
    let first: BTreeMap<Vec<u32>, usize> = counts.iter().fold(BTreeMap::new(), |mut m, (k, &c)| {
        *m.entry(vec![k[0]]).or_insert(0) += c;
        m
    });
    let qd: BTreeMap<Vec<u32>, f64> = q0
        .iter()
        .enumerate()
        .filter(|(_, &x)| x > 0.0)
        .map(|(i, &x)| (vec![i as u32], x))
        .collect();
    let (sq, dfq) = chi_square(&first, &qd);
    eprintln!("  against the draft's distribution: chi2 {sq:.1}, df {dfq}");
    if !agrees {
        assert!(
            sq > critical(dfq),
            "the test has no power: the draft's distribution passes too"
        );
    }
}
