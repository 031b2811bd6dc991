//! Gemma 4 assistant drafts (`gemma4_assistant`) against transformers 5.17's
//! `Gemma4AssistantForCausalLM` driven as its `SinglePositionMultiTokenCandidateGenerator` does
//! (`scripts/make_gemma4_assistant_fixture.py`: a tiny random assistant for the tiny Gemma 4
//! target): four chained draft steps' logits within 1e-4 relative (f32) and the same draft
//! tokens, for a context inside the sliding window and one past it (there the reference cuts the
//! sliding K/V to the target's last `sliding_window` positions, which is what our cache holds;
//! transformers' bidirectional mask lets the query see one more); then assistant drafting in
//! speculative decoding, token for token equal to plain greedy decoding with flat and paged
//! target caches, and a chi-square check of speculative sampling.
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::families::gemma4::Gemma4Assistant;
use mlx_models::{generate, GenerateConfig, KvCacheMode, LoadOptions};
use mlx_speculative::{load_drafter, load_drafter_for, AssistantDrafter, SpeculativeDecoder};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4_assistant")
}

fn assistant() -> Gemma4Assistant {
    Gemma4Assistant::load(&dir().join("assistant"), None).unwrap()
}

fn reference() -> std::collections::HashMap<String, Array> {
    mlx_array::io::load_safetensors(dir().join("reference.safetensors"), None)
        .unwrap()
        .into_iter()
        .collect()
}

/// max |a - b| / max |b|
fn rel(a: &Array, b: &Array) -> f32 {
    let (a, b) = (
        a.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap(),
        b.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    d / b.iter().map(|y| y.abs()).fold(0f32, f32::max)
}

fn ids(a: &Array) -> Vec<u32> {
    a.to_vec::<i32>()
        .unwrap()
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

#[test]
fn assistant_logits_match_transformers() {
    let r = reference();
    let target = load("gemma4_text", KvCacheMode::Flat);
    // "": 13-token context; "long_window_": 27 tokens (past the 16-position sliding window),
    // the sliding layer's K/V being the target's last 16 positions
    for name in ["", "long_window_"] {
        let history = ids(&r[&format!("{name}tokens")]);
        let want_tokens = ids(&r[&format!("{name}draft_tokens")]);
        let mut d = AssistantDrafter::new(target.clone(), assistant()).unwrap();
        let (tokens, logits) = d.draft_logits(&history, want_tokens.len()).unwrap();
        let logits = logits.unwrap();
        let e = rel(&logits, &r[&format!("{name}draft_logits")]);
        eprintln!("gemma4_assistant {name}draft logits: rel {e:.2e}, drafts {tokens:?}");
        assert!(e < 1e-4, "{name}: draft logits rel {e}");
        assert_eq!(tokens, want_tokens, "{name}");
        if name == "long_window_" {
            // transformers' own mask sees one sliding position more: a different network
            let e = rel(&logits, &r["long_draft_logits"]);
            eprintln!("  against transformers' window + 1 mask: rel {e:.2e}");
            assert!(e > 1e-3, "the long context must tell the two windows apart");
        }
    }
}

/// The drafter's own target cache, carried from cycle to cycle (extended, or rolled back for a
/// history that leaves it), drafts what a fresh drafter computes from the whole history.
#[test]
fn assistant_incremental_drafts_equal_fresh_ones() {
    let target = load("gemma4_text", KvCacheMode::Flat);
    let mut rng = Rng(41);
    let mut kept = AssistantDrafter::new(target.clone(), assistant()).unwrap();
    let mut history: Vec<u32> = (0..6).map(|_| 3 + rng.below(1000) as u32).collect();
    for step in 0..8 {
        let (got, gl) = kept.draft_logits(&history, 3).unwrap();
        let mut fresh = AssistantDrafter::new(target.clone(), assistant()).unwrap();
        let (want, wl) = fresh.draft_logits(&history, 3).unwrap();
        assert_eq!(got, want, "step {step}");
        assert!(rel(&gl.unwrap(), &wl.unwrap()) < 1e-5, "step {step}");
        // grow past the sliding window (16), and once go back to an earlier prefix
        if step == 4 {
            history.truncate(history.len() - 5);
        }
        let grow = 1 + rng.below(4);
        history.extend((0..grow).map(|_| 3 + rng.below(1000) as u32));
    }
}

#[test]
fn assistant_drafting_equals_plain_greedy() {
    let mut rng = Rng(43);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let target = load("gemma4_text", kv.clone());
        let prompt = gapped_prompt(&target, &mut rng, 12, 20);
        let want = plain_greedy(&target, &prompt, 20);
        for depth in [1, 3, 8] {
            let mut spec = SpeculativeDecoder::new(
                Box::new(AssistantDrafter::new(target.clone(), assistant()).unwrap()),
                Some(depth),
            );
            let mut cache = target.new_cache();
            let cfg = GenerateConfig {
                max_new_tokens: 20,
                sampling: sampling::SamplingConfig::greedy(),
                stop_tokens: Some(vec![]),
                ..Default::default()
            };
            let mut gen = generate(&target, &mut cache, &prompt, cfg)
                .unwrap()
                .with_speculator(&mut spec);
            let got: Vec<u32> = (&mut gen).map(|t| t.unwrap().id).collect();
            let st = gen.performance().speculative.unwrap();
            drop(gen);
            assert_eq!(got, want, "{kv:?} depth {depth}");
            assert!(st.cycles > 0, "{kv:?} depth {depth}: no speculative cycles");
            eprintln!("gemma4_assistant {kv:?} depth {depth}: {st:?}");
        }
    }
}

#[test]
fn assistant_loads_from_its_config_and_checks_its_target() {
    let a = dir().join("assistant");
    let opts = LoadOptions::default();
    let target = load("gemma4_text", KvCacheMode::Flat);
    let d = load_drafter_for(&a, &opts, &target).unwrap();
    assert_eq!(d.default_depth(), AssistantDrafter::DEFAULT_DEPTH);
    assert_eq!(d.max_depth(), Some(AssistantDrafter::MAX_DEPTH));
    assert_eq!(d.vocab_size(), 1024);
    // depth clamped to [1, 8]
    for (asked, got) in [(Some(0), 1), (Some(20), 8), (None, 3), (Some(5), 5)] {
        let s = SpeculativeDecoder::new(load_drafter_for(&a, &opts, &target).unwrap(), asked);
        assert_eq!(s.depth(), mlx_speculative::Depth::Fixed(got), "{asked:?}");
    }
    let e = load_drafter(&a, &opts).err().unwrap().to_string();
    assert!(e.contains("load_drafter_for"), "{e}");
    // a target of another family, or of another width, is refused
    let e = load_drafter_for(&a, &opts, &load("qwen3", KvCacheMode::Flat))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("needs a Gemma 4 target"), "{e}");
}

