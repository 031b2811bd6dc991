//! Config validation and merging, outputs (log-probs, alternatives), errors, stop guards.
mod common;
use common::*;
use sampling::{SampleOptions, Sampler, SamplingConfig, SamplingError, SamplingOverrides, StopGuard, StopReason};

#[test]
fn defaults_are_the_seed_defaults() {
    let c = SamplingConfig::default();
    assert_eq!((c.temperature, c.top_k, c.top_p, c.min_p, c.repetition_penalty), (1.0, 0, 1.0, 0.0, 1.0));
    assert_eq!((c.repetition_context_size, c.presence_context_size, c.frequency_context_size), (256, 20, 20));
    assert_eq!((c.presence_penalty, c.frequency_penalty), (0.0, 0.0));
    assert_eq!((c.max_consecutive_tokens, c.max_ngram_repeats, c.ngram_size), (0, 0, 0));
    c.validate().unwrap();
}

#[test]
fn invalid_settings_are_typed_errors() {
    let d = SamplingConfig::default;
    assert!(matches!(d().with_temperature(-0.1).validate(), Err(SamplingError::Temperature(_))));
    assert!(matches!(d().with_temperature(f32::NAN).validate(), Err(SamplingError::Temperature(_))));
    assert!(matches!(d().with_temperature(f32::INFINITY).validate(), Err(SamplingError::Temperature(_))));
    for p in [0.0, -0.5, 1.01, f32::NAN] {
        assert!(matches!(d().with_top_p(p).validate(), Err(SamplingError::TopP(_))), "{p}");
    }
    for m in [-0.01, 1.5, f32::NAN] {
        assert!(matches!(d().with_min_p(m).validate(), Err(SamplingError::MinP(_))), "{m}");
    }
    for r in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(d().with_repetition_penalty(r).validate(), Err(SamplingError::RepetitionPenalty(_))), "{r}");
    }
    assert!(matches!(d().with_presence_penalty(f32::NAN).validate(), Err(SamplingError::NotFinite { field: "presence_penalty", .. })));
    assert!(matches!(d().with_frequency_penalty(f32::NEG_INFINITY).validate(), Err(SamplingError::NotFinite { field: "frequency_penalty", .. })));
    assert!(matches!(d().with_logit_bias([(3, f32::NAN)].into()).validate(), Err(SamplingError::LogitBias { token: 3, .. })));
    d().with_logit_bias([(3, f32::NEG_INFINITY)].into()).validate().unwrap();
    assert!(matches!(d().with_ngram_size(1).validate(), Err(SamplingError::StopGuard(_))));
    assert!(matches!(d().with_max_consecutive_tokens(1).validate(), Err(SamplingError::StopGuard(_))));
    // Edges that are valid: top_p 1, min_p 0 and 1, temperature 0, top_k 0 (disabled).
    d().with_top_p(1.0).with_min_p(1.0).with_temperature(0.0).with_top_k(0).validate().unwrap();
    assert!(Sampler::new(d().with_top_p(2.0)).is_err());
    // resolve validates the merged result.
    let bad = SamplingOverrides { top_p: Some(0.0), ..Default::default() };
    assert!(SamplingConfig::resolve(&bad, &SamplingOverrides::default()).is_err());
}

#[test]
fn request_values_override_model_defaults() {
    let model = SamplingOverrides::from_generation_config(&serde_json::json!({
        "do_sample": true, "temperature": 1.0, "top_k": 64, "top_p": 0.95, "bos_token_id": 2
    }));
    assert_eq!((model.temperature, model.top_k, model.top_p, model.min_p), (Some(1.0), Some(64), Some(0.95), None));
    let request = SamplingOverrides { top_k: Some(20), presence_penalty: Some(1.5), ..Default::default() };
    let c = SamplingConfig::resolve(&request, &model).unwrap();
    assert_eq!((c.temperature, c.top_k, c.top_p, c.presence_penalty, c.presence_context_size), (1.0, 20, 0.95, 1.5, 20));
    // do_sample false = greedy.
    let greedy = SamplingOverrides::from_generation_config(&serde_json::json!({"do_sample": false, "temperature": 0.6}));
    assert!(SamplingConfig::resolve(&SamplingOverrides::default(), &greedy).unwrap().is_greedy());
}

