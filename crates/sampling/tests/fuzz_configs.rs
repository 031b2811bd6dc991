//! Sampling settings from untrusted requests: any values (NaN, infinities, negatives, huge)
//! and any JSON give a typed error or a config that validates, never a panic (10,000 cases);
//! configs that validate build a sampler and sample from finite logits (500 cases).
mod common;
use proptest::prelude::*;
use sampling::{Sampler, SamplingConfig, SamplingOverrides};

fn f() -> impl Strategy<Value = f32> {
    prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY), Just(0.0f32), Just(-0.0), Just(1.0), Just(-1.0), Just(1e-30), Just(f32::MAX), -10.0f32..10.0, any::<f32>()]
}

fn u() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1), Just(2), Just(usize::MAX), 0usize..1000]
}

fn cfg() -> impl Strategy<Value = SamplingConfig> {
    ((f(), any::<u32>(), f(), f(), f()), (u(), f(), u(), f(), u()), (prop::collection::btree_map(any::<u32>(), f(), 0..4), u(), u(), u(), any::<Option<u64>>())).prop_map(
        |((temperature, top_k, top_p, min_p, repetition_penalty), (repetition_context_size, presence_penalty, presence_context_size, frequency_penalty, frequency_context_size), (logit_bias, max_consecutive_tokens, max_ngram_repeats, ngram_size, seed))| SamplingConfig {
            temperature, top_k, top_p, min_p, repetition_penalty, repetition_context_size, presence_penalty, presence_context_size,
            frequency_penalty, frequency_context_size, logit_bias, max_consecutive_tokens, max_ngram_repeats, ngram_size, seed,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_settings_validate_or_fail_typed(c in cfg()) {
        match c.validate() {
            Ok(()) => {
                prop_assert!(c.temperature.is_finite() && c.temperature >= 0.0);
                prop_assert!(c.top_p > 0.0 && c.top_p <= 1.0);
                prop_assert!(!c.logit_bias.values().any(|v| v.is_nan() || *v == f32::INFINITY));
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        let _ = Sampler::new(c);
    }

    #[test]
    fn any_json_request_resolves_or_fails_typed(s in "\\PC{0,80}", t in f(), p in f()) {
        let _ = serde_json::from_str::<SamplingOverrides>(&s);
        let req = format!(r#"{{"temperature": {}, "top_p": {}}}"#, serde_json::json!(t), serde_json::json!(p));
        if let Ok(o) = serde_json::from_str::<SamplingOverrides>(&req) {
            let _ = SamplingConfig::resolve(&o, &SamplingOverrides::default());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn valid_settings_sample(c in cfg(), logits in prop::collection::vec(-20.0f32..20.0, 2..40), hist in prop::collection::vec(0u32..40, 0..20)) {
        if c.validate().is_ok() {
            let v = logits.len();
            let mut s = Sampler::new(c).unwrap();
            let x = mlx_array::Array::from_slice(&logits, &[1, v]).unwrap();
            let hist: Vec<u32> = hist.into_iter().filter(|&t| (t as usize) < v).collect();
            match s.sample(&x, &[&hist]) {
                Ok(out) => {
                    let id = out.tokens.to_vec::<u32>().unwrap()[0] as usize;
                    prop_assert!(id < v);
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
