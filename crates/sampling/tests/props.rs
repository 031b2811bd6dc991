//! Property tests of the processors against naive host references.
mod common;
use common::*;
use proptest::prelude::*;
use sampling::{Sampler, SamplingConfig};

/// Logits on a grid of 1/8 in [-4, 4]: ties are frequent, distinct values stay distinct in f32.
fn logits(v: std::ops::Range<usize>) -> impl Strategy<Value = Vec<f32>> {
    v.prop_flat_map(|n| prop::collection::vec((-32i32..=32).prop_map(|i| i as f32 / 8.0), n))
}

fn batch(v: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Vec<f32>>> {
    v.prop_flat_map(|n| prop::collection::vec(prop::collection::vec((-32i32..=32).prop_map(|i| i as f32 / 8.0), n), 1..4))
}

fn dist(cfg: SamplingConfig, x: &[Vec<f32>], hist: &[&[u32]]) -> Vec<Vec<f32>> {
    rows(&Sampler::new(cfg.with_seed(0)).unwrap().distribution(&arr(x), hist).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Exactly k tokens keep mass; every kept logit >= every dropped one (ties at the k-th
    /// value may go either way).
    #[test]
    fn top_k_keeps_exactly_k((x, k) in batch(2..40).prop_flat_map(|x| { let v = x[0].len(); (Just(x), 1..v) })) {
        let d = dist(SamplingConfig::default().with_top_k(k as u32), &x, &[]);
        for (row, out) in x.iter().zip(&d) {
            let kept: Vec<usize> = (0..row.len()).filter(|&i| out[i] > f32::NEG_INFINITY).collect();
            prop_assert_eq!(kept.len(), k);
            let min_kept = kept.iter().map(|&i| row[i]).fold(f32::INFINITY, f32::min);
            let max_dropped = (0..row.len()).filter(|i| !kept.contains(i)).map(|i| row[i]).fold(f32::NEG_INFINITY, f32::max);
            prop_assert!(min_kept >= max_dropped);
            let mass: f32 = out.iter().map(|v| v.exp()).sum();
            prop_assert!((mass - 1.0).abs() < 1e-5);
        }
    }

    /// The kept set is the smallest most-likely prefix whose mass reaches p, plus ties of its
    /// least likely member; renormalised over it.
    #[test]
    fn top_p_smallest_set(x in batch(2..30), p in 0.05f32..0.99) {
        let d = dist(SamplingConfig::default().with_top_p(p), &x, &[]);
        for (row, out) in x.iter().zip(&d) {
            let lp = log_softmax(row);
            let (want, ambiguous) = naive_top_p(&lp, p as f64, 1e-4);
            prop_assume!(!ambiguous);
            let got: Vec<bool> = out.iter().map(|&v| v > f32::NEG_INFINITY).collect();
            prop_assert_eq!(&got, &want);
            let kept_mass: f64 = lp.iter().zip(&want).filter(|(_, &k)| k).map(|(l, _)| l.exp()).sum();
            prop_assert!(kept_mass >= p as f64 - 1e-6);
            // Renormalised: each kept log-prob = lp - log(kept mass).
            for i in 0..row.len() {
                if want[i] {
                    prop_assert!((out[i] as f64 - (lp[i] - kept_mass.ln())).abs() < 1e-4);
                }
            }
        }
    }

    /// min_p drops exactly the tokens with p < min_p * p_max.
    #[test]
    fn min_p_threshold(x in batch(2..40), m in 0.01f32..1.0) {
        let d = dist(SamplingConfig::default().with_min_p(m), &x, &[]);
        for (row, out) in x.iter().zip(&d) {
            let lp = log_softmax(row);
            let pmax = lp.iter().copied().fold(f64::NEG_INFINITY, f64::max).exp();
            for i in 0..row.len() {
                let pi = lp[i].exp();
                let thr = m as f64 * pmax;
                prop_assume!((pi - thr).abs() > 1e-6 * pmax);
                prop_assert_eq!(out[i] > f32::NEG_INFINITY, pi >= thr, "token {} p {} thr {}", i, pi, thr);
            }
        }
    }

    /// Temperature divides the logits: distribution = log_softmax(x / T).
    #[test]
    fn temperature_scales(x in logits(2..40), t in 0.05f32..4.0) {
        let d = dist(SamplingConfig::default().with_temperature(t), std::slice::from_ref(&x), &[]);
        let scaled: Vec<f32> = x.iter().map(|v| v * (1.0 / t)).collect();
        let want = log_softmax(&scaled);
        for (g, w) in d[0].iter().zip(&want) {
            prop_assert!((*g as f64 - w).abs() < 1e-4, "{} vs {}", g, w);
        }
    }

    /// Temperature 0 = argmax of the (penalised) logits, whatever the truncation settings.
    #[test]
    fn greedy_is_argmax(x in batch(2..60), k in 0u32..5, p in 0.1f32..=1.0, pen in 0.5f32..2.0, seed in any::<u64>()) {
        let v = x[0].len() as u32;
        let hist: Vec<Vec<u32>> = x.iter().enumerate().map(|(r, _)| vec![(seed as u32).wrapping_add(r as u32) % v]).collect();
        let h: Vec<&[u32]> = hist.iter().map(|h| h.as_slice()).collect();
        let cfg = SamplingConfig::greedy().with_top_k(k).with_top_p(p).with_repetition_penalty(pen);
        let mut s = Sampler::new(cfg.clone().with_seed(seed)).unwrap();
        let out = s.sample(&arr(&x), &h).unwrap().to_host().unwrap();
        for (r, row) in x.iter().enumerate() {
            let pen_row = naive_penalties(row, &hist[r], &cfg);
            let max = pen_row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let first = pen_row.iter().position(|&v| v == max).unwrap() as u32;
            prop_assert_eq!(out.tokens[r], first);
            let lp = log_softmax(&pen_row)[first as usize];
            prop_assert!((out.logprobs[r] as f64 - lp).abs() < 1e-4);
        }
    }

    /// Penalties equal the naive reference, and tokens outside the bias and the windows are
    /// bit-for-bit unchanged.
    #[test]
    fn penalties_touch_only_their_tokens(
        x in batch(4..50),
        hist_seed in prop::collection::vec(any::<u32>(), 0..60),
        rep in 0.5f32..2.0, pres in -1.0f32..1.0, freq in -1.0f32..1.0,
        rep_ctx in 0usize..40, pres_ctx in 0usize..30, freq_ctx in 0usize..30,
        bias in prop::collection::btree_map(any::<u32>(), -3.0f32..3.0, 0..4),
    ) {
        let v = x[0].len() as u32;
        // Row r's history: the seed tokens shifted by r (rows differ), mod V.
        let hist: Vec<Vec<u32>> = (0..x.len()).map(|r| hist_seed.iter().map(|t| t.wrapping_add(r as u32) % v).collect()).collect();
        let h: Vec<&[u32]> = hist.iter().map(|h| h.as_slice()).collect();
        let bias = bias.into_iter().map(|(t, b)| (t % v, b)).collect();
        let cfg = SamplingConfig::default()
            .with_repetition_penalty(rep).with_repetition_context_size(rep_ctx)
            .with_presence_penalty(pres).with_presence_context_size(pres_ctx)
            .with_frequency_penalty(freq).with_frequency_context_size(freq_ctx)
            .with_logit_bias(bias);
        let s = Sampler::new(cfg.clone().with_seed(1)).unwrap();
        let got = rows(&s.penalised(&arr(&x), &h).unwrap());
        for r in 0..x.len() {
            let want = naive_penalties(&x[r], &hist[r], &cfg);
            let win = |n: usize| hist[r][hist[r].len().saturating_sub(n)..].to_vec();
            let mut touched: std::collections::BTreeSet<u32> = cfg.logit_bias.keys().copied().collect();
            touched.extend(win(rep_ctx));
            touched.extend(win(pres_ctx));
            touched.extend(win(freq_ctx));
            for i in 0..x[r].len() {
                prop_assert!((got[r][i] - want[i]).abs() <= 1e-5 * want[i].abs().max(1.0), "row {} token {}: {} vs {}", r, i, got[r][i], want[i]);
                if !touched.contains(&(i as u32)) {
                    prop_assert_eq!(got[r][i].to_bits(), x[r][i].to_bits());
                }
            }
        }
    }
}
