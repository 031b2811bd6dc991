//! Qwen3.5's MTP head (dense and MoE) against a torch re-implementation of vLLM's
//! `qwen3_next_mtp.py` built from transformers 5.17's Qwen3.5 layers
//! (`scripts/make_mtp_fixture.py`): step-0 logits over every position of a fixed context and four
//! chained drafts (depth 5), within 1e-4 relative (f32); then MTP drafting in speculative
//! decoding, token for token equal to plain greedy decoding.
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::{KvCacheMode, Logits};
use mlx_speculative::{DraftAhead, MtpDrafter, SpeculativeDecoder};
use std::path::PathBuf;

/// The tiny checkpoint `name` with the fixture's `mtp-drafter/` sidecar, in a temporary directory.
fn with_mtp(name: &str, test: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("mtp-{name}-{test}-{}", std::process::id()));
    std::fs::create_dir_all(dst.join("mtp-drafter")).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/mtp")
        .join(name);
    std::fs::copy(
        src.join("mtp-drafter/model.safetensors"),
        dst.join("mtp-drafter/model.safetensors"),
    )
    .unwrap();
    dst
}

fn reference(name: &str) -> std::collections::HashMap<String, Array> {
    tensors(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/mtp")
            .join(name)
            .join("reference.safetensors"),
    )
}

