//! Block drafts (DSpark, DFlash) against a torch re-implementation of the published reference
//! code (`scripts/make_block_draft_fixture.py`: z-lab/dflash's `DFlashDraftModel` over the tiny
//! Qwen3, DeepSpec's Gemma 4 DSpark as mlx-node ports it over the tiny Gemma 4, each with a tiny
//! random draft written by the loader's expected-keys writer): draft logits (DSpark's with the
//! Markov bias) and keep-probabilities within 1e-4 relative (f32), the same greedy drafts, for
//! a full block and a short one; the drafter's context carried from cycle to cycle equals a
//! fresh one; speculative decoding with block drafts is token for token plain greedy decoding
//! (flat and paged caches, confidence truncation), and speculative sampling with a DSpark draft
//! is distributed as the target's sampling (chi-square).
mod common;
use common::*;
use mlx_array::{Array, DType};
use mlx_models::{KvCacheMode, LoadOptions, Logits, Model};
use mlx_speculative::{
    load_drafter, load_drafter_for, BlockDrafter, BlockNet, Depth, DraftKind, Drafter, Feedback,
    SpeculativeDecoder,
};
use std::path::PathBuf;

/// (fixture, target): DFlash drafts for the tiny Qwen3, DSpark drafts for the tiny Gemma 4.
const KINDS: [(&str, &str); 2] = [("dflash", "qwen3"), ("dspark", "gemma4_text")];

fn dir(kind: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/block")
        .join(kind)
}

fn drafter(kind: &str, target: &Model) -> BlockDrafter {
    BlockDrafter::new(
        target.clone(),
        BlockNet::load(&dir(kind), Some(DType::F32)).unwrap(),
    )
    .unwrap()
}

#[test]
fn block_draft_logits_match_the_torch_reference() {
    for (kind, t) in KINDS {
        let target = load(t, KvCacheMode::Flat);
        let r = tensors(&dir(kind).join("reference.safetensors"));
        for case in ["full", "short"] {
            let history = ids(&r[&format!("{case}_tokens")]);
            let want = ids(&r[&format!("{case}_draft_tokens")]);
            let mut d = drafter(kind, &target);
            let tr = d.trace(&history, want.len()).unwrap().unwrap();
            let e = rel(&tr.logits, &r[&format!("{case}_draft_logits")]);
            let keep = tr
                .keep
                .as_ref()
                .map(|k| rel(k, &r[&format!("{case}_keep")]));
            eprintln!(
                "{kind} {case}: draft logits rel {e:.2e}, keep-probabilities {keep:?}, drafts {:?}",
                tr.tokens
            );
            assert!(e < 1e-4, "{kind} {case}: draft logits rel {e}");
            assert_eq!(tr.tokens, want, "{kind} {case}");
            assert_eq!(tr.keep.is_some(), kind == "dspark");
            assert!(
                keep.is_none_or(|k| k < 1e-4),
                "{kind} {case}: keep rel {keep:?}"
            );
        }
    }
}

/// The context carried from cycle to cycle (extended by the verify steps' taps of the accepted
/// positions, or rebuilt for a history the drafter did not follow) drafts what a fresh drafter
/// computes from the whole history, after verdicts accepting 0..=k drafts.
#[test]
fn block_incremental_drafts_equal_fresh_ones() {
    for (kind, t) in KINDS {
        let target = load(t, KvCacheMode::Flat);
        let mut d = drafter(kind, &target);
        let taps = d.target_taps().to_vec();
        let mut history: Vec<u32> = vec![11, 42, 7, 300, 5, 77, 140, 9];
        let k = 4;
        for (cycle, accepted) in [0usize, 2, 4, 1, 4, 0, 3].into_iter().enumerate() {
            let got = d.trace(&history, k).unwrap().unwrap();
            let want = drafter(kind, &target).trace(&history, k).unwrap().unwrap();
            assert_eq!(got.tokens, want.tokens, "{kind} cycle {cycle}");
            assert!(
                rel(&got.logits, &want.logits) < 1e-5,
                "{kind} cycle {cycle}"
            );
            // the target's verify step over [last, drafts] after the history, with its taps
            let mut c = prefilled(&target, &history);
            let mut seq = vec![history[history.len() - 1]];
            seq.extend(&got.tokens);
            let (_, tapped) = target
                .with_runtime(|rt| {
                    rt.forward_taps(
                        &Array::from_slice(&seq, &[1, seq.len()]).unwrap(),
                        &mut c,
                        Logits::All,
                        false,
                        &taps,
                    )
                })
                .unwrap();
            let next = (history.len() as u32 * 31 + 5) % 512;
            d.feedback(&Feedback {
                history: &history,
                drafts: &got.tokens,
                accepted,
                next,
                hidden: None,
                taps: &tapped,
            })
            .unwrap();
            history.extend(&got.tokens[..accepted]);
            history.push(next);
            if cycle == 4 {
                // a history the drafter did not follow: rebuilt from the target
                history.truncate(history.len() - 3);
            }
        }
    }
}