/// At temperature > 0 the drafts come with their draft distributions (`[k, V]`, normalised), the
/// verifier takes them, and a fixed seed gives the same tokens twice.
#[test]
fn assistant_sampling_runs_and_is_reproducible() {
    use mlx_speculative::Drafter;
    let target = load("gemma4_text", KvCacheMode::Flat);
    let sampling = sampling::SamplingConfig::default()
        .with_temperature(0.9)
        .with_top_k(20)
        .with_repetition_penalty(1.2)
        .with_seed(5);
    let mut d = AssistantDrafter::new(target.clone(), assistant()).unwrap();
    let draft = d.propose(&[2, 14, 15, 92, 65], 3, &sampling).unwrap();
    assert_eq!(draft.tokens.len(), 3);
    let lp = draft.logprobs.unwrap();
    assert_eq!(lp.dims(), &[3, 1024]);
    for row in 0..3 {
        let p: f32 = lp
            .slice_axis(0, row, row + 1)
            .unwrap()
            .exp()
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()[0];
        assert!((p - 1.0).abs() < 1e-4, "row {row} sums to {p}");
    }
    let run = || {
        let mut spec = SpeculativeDecoder::new(
            Box::new(AssistantDrafter::new(target.clone(), assistant()).unwrap()),
            Some(3),
        );
        let mut cache = target.new_cache();
        let cfg = GenerateConfig {
            max_new_tokens: 20,
            sampling: sampling.clone(),
            stop_tokens: Some(vec![]),
            ..Default::default()
        };
        let mut gen = generate(&target, &mut cache, &[2, 14, 15, 92, 65], cfg)
            .unwrap()
            .with_speculator(&mut spec);
        let toks: Vec<u32> = (&mut gen).map(|t| t.unwrap().id).collect();
        let st = gen.performance().speculative.unwrap();
        (toks, st.cycles)
    };
    let (a, cycles) = run();
    assert_eq!(a.len(), 20);
    assert!(cycles > 0);
    assert_eq!(run().0, a, "same seed, same tokens");
}