#[test]
fn serde_round_trip_and_partial_json() {
    let c = SamplingConfig::default().with_top_k(40).with_logit_bias([(7, -2.5)].into()).with_seed(9);
    let s = serde_json::to_string(&c).unwrap();
    assert_eq!(serde_json::from_str::<SamplingConfig>(&s).unwrap(), c);
    let partial: SamplingConfig = serde_json::from_str(r#"{"temperature": 0.5, "logit_bias": {"3": 1.0}}"#).unwrap();
    assert_eq!((partial.temperature, partial.top_p, partial.logit_bias[&3]), (0.5, 1.0, 1.0));
    assert!(serde_json::from_str::<SamplingConfig>(r#"{"temprature": 0.5}"#).is_err());
    let o: SamplingOverrides = serde_json::from_str(r#"{"top_p": 0.9}"#).unwrap();
    assert_eq!(serde_json::to_string(&o).unwrap(), r#"{"top_p":0.9}"#);
}

#[test]
fn logprobs_alternatives_and_raw() {
    let x = vec![vec![3.0f32, 1.0, 0.0, -1.0, 2.0], vec![0.0, 0.0, 5.0, 1.0, 0.5]];
    let cfg = SamplingConfig::default().with_temperature(0.5).with_top_k(3).with_repetition_penalty(2.0).with_seed(3);
    let hist: [&[u32]; 2] = [&[0], &[]];
    let mut s = Sampler::new(cfg.clone()).unwrap();
    let d = rows(&s.distribution(&arr(&x), &hist).unwrap());
    let out = s.sample_with(&arr(&x), &hist, &SampleOptions { top_logprobs: 4, raw_logprobs: true }).unwrap().to_host().unwrap();
    for r in 0..2 {
        let t = out.tokens[r] as usize;
        assert!((out.logprobs[r] - d[r][t]).abs() < 1e-6);
        let raw = log_softmax(&x[r])[t];
        assert!((out.raw_logprobs.as_ref().unwrap()[r] as f64 - raw).abs() < 1e-5);
        let top = &out.top.as_ref().unwrap()[r];
        assert_eq!(top.len(), 4);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "sorted: {top:?}");
        let mut want: Vec<(usize, f32)> = d[r].iter().copied().enumerate().collect();
        want.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
        for (i, &(id, lp)) in top.iter().enumerate().take(3) {
            assert_eq!((id as usize, lp), want[i]);
        }
        assert_eq!(top[3].1, f32::NEG_INFINITY); // only top_k = 3 tokens have mass
    }
    // Row 0's history penalises token 0 (3.0 -> 1.5): token 4 (2.0) leads now.
    let mut g = Sampler::new(cfg.with_temperature(0.0)).unwrap();
    assert_eq!(g.sample(&arr(&x), &hist).unwrap().to_host().unwrap().tokens, vec![4, 2]);
}

#[test]
fn banned_tokens_and_bf16_logits() {
    let x = arr(&[vec![5.0f32, 4.0, 0.0, 0.0]]).astype(mlx_array::DType::BF16).unwrap();
    let cfg = SamplingConfig::default().with_logit_bias([(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY)].into()).with_seed(5);
    let mut s = Sampler::new(cfg).unwrap();
    for _ in 0..20 {
        let t = s.sample(&x, &[]).unwrap().to_host().unwrap().tokens[0];
        assert!(t >= 2, "banned token {t} drawn");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut s = Sampler::new(SamplingConfig::default().with_repetition_penalty(1.2).with_seed(0)).unwrap();
    let x = arr(&[vec![0.0f32; 8]]);
    assert!(matches!(s.sample(&x, &[&[9]]), Err(SamplingError::TokenOutOfRange { token: 9, vocab: 8 })));
    assert!(matches!(s.sample(&x, &[&[1], &[2]]), Err(SamplingError::Shape(_))));
    let flat = mlx_array::Array::from_slice(&[0.0f32; 8], &[8]).unwrap();
    assert!(matches!(s.sample(&flat, &[]), Err(SamplingError::Shape(_))));
    let mut b = Sampler::new(SamplingConfig::default().with_logit_bias([(100, 1.0)].into()).with_seed(0)).unwrap();
    assert!(matches!(b.sample(&x, &[]), Err(SamplingError::TokenOutOfRange { token: 100, .. })));
}

#[test]
fn consecutive_guard() {
    let cfg = SamplingConfig::default().with_max_consecutive_tokens(3);
    let mut g = StopGuard::new(&cfg).unwrap();
    assert!(g.is_enabled());
    for t in [5, 5, 6, 6] {
        assert_eq!(g.push(t), None);
    }
    let r = g.push(6).unwrap();
    assert_eq!(r, StopReason::ConsecutiveTokens { token: 6, count: 3 });
    assert_eq!(r.finish_reason(), "repetition");
    g.reset();
    assert_eq!(g.push(6), None);
}

#[test]
fn ngram_guard_checks_every_size_from_two() {
    let mut g = StopGuard::with_limits(0, 3, 4).unwrap();
    // "1 2 3" three times: size 3 fires on the 9th token, not before.
    let seq = [1, 2, 3, 1, 2, 3, 1, 2];
    for &t in &seq {
        assert_eq!(g.push(t), None);
    }
    assert_eq!(g.push(3), Some(StopReason::NgramRepeat { size: 3, repeats: 3 }));
    // Size 2, and size 4 = ngram_size (the upper end is included).
    let mut g = StopGuard::with_limits(0, 2, 4).unwrap();
    assert_eq!([7, 8, 7].map(|t| g.push(t)), [None, None, None]);
    assert_eq!(g.push(8), Some(StopReason::NgramRepeat { size: 2, repeats: 2 }));
    let mut g = StopGuard::with_limits(0, 2, 4).unwrap();
    let four = [1, 2, 3, 4, 1, 2, 3];
    assert!(four.iter().all(|&t| g.push(t).is_none()));
    assert_eq!(g.push(4), Some(StopReason::NgramRepeat { size: 4, repeats: 2 }));
    // Size 5 > ngram_size: never fires.
    let mut g = StopGuard::with_limits(0, 2, 4).unwrap();
    assert!([1, 2, 3, 4, 5, 1, 2, 3, 4, 5].iter().all(|&t| g.push(t).is_none()));
    // Disabled by default.
    let mut g = StopGuard::new(&SamplingConfig::default()).unwrap();
    assert!(!g.is_enabled());
    assert!((0..100).all(|_| g.push(1).is_none()));
    assert!(StopGuard::with_limits(0, 1, 4).is_err());
}