#[test]
fn block_drafting_equals_plain_greedy() {
    let mut rng = Rng(61);
    for (kind, t) in KINDS {
        for kv in [KvCacheMode::Flat, paged(4)] {
            let target = load(t, kv.clone());
            let (prompt, want) = gapped_greedy(&target, &mut rng, 14, 24);
            // the verify steps' taps serve every cycle: only the prompt is tapped once more
            let depths = [None, Some(1), Some(rng.range(2, 6))];
            let label = format!("{kind} {kv:?}");
            let run = identity_at_depths(&target, &prompt, &want, &depths, &label, || {
                Box::new(drafter(kind, &target))
            });
            assert_eq!(run, vec![prompt.len(); 3]);
            // adaptive depth (its plain steps' taps join the context too), and DSpark with
            // confidence truncation
            let mut spec = SpeculativeDecoder::adaptive(Box::new(drafter(kind, &target)), None);
            check_identity(
                &target,
                &mut spec,
                &prompt,
                &want,
                &format!("{kind} {kv:?} adaptive"),
            );
            assert_eq!(spec.drafter().target_positions_run(), prompt.len());
            if kind == "dspark" {
                let mut d = drafter(kind, &target);
                d.set_confidence_threshold(0.5).unwrap();
                let mut spec = SpeculativeDecoder::new(Box::new(d), None);
                let st = check_identity(
                    &target,
                    &mut spec,
                    &prompt,
                    &want,
                    &format!("{kind} {kv:?} confidence 0.5"),
                );
                assert!(st.depth_mean < 7.0, "truncated blocks: {st:?}");
            }
        }
    }
}

/// Confidence truncation cuts a block before its first draft below the threshold.
#[test]
fn dspark_confidence_threshold_truncates_blocks() {
    let target = load("gemma4_text", KvCacheMode::Flat);
    let history: Vec<u32> = vec![2, 17, 230, 5, 99, 41, 17, 410, 88, 3];
    let keep = drafter("dspark", &target)
        .trace(&history, 7)
        .unwrap()
        .unwrap()
        .keep
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for threshold in [0.0, keep[0].min(keep[1]) + 1e-6, 1.0] {
        let mut d = drafter("dspark", &target);
        d.set_confidence_threshold(threshold).unwrap();
        let got = d
            .propose(&history, 7, &sampling::SamplingConfig::greedy())
            .unwrap()
            .tokens
            .len();
        let want = if threshold == 0.0 {
            7
        } else {
            keep.iter().take_while(|&&p| p >= threshold).count()
        };
        assert_eq!(got, want, "threshold {threshold}, keep {keep:?}");
    }
    assert!(drafter("dspark", &target)
        .set_confidence_threshold(1.5)
        .is_err());
    assert!(drafter("dflash", &load("qwen3", KvCacheMode::Flat))
        .set_confidence_threshold(0.5)
        .is_err());
}

/// Speculative sampling with a DSpark draft (Markov-chained draws that disagree with the random
/// target) draws the next two tokens from the target's exact joint distribution.
#[test]
fn dspark_speculative_sampling_matches_the_target_distribution() {
    let target = load("gemma4_text", KvCacheMode::Flat);
    let history = [2, 17, 230, 5, 99, 230, 17, 410, 88, 3];
    check_disagreeing_drafter("dspark sampling", &target, &history, 13, 500, || {
        Box::new(drafter("dspark", &target))
    });
}