/// Upper 0.001 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn critical(df: usize) -> f64 {
    let d = df as f64;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + 3.0902 * h.sqrt()).powi(3)
}

/// Pearson's statistic of `counts` against `probs` (bins expecting fewer than 5 pooled, tokens
/// outside the support in the pool), and its degrees of freedom.
fn chi_square(
    counts: &std::collections::BTreeMap<Vec<u32>, usize>,
    probs: &std::collections::BTreeMap<Vec<u32>, f64>,
) -> (f64, usize) {
    let n: usize = counts.values().sum();
    let (mut stat, mut bins, mut pool_obs, mut pool_exp) = (0.0, 0usize, 0.0, 0.0);
    for (k, &p) in probs {
        let (e, o) = (p * n as f64, *counts.get(k).unwrap_or(&0) as f64);
        if e < 5.0 {
            (pool_obs, pool_exp) = (pool_obs + o, pool_exp + e);
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
        return (f64::INFINITY, bins.max(2) - 1);
    }
    (stat, bins - 1)
}

/// Speculative sampling with the assistant (which disagrees with the random target most of the
/// time) draws the first two tokens from the target's exact joint distribution (temperature 1,
/// top-k 6, repetition and presence penalties; chi-square at p = 0.001), and the assistant's own
/// first-token distribution is rejected by the same test.
#[test]
fn assistant_speculative_sampling_matches_the_target_distribution() {
    use mlx_models::{Logits, Model, Speculator};
    use mlx_speculative::Drafter;
    use sampling::{Sampler, SamplingConfig};
    use std::collections::BTreeMap;
    let target = load("gemma4_text", KvCacheMode::Flat);
    let history: Vec<u32> = vec![2, 17, 230, 5, 99, 230, 17, 410, 88, 3];
    let cfg = SamplingConfig::default()
        .with_temperature(1.0)
        .with_top_k(6)
        .with_repetition_penalty(1.5)
        .with_presence_penalty(0.5)
        .with_seed(11);
    let sampler = Sampler::new(cfg.clone()).unwrap();
    let probs = |lp: &Array| -> Vec<f64> {
        lp.reshape(&[-1])
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|&x| (x as f64).exp())
            .collect()
    };
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
    let mut joint = BTreeMap::new();
    for (t0, &a) in dist_after(&target, &history)
        .iter()
        .enumerate()
        .filter(|(_, &a)| a > 0.0)
    {
        let h: Vec<u32> = history.iter().copied().chain([t0 as u32]).collect();
        for (t1, &b) in dist_after(&target, &h)
            .iter()
            .enumerate()
            .filter(|(_, &b)| b > 0.0)
        {
            joint.insert(vec![t0 as u32, t1 as u32], a * b);
        }
    }
    let mut spec = SpeculativeDecoder::new(
        Box::new(AssistantDrafter::new(target.clone(), assistant()).unwrap()),
        Some(3),
    );
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
    let mut counts = BTreeMap::new();
    for _ in 0..600 {
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
    eprintln!(
        "gemma4_assistant sampling: joint of 2 tokens chi2 {s:.1}, df {df}, critical {:.1}; {st:?}",
        critical(df)
    );
    assert!(
        st.acceptance_by_position[0] < 0.5,
        "the assistant must disagree often: {st:?}"
    );
    assert!(
        s < critical(df),
        "chi2 {s} >= {} with {df} degrees of freedom",
        critical(df)
    );
    // power: the assistant's own first-token distribution is rejected
    let mut d = AssistantDrafter::new(target.clone(), assistant()).unwrap();
    let q = d.propose(&history, 1, &cfg).unwrap().logprobs.unwrap();
    let qd: BTreeMap<Vec<u32>, f64> = probs(&q)
        .iter()
        .enumerate()
        .filter(|(_, &x)| x > 0.0)
        .map(|(i, &x)| (vec![i as u32], x))
        .collect();
    let first = counts.iter().fold(BTreeMap::new(), |mut m, (k, &c)| {
        *m.entry(vec![k[0]]).or_insert(0usize) += c;
        m
    });
    let (sq, dfq) = chi_square(&first, &qd);
    eprintln!("  against the assistant's distribution: chi2 {sq:.1}, df {dfq}");
    assert!(
        sq > critical(dfq),
        "the test has no power: the assistant's distribution passes too"
    );
}
