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
use mlx_models::{KvCacheMode, LoadOptions};
use mlx_speculative::{load_drafter, load_drafter_for, AssistantDrafter, SpeculativeDecoder};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4_assistant")
}

fn assistant() -> Gemma4Assistant {
    Gemma4Assistant::load(&dir().join("assistant"), None).unwrap()
}

fn reference() -> std::collections::HashMap<String, Array> {
    tensors(&dir().join("reference.safetensors"))
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
        let (tokens, logits) = d.draft_logits(&history, want_tokens.len(), None).unwrap();
        let logits = logits.unwrap();
        let e = rel(&logits, &r[&format!("{name}draft_logits")]);
        eprintln!("gemma4_assistant {name}draft logits: rel {e:.2e}, drafts {tokens:?}");
        assert!(e < 1e-4, "{name}: draft logits rel {e}");
        assert_eq!(tokens, want_tokens, "{name}");
        // the same drafts from the K/V of a verifier's flat cache
        let mut d = AssistantDrafter::new(target.clone(), assistant()).unwrap();
        let mut cache = prefilled(&target, &history);
        let (tokens, on) = d
            .draft_logits(&history, want_tokens.len(), Some(&mut cache))
            .unwrap();
        let e = rel(&on.unwrap(), &r[&format!("{name}draft_logits")]);
        eprintln!("  from the verifier's cache: rel {e:.2e}");
        assert!(
            e < 1e-4,
            "{name}: draft logits from the verifier's cache rel {e}"
        );
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
        let (got, gl) = kept.draft_logits(&history, 3, None).unwrap();
        let mut fresh = AssistantDrafter::new(target.clone(), assistant()).unwrap();
        let (want, wl) = fresh.draft_logits(&history, 3, None).unwrap();
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
        let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 20);
        let label = format!("gemma4_assistant {kv:?}");
        identity_at_depths(
            &target,
            &prompt,
            &want,
            &[Some(1), Some(3), Some(8)],
            &label,
            || Box::new(AssistantDrafter::new(target.clone(), assistant()).unwrap()),
        );
        // within the sliding window a flat cache's K/V and the verify steps' hidden states
        // serve every cycle: the target runs only the prompt once more (the first cycle's
        // hidden state); a paged cache is mirrored in the drafter's own
        let (prompt, want) = gapped_greedy(&target, &mut rng, 5, 8);
        let mut spec = SpeculativeDecoder::new(
            Box::new(AssistantDrafter::new(target.clone(), assistant()).unwrap()),
            Some(2),
        );
        check_identity(
            &target,
            &mut spec,
            &prompt,
            &want,
            &format!("gemma4_assistant {kv:?} within the window"),
        );
        let run = spec.drafter().target_positions_run();
        if matches!(kv, KvCacheMode::Flat) {
            assert_eq!(run, prompt.len(), "flat: the verifier's cache");
        } else {
            assert!(run > prompt.len(), "paged: the drafter's own cache: {run}");
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
        let (toks, st, _) = run_spec(
            &target,
            &mut spec,
            &[2, 14, 15, 92, 65],
            gen_cfg(20, sampling.clone()),
        );
        (toks, st.cycles)
    };
    let (a, cycles) = run();
    assert_eq!(a.len(), 20);
    assert!(cycles > 0);
    assert_eq!(run().0, a, "same seed, same tokens");
}

/// Speculative sampling with the assistant (which disagrees with the random target most of the
/// time) draws the first two tokens from the target's exact joint distribution (temperature 1,
/// top-k 6, repetition and presence penalties; chi-square at p = 0.001), and the assistant's own
/// first-token distribution is rejected by the same test.
#[test]
fn assistant_speculative_sampling_matches_the_target_distribution() {
    let target = load("gemma4_text", KvCacheMode::Flat);
    let history = [2, 17, 230, 5, 99, 230, 17, 410, 88, 3];
    check_disagreeing_drafter(
        "gemma4_assistant sampling",
        &target,
        &history,
        11,
        600,
        || Box::new(AssistantDrafter::new(target.clone(), assistant()).unwrap()),
    );
}
