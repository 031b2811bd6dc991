//! Seeded statistical tests: sampled frequencies match the processed distribution, and a seed
//! fixes the tokens.
mod common;
use common::*;
use sampling::{Sampler, SamplingConfig};

/// Upper critical value of chi-square with `df` degrees of freedom at significance 0.001
/// (Wilson–Hilferty approximation, z = 3.0902; within 1% of the exact quantile for df >= 3).
fn chi2_crit_001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.0902;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn frequencies_match_processed_distribution() {
    // 12 tokens; temperature, top-k, top-p and a presence penalty all shape the distribution.
    let base: Vec<f32> = vec![2.0, 1.5, 1.4, 1.0, 0.8, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0];
    let cfg = SamplingConfig::default()
        .with_temperature(0.8)
        .with_top_k(9)
        .with_top_p(0.97)
        .with_presence_penalty(0.7)
        .with_seed(20240917);
    const B: usize = 2000;
    const STEPS: usize = 10;
    let x = vec![base.clone(); B];
    let hist_row: Vec<u32> = vec![0, 0, 3];
    let hist: Vec<&[u32]> = vec![hist_row.as_slice(); B];
    let mut s = Sampler::new(cfg).unwrap();
    let p: Vec<f64> = rows(&s.distribution(&arr(&x[..1]), &hist[..1]).unwrap())[0].iter().map(|&l| (l as f64).exp()).collect();
    assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-5);
    let support = p.iter().filter(|&&q| q > 0.0).count();
    assert!((4..=9).contains(&support), "filters should leave a non-trivial support, got {support}");

    let logits = arr(&x);
    let mut counts = vec![0usize; base.len()];
    for _ in 0..STEPS {
        for t in s.sample(&logits, &hist).unwrap().to_host().unwrap().tokens {
            counts[t as usize] += 1;
        }
    }
    let n = (B * STEPS) as f64;
    // Filtered-out tokens are never drawn.
    for (i, (&c, &q)) in counts.iter().zip(&p).enumerate() {
        if q == 0.0 {
            assert_eq!(c, 0, "token {i} has no mass but was drawn {c} times");
        }
    }
    // Pearson chi-square over the support (every expected count is >= 5 here).
    let mut chi2 = 0.0;
    for (&c, &q) in counts.iter().zip(&p).filter(|(_, &q)| q > 0.0) {
        let e = n * q;
        assert!(e >= 5.0, "expected count {e} too small for chi-square");
        chi2 += (c as f64 - e).powi(2) / e;
    }
    let crit = chi2_crit_001(support - 1);
    assert!(chi2 < crit, "chi2 = {chi2:.2} >= {crit:.2} (df {}), counts {counts:?}, p {p:?}", support - 1);
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let x = arr(&(0..4).map(|r| (0..64).map(|i| ((i * 7 + r * 3) % 13) as f32 * 0.2).collect()).collect::<Vec<_>>());
    let run = |seed: u64| -> Vec<u32> {
        let mut s = Sampler::new(SamplingConfig::default().with_top_p(0.9).with_seed(seed)).unwrap();
        let mut out = Vec::new();
        for _ in 0..40 {
            out.extend(s.sample(&x, &[]).unwrap().to_host().unwrap().tokens);
        }
        out
    };
    let a = run(42);
    assert_eq!(a, run(42));
    assert_ne!(a, run(43));
    // Successive steps use fresh keys: not all steps repeat the first one.
    assert!(a.chunks(4).any(|c| c != &a[..4]));
}