#[test]
fn mtp_logits_match_the_torch_reference() {
    for name in ["qwen3_5", "qwen3_5_moe"] {
        let dir = with_mtp(name, "logits");
        let m = load_dir(&dir, KvCacheMode::Flat);
        assert!(m.has_mtp_weights());
        assert_eq!(m.with_runtime(|rt| rt.mtp_layers()), 1, "{name}");
        let r = reference(name);
        let toks = r["tokens"]
            .astype(mlx_array::DType::U32)
            .unwrap()
            .to_vec::<u32>()
            .unwrap();
        let l = toks.len();
        let mut cache = m.new_cache();
        let out = m
            .forward(
                &Array::from_slice(&toks, &[1, l]).unwrap(),
                &mut cache,
                Logits::None,
                true,
            )
            .unwrap();
        let hidden = out.hidden.unwrap();
        let e_h = rel(&hidden, &r["hidden"]);
        let mut mc = mlx_models::Cache::new(&m.with_runtime(|rt| rt.mtp_cache_spec()).unwrap());
        let t = Array::from_slice(&toks[1..], &[1, l - 1]).unwrap();
        let (logits, mut h) = m
            .with_runtime(|rt| {
                rt.mtp_forward(&t, &hidden.slice_axis(1, 0, l - 1).unwrap(), &mut mc, 0)
            })
            .unwrap();
        let e0 = rel(&logits, &r["logits0"]);
        let chain = r["chain_tokens"]
            .astype(mlx_array::DType::U32)
            .unwrap()
            .to_vec::<u32>()
            .unwrap();
        let mut worst = 0f32;
        for (s, &c) in chain.iter().enumerate() {
            let last = h
                .slice_axis(1, h.dim(1).unwrap() - 1, h.dim(1).unwrap())
                .unwrap();
            let (lg, nh) = m
                .with_runtime(|rt| {
                    rt.mtp_forward(
                        &Array::from_slice(&[c], &[1, 1]).unwrap(),
                        &last,
                        &mut mc,
                        0,
                    )
                })
                .unwrap();
            worst = worst.max(rel(
                &lg,
                &r["chain_logits"].slice_axis(0, s, s + 1).unwrap(),
            ));
            h = nh;
        }
        eprintln!("{name}: target hidden {e_h:.2e}, MTP step 0 {e0:.2e}, chained depth 2..5 {worst:.2e} (max rel)");
        assert!(
            e_h < 1e-4 && e0 < 1e-4 && worst < 1e-4,
            "{name}: {e_h} {e0} {worst}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // a model without an MTP head says so
    let plain = load("qwen3", KvCacheMode::Flat);
    let mut c = plain.new_cache();
    let t = Array::from_slice(&[1u32], &[1, 1]).unwrap();
    let h = Array::zeros(&[1, 1, 64], mlx_array::DType::F32).unwrap();
    assert!(plain
        .with_runtime(|rt| rt.mtp_forward(&t, &h, &mut c, 0))
        .is_err());
}

#[test]
fn mtp_drafting_equals_plain_greedy() {
    let mut rng = Rng(35);
    for (i, (name, kv)) in [
        ("qwen3_5", KvCacheMode::Flat),
        ("qwen3_5_moe", KvCacheMode::Flat),
        ("qwen3_5", paged(4)),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = with_mtp(name, &format!("drafting{i}"));
        let target = load_dir(&dir, kv.clone());
        let (prompt, want) = gapped_greedy(&target, &mut rng, 16, 24);
        // the verify steps' hidden states serve every cycle: only the prompt is run once more
        let label = format!("{name} {kv:?} MTP");
        let run = identity_at_depths(
            &target,
            &prompt,
            &want,
            &[Some(1), Some(3), Some(5)],
            &label,
            || Box::new(MtpDrafter::new(target.clone()).unwrap()),
        );
        assert_eq!(run, vec![prompt.len(); 3]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert!(
        MtpDrafter::new(load("qwen3", KvCacheMode::Flat)).is_err(),
        "no MTP head: refused"
    );
}

/// A warmed-up MTP decoder (cycles at every depth on a throwaway cache, the head's state left
/// over [0, 0, ..]) still gives plain greedy decoding's tokens, from the prompt's states alone.
#[test]
fn mtp_after_warm_up_matches_plain_decoding() {
    let dir = with_mtp("qwen3_5", "warm-up");
    let target = load_dir(&dir, KvCacheMode::Flat);
    let mut rng = Rng(21);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 16, 24);
    for mut spec in [
        SpeculativeDecoder::new(Box::new(MtpDrafter::new(target.clone()).unwrap()), Some(3)),
        SpeculativeDecoder::adaptive(Box::new(MtpDrafter::new(target.clone()).unwrap()), Some(3)),
    ] {
        spec.warm_up(&target).unwrap();
        let (got, _, offset) = run_spec(&target, &mut spec, &prompt, gen_cfg(want.len(), sampling::SamplingConfig::greedy()));
        assert_eq!(got, want, "{:?}", spec.depth());
        assert_eq!(offset, prompt.len() + want.len());
    }
    // the head reads the verify's hidden states: it cannot draft ahead of them, and says so
    let spec = SpeculativeDecoder::new(Box::new(MtpDrafter::new(target.clone()).unwrap()), Some(3));
    assert_eq!(spec.draft_ahead(), DraftAhead::Steps(0));
    let e = spec.with_draft_ahead(DraftAhead::UntilVerified).err().expect("refused").to_string();
    assert!(e.contains("runs ahead"), "{e}");
    let spec = SpeculativeDecoder::new(Box::new(MtpDrafter::new(target.clone()).unwrap()), Some(3));
    assert!(spec.with_draft_ahead(DraftAhead::Steps(0)).is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The MTP drafter's incremental state (head cache trimmed and extended cycle by cycle from the
/// verify steps' hidden states) drafts what a fresh drafter computing everything from the
/// history drafts, after verdicts accepting 0..=k drafts (the random head never agrees with the
/// target on its own, so the verdicts are given).
#[test]
fn mtp_incremental_drafts_equal_fresh_ones() {
    use mlx_speculative::{Drafter, Feedback};
    let dir = with_mtp("qwen3_5", "incremental");
    let target = load_dir(&dir, KvCacheMode::Flat);
    let greedy = sampling::SamplingConfig::greedy();
    let mut history: Vec<u32> = vec![11, 42, 7, 300, 5, 77, 140, 9];
    let mut d = MtpDrafter::new(target.clone()).unwrap();
    let k = 3;
    for (cycle, accepted) in [0usize, 2, 3, 1, 3, 0].into_iter().enumerate() {
        let draft = d.propose(&history, k, &greedy).unwrap();
        let fresh = MtpDrafter::new(target.clone())
            .unwrap()
            .propose(&history, k, &greedy)
            .unwrap();
        assert_eq!(draft.tokens, fresh.tokens, "cycle {cycle}");
        // the target's verify step over [last, drafts] after the history
        let mut c = target.new_cache();
        let before = &history[..history.len() - 1];
        target
            .forward(
                &Array::from_slice(before, &[1, before.len()]).unwrap(),
                &mut c,
                Logits::None,
                false,
            )
            .unwrap();
        let mut seq = vec![history[history.len() - 1]];
        seq.extend(&draft.tokens);
        let out = target
            .forward(
                &Array::from_slice(&seq, &[1, seq.len()]).unwrap(),
                &mut c,
                Logits::All,
                true,
            )
            .unwrap();
        let next = (history.len() as u32 * 31 + 5) % 512;
        d.feedback(&Feedback {
            history: &history,
            drafts: &draft.tokens,
            accepted,
            next,
            hidden: out.hidden.as_ref(),
            taps: &[],
        })
        .unwrap();
        history.extend(&draft.tokens[..accepted]);
        history.push(next);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sampling (temperature > 0, penalties, top-k) with MTP drafts: the draft distributions have
/// the right shape for the verifier, and a fixed seed gives the same tokens twice.
#[test]
fn mtp_sampling_runs_and_is_reproducible() {
    let dir = with_mtp("qwen3_5_moe", "sampling");
    let target = load_dir(&dir, KvCacheMode::Flat);
    let run = || {
        let mut spec =
            SpeculativeDecoder::new(Box::new(MtpDrafter::new(target.clone()).unwrap()), Some(3));
        let sampling = sampling::SamplingConfig::default()
            .with_temperature(0.9)
            .with_top_k(20)
            .with_repetition_penalty(1.2)
            .with_seed(5);
        let (toks, st, _) = run_spec(
            &target,
            &mut spec,
            &[3, 14, 15, 92, 65],
            gen_cfg(20, sampling),
        );
        (toks, st.cycles)
    };
    let (a, cycles) = run();
    assert_eq!(a.len(), 20);
    assert!(cycles > 0);
    assert_eq!(run().0, a, "same seed, same tokens");
    std::fs::remove_dir_all(&dir).unwrap();
}