#[test]
fn block_drafts_load_from_their_config() {
    let opts = LoadOptions {
        dtype: Some(DType::F32),
        ..Default::default()
    };
    for ((kind, t), (default, max)) in KINDS.into_iter().zip([(7, 7), (7, 7)]) {
        let target = load(t, KvCacheMode::Flat);
        let want = if kind == "dspark" {
            DraftKind::DSpark
        } else {
            DraftKind::DFlash
        };
        assert_eq!(mlx_speculative::draft_kind(&dir(kind)).unwrap(), want);
        let d = load_drafter_for(&dir(kind), &opts, &target).unwrap();
        assert_eq!(
            (d.default_depth(), d.max_depth()),
            (default, Some(max)),
            "{kind}"
        );
        for (asked, got) in [(None, default), (Some(0), 1), (Some(3), 3), (Some(40), max)] {
            let s = SpeculativeDecoder::new(
                load_drafter_for(&dir(kind), &opts, &target).unwrap(),
                asked,
            );
            assert_eq!(s.depth(), Depth::Fixed(got), "{kind} {asked:?}");
        }
        let e = load_drafter(&dir(kind), &opts).err().unwrap().to_string();
        assert!(e.contains("load_drafter_for"), "{e}");
    }
    // a draft for another target is refused by name
    let e = load_drafter_for(&dir("dspark"), &opts, &load("qwen3", KvCacheMode::Flat))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("vocabulary"), "{e}");
    let e = load_drafter_for(
        &dir("dflash"),
        &opts,
        &load("gemma4_text", KvCacheMode::Flat),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("vocabulary") || e.contains("layers"), "{e}");
    // the random writer's layout is the loader's
    let names: Vec<String> = BlockNet::expected_tensors(&dir("dspark"))
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names.len(), 9 + 13 * 2, "{names:?}");
}

/// Block drafts over hybrid targets, whose rollback restores recurrent state (LFM2's short
/// conv, Qwen3.5's GatedDeltaNet): the DFlash draft (its config re-pointed at a 4-layer target)
/// taps their residual stream, and speculative decoding with it is token for token plain
/// greedy decoding on flat and paged caches, at fixed and adaptive depths. This random draft
/// never agrees with these random targets, so every cycle rolls the target back to its
/// snapshot and runs its own token again (partial acceptance through recurrent state is
/// `identity.rs`'s, with draft models). The targets' taps come with the same logits as a plain
/// forward.
#[test]
fn block_drafting_over_hybrid_targets_equals_plain_greedy() {
    let src = dir("dflash");
    let tmp = std::env::temp_dir().join(format!("block-hybrid-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["num_target_layers"] = serde_json::json!(4);
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), tmp.join("model.safetensors")).unwrap();
    let taps = [0usize, 1];
    let mut rng = Rng(62);
    let mut rejected = false;
    for t in ["lfm2", "qwen3_5", "lfm2_moe"] {
        // the taps' forward gives the plain forward's logits
        let target = load(t, KvCacheMode::Flat);
        let ids = Array::from_slice(&[3u32, 90, 17, 250, 8], &[1, 5]).unwrap();
        let (mut c1, mut c2) = (target.new_cache(), target.new_cache());
        let (tapped_out, tapped) = target.with_runtime(|rt| rt.forward_taps(&ids, &mut c1, Logits::All, false, &taps)).unwrap();
        let plain = target.with_runtime(|rt| rt.forward(&ids, &mut c2, Logits::All, false)).unwrap();
        let (a, b) = (tapped_out.logits.unwrap(), plain.logits.unwrap());
        assert!(a.to_vec::<f32>().unwrap() == b.to_vec::<f32>().unwrap(), "{t}: logits with taps");
        assert_eq!(tapped.len(), 2);
        assert!(tapped.iter().all(|x| x.dims() == vec![1, 5, 64]), "{t}");
        for kv in [KvCacheMode::Flat, paged(4)] {
            let target = load(t, kv.clone());
            let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 20);
            let make = || -> Box<dyn Drafter> { Box::new(BlockDrafter::new(target.clone(), BlockNet::load(&tmp, Some(DType::F32)).unwrap()).unwrap()) };
            let label = format!("dflash over {t} {kv:?}");
            for depth in [None, Some(3)] {
                let mut spec = SpeculativeDecoder::new(make(), depth);
                let st = check_identity(&target, &mut spec, &prompt, &want, &format!("{label} depth {depth:?}"));
                eprintln!("{label} depth {depth:?}: {st:?}");
                rejected |= st.acceptance_by_position.iter().any(|&a| a < 1.0);
            }
            let mut spec = SpeculativeDecoder::adaptive(make(), None);
            check_identity(&target, &mut spec, &prompt, &want, &format!("{label} adaptive"));
        }
    }
    assert!(rejected, "no draft was rejected: the recurrent state was never rolled back");
    let _ = std::fs::remove_dir_all(&tmp);
}
