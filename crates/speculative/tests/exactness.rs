//! Exactness at temperature > 0: speculative sampling's tokens are distributed as plain
//! sampling's, checked with chi-square tests (p = 0.001 critical values) against the exact
//! distributions, for drafts that disagree often.
mod common;
use common::*;
use mlx_array::random::Key;
use mlx_array::Array;
use mlx_models::KvCacheMode;
use mlx_speculative::verify::verify_sampled;
use mlx_speculative::{DraftModel, SpeculativeDecoder};
use sampling::{Sampler, SamplingConfig};
use std::collections::BTreeMap;

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
    let q0 = dist_after(&draft, &Sampler::new(cfg.clone()).unwrap(), &history);
    let spec = SpeculativeDecoder::new(Box::new(DraftModel::new(draft)), Some(3));
    check_speculative_sampling(
        &format!("{t} <- {d}"),
        &target,
        spec,
        &history,
        &cfg,
        600,
        &q0,
        agrees,
    );
}
