//! Identity at temperature 0: speculative output is token for token the target's plain greedy
//! output, for random prompts, depths and draft/target pairs, over every cache kind: flat, paged
//! (block size 4, so rollbacks cross block boundaries), rotating (Gemma 3's sliding window of
//! 16, prompts longer than it), recurrent (Qwen3.5's GatedDeltaNet, LFM2's short conv) on the
//! target and on the draft side. Prompts satisfy the 1e-4 top-1/top-2 gap rule over the whole
//! comparison (see `common::gapped_prompt`).
mod common;
use common::*;
use mlx_models::{KvCacheMode, Model};
use mlx_speculative::{DraftAhead, DraftModel, SpeculativeDecoder};

const NEW: usize = 24;

fn speculative(
    target: &Model,
    draft: Model,
    prompt: &[u32],
    n: usize,
    depth: usize,
    ahead: DraftAhead,
) -> (Vec<u32>, mlx_models::SpeculativeStats, usize) {
    let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(draft)), Some(depth)).with_draft_ahead(ahead).unwrap();
    run_spec(
        target,
        &mut spec,
        prompt,
        gen_cfg(n, sampling::SamplingConfig::greedy()),
    )
}

/// The message of a caught panic.
fn panic_message(e: Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn greedy_identity_over_caches_drafts_and_depths() {
    let mut rng = Rng(22);
    // (target, its cache, drafts)
    let cases: Vec<(&str, KvCacheMode, Vec<&str>)> = vec![
        (
            "qwen3",
            KvCacheMode::Flat,
            vec!["qwen3", "qwen3_untied", "lfm2"],
        ),
        ("qwen3", paged(4), vec!["qwen3_untied", "qwen3_5"]),
        (
            "qwen3_untied",
            KvCacheMode::Flat,
            vec!["qwen3_untied_q8g32", "gemma3_text"],
        ),
        (
            "qwen3_5",
            KvCacheMode::Flat,
            vec!["qwen3_5", "qwen3", "lfm2"],
        ),
        ("lfm2", KvCacheMode::Flat, vec!["qwen3_untied", "lfm2"]),
        (
            "gemma3_text",
            KvCacheMode::Flat,
            vec!["gemma3_text", "llama"],
        ),
        // no q/k norms: on a GPU rope reads q and k straight from the joined q/k/v product
        ("llama", KvCacheMode::Flat, vec!["llama", "llama_q4", "qwen3"]),
        ("qwen2", paged(4), vec!["llama", "qwen2"]),
        // quantized drafts of hybrid and sliding-window targets: partial acceptance, so both
        // sides roll back part of a cycle through recurrent state and rotating windows
        ("lfm2_moe", KvCacheMode::Flat, vec!["lfm2_moe_q4"]),
        ("lfm2_moe_q4", KvCacheMode::Flat, vec!["lfm2_moe"]),
        ("gemma4_text", KvCacheMode::Flat, vec!["gemma4_text_q4g32"]),
        (
            "gemma4_text_moe_q4",
            KvCacheMode::Flat,
            vec!["gemma4_text_moe"],
        ),
    ];
    let mut rejected_cycles = 0;
    // every pair runs, and the failures are reported together (a device run shows them all)
    let mut failures = Vec::new();
    for (t, kv, drafts) in cases {
        let target = load(t, kv.clone());
        let len = rng.range(18, 40);
        let plain = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gapped_greedy(&target, &mut rng, len, NEW)));
        let (prompt, want) = match plain {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("target {t} {kv:?}, plain decoding: {}", panic_message(e)));
                continue;
            }
        };
        for d in drafts {
            let depth = rng.range(1, 6);
            // draft forwards run ahead while the target verifies: a fixed number, until the
            // verify's result is ready (the GPU default; a number that varies with timing), or
            // on the draft's own thread (as many as it runs before the next proposal)
            let ahead = match rng.range(0, 5) {
                4 => DraftAhead::UntilVerified,
                5 => DraftAhead::Background,
                n => DraftAhead::Steps(n),
            };
            let label = format!("target {t} {kv:?}, draft {d}, depth {depth}, {ahead} ahead");
            let pair = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let (got, stats, offset) =
                    speculative(&target, load(d, KvCacheMode::Flat), &prompt, NEW, depth, ahead);
                assert_eq!(got, want, "{label}");
                assert_eq!(
                    offset,
                    prompt.len() + NEW,
                    "the cache holds the prompt and every token"
                );
                assert!(stats.cycles > 0 && stats.depth_mean <= depth as f64);
                if d == t {
                    assert!(
                        stats.acceptance_by_position.iter().all(|&a| a == 1.0),
                        "the target drafting for itself: {stats:?}"
                    );
                }
                eprintln!("{t} {kv:?} <- {d} depth {depth}, {ahead} ahead: {stats:?}");
                stats
                    .acceptance_by_position
                    .iter()
                    .filter(|&&a| a < 1.0)
                    .count()
            }));
            match pair {
                Ok(rejected) => rejected_cycles += rejected,
                Err(e) => failures.push(format!("{label}: {}", panic_message(e))),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} pair(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        rejected_cycles > 0,
        "some pairs must disagree, or rollback was never exercised"
    );
}

/// A prompt longer than a paged block and depths that make every cycle's rollback end at a
/// different offset within the blocks; drafts from a disagreeing model, on a paged cache of its
/// own, three of them drafting ahead (its guesses roll back across blocks too), one on its own
/// thread.
#[test]
fn paged_rollbacks_across_block_boundaries() {
    let mut rng = Rng(7);
    for bs in [2, 4] {
        let target = load("qwen3_untied", paged(bs));
        let (prompt, want) = gapped_greedy(&target, &mut rng, 13, 40);
        let ahead_cases = [(2, 0), (3, 0), (5, 0), (3, 2)].map(|(d, a)| (d, DraftAhead::Steps(a)));
        for (depth, ahead) in ahead_cases.into_iter().chain([(5, DraftAhead::UntilVerified), (5, DraftAhead::Background)]) {
            let (got, stats, _) = speculative(
                &target,
                load("qwen3_untied_q8g32", paged(bs)),
                &prompt,
                40,
                depth,
                ahead,
            );
            assert_eq!(got, want, "block size {bs}, depth {depth}, {ahead} ahead");
            eprintln!("paged {bs} depth {depth}, {ahead} ahead: {stats:?}");
        }
    }
}

/// A drafter that knows the plain greedy continuation and proposes it with every third token
/// wrong: cycles end part-way at every depth, on every cache kind (MoE and hybrid targets
/// included), so the target rolls back part of each cycle.
struct Oracle {
    prompt_len: usize,
    truth: Vec<u32>,
    vocab: usize,
}

impl mlx_speculative::Drafter for Oracle {
    fn propose(
        &mut self,
        history: &[u32],
        k: usize,
        _: &sampling::SamplingConfig,
    ) -> mlx_models::Result<mlx_speculative::Draft> {
        let at = history.len() - self.prompt_len;
        let tokens = (at..at + k)
            .map(|i| {
                self.truth.get(i).map_or(0, |&t| {
                    if i % 3 == 2 {
                        (t + 1) % self.vocab as u32
                    } else {
                        t
                    }
                })
            })
            .collect();
        Ok(mlx_speculative::Draft {
            tokens,
            logprobs: None,
        })
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn default_depth(&self) -> usize {
        3
    }
}

#[test]
fn partial_acceptance_rolls_back_every_cache_kind() {
    let mut rng = Rng(5);
    for (t, kv) in [
        ("qwen3", paged(4)),
        ("qwen3_5", KvCacheMode::Flat),
        ("qwen3_5_moe", KvCacheMode::Flat),
        ("lfm2", KvCacheMode::Flat),
        ("gemma3_text", KvCacheMode::Flat),
        ("gemma4_text", KvCacheMode::Flat),
        ("gemma4_text", paged(4)),
        ("qwen3_5", paged(4)),
    ] {
        let target = load(t, kv.clone());
        let prompt = gapped_prompt(&target, &mut rng, 20, 30);
        // the truth continues past the comparison so the last cycle's drafts are right too
        let truth = plain_greedy(&target, &prompt, 40);
        for depth in [1, 2, 4] {
            let oracle = Oracle {
                prompt_len: prompt.len() + 1,
                truth: truth[1..].to_vec(),
                vocab: target.info().vocab_size,
            };
            let mut spec = SpeculativeDecoder::new(Box::new(oracle), Some(depth));
            let (got, st, offset) = run_spec(
                &target,
                &mut spec,
                &prompt,
                gen_cfg(30, sampling::SamplingConfig::greedy()),
            );
            assert_eq!(got, truth[..30], "target {t} {kv:?}, depth {depth}");
            if depth > 2 {
                assert!(
                    st.accepted_mean > 0.0 && st.accepted_mean < st.depth_mean,
                    "{t} depth {depth}: partial acceptance expected, {st:?}"
                );
            }
            assert_eq!(offset, prompt.len() + 30);
        }
    }
}

/// Greedy speculative decoding gives plain greedy decoding's tokens and their log-probs under the
/// same settings, without and with a repetition penalty (which reads the drafts).
#[test]
fn greedy_tokens_and_logprobs_match_plain() {
    use mlx_models::{generate, Token};
    let target = load("qwen3", KvCacheMode::Flat);
    let mut rng = Rng(5);
    let prompt = gapped_prompt(&target, &mut rng, 24, NEW);
    for cfg in [
        sampling::SamplingConfig::greedy(),
        sampling::SamplingConfig::greedy().with_repetition_penalty(1.3),
    ] {
        let mut cache = target.new_cache();
        let plain: Vec<Token> = generate(&target, &mut cache, &prompt, gen_cfg(NEW, cfg.clone()))
            .unwrap()
            .map(|t| t.unwrap())
            .collect();
        let mut spec = SpeculativeDecoder::new(
            Box::new(DraftModel::new(load("qwen3_untied", KvCacheMode::Flat))),
            Some(3),
        );
        let mut cache = target.new_cache();
        let got: Vec<Token> = generate(&target, &mut cache, &prompt, gen_cfg(NEW, cfg.clone()))
            .unwrap()
            .with_speculator(&mut spec)
            .map(|t| t.unwrap())
            .collect();
        let ids = |v: &[Token]| v.iter().map(|t| t.id).collect::<Vec<_>>();
        assert_eq!(ids(&got), ids(&plain), "{cfg:?}");
        for (g, p) in got.iter().zip(&plain) {
            assert!(
                (g.logprob - p.logprob).abs() <= 1e-4 * p.logprob.abs().max(1.0),
                "{cfg:?}: log-prob {} against plain {}",
                g.logprob,
                p.logprob
            );
        }
    }
}

/// Adaptive depth keeps plain greedy decoding's tokens whatever it decides: random maximum
/// depths (1-6), catch-up windows (2-16) and drafting ahead (none, 2 forwards, until verified,
/// the draft's own thread, where the draft catches up during plain stretches), drafts lighter
/// than their targets (so adaptive depth asks them) over flat, paged and recurrent targets and
/// drafts. Pairs settle on plain decoding (stretches, probes and window restarts run).
#[test]
fn adaptive_identity_over_caches_windows_and_threads() {
    const N: usize = 48;
    let mut rng = Rng(43);
    let cases: Vec<(&str, KvCacheMode, Vec<&str>)> = vec![
        ("qwen3", KvCacheMode::Flat, vec!["qwen3_untied_q8g32", "llama_q4"]),
        ("qwen3", paged(4), vec!["lfm2_moe_q4", "qwen3_untied_q8g32"]),
        ("qwen3_5", KvCacheMode::Flat, vec!["lfm2", "qwen3"]),
        ("qwen3_5", paged(4), vec!["llama"]),
        // quantized drafts of their targets: drafts accepted now and then (on the CPU these
        // tiny pairs still settle on plain decoding, by their cycle times)
        ("qwen3_untied", paged(4), vec!["qwen3_untied_q8g32"]),
        ("lfm2_moe", KvCacheMode::Flat, vec!["lfm2_moe_q4"]),
    ];
    let mut settled_plain = 0;
    let mut failures = Vec::new();
    for (t, kv, drafts) in cases {
        let target = load(t, kv.clone());
        let len = rng.range(12, 30);
        let (prompt, want) = gapped_greedy(&target, &mut rng, len, N);
        for d in drafts {
            let (max, window) = (rng.range(1, 6), rng.range(2, 16));
            let ahead = match rng.range(0, 3) {
                0 => DraftAhead::Steps(0),
                1 => DraftAhead::Steps(2),
                2 => DraftAhead::UntilVerified,
                _ => DraftAhead::Background,
            };
            let label = format!("target {t} {kv:?}, draft {d}, adaptive up to {max}, window {window}, {ahead} ahead");
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let spec = SpeculativeDecoder::adaptive(Box::new(DraftModel::new(load(d, KvCacheMode::Flat))), Some(max));
                let mut spec = spec.with_catch_up_window(Some(window)).with_draft_ahead(ahead).unwrap();
                let (got, stats, offset) = run_spec(&target, &mut spec, &prompt, gen_cfg(N, sampling::SamplingConfig::greedy()));
                assert_eq!(got, want, "{label}");
                assert_eq!(offset, prompt.len() + N, "{label}: the cache holds the prompt and every token");
                eprintln!("{label}: {stats:?}");
                stats.depth_mean
            }));
            match run {
                Ok(depth) => settled_plain += usize::from(depth < 1.0),
                Err(e) => failures.push(format!("{label}: {}", panic_message(e))),
            }
        }
    }
    assert!(failures.is_empty(), "{} pair(s) failed:\n{}", failures.len(), failures.join("\n"));
    assert!(settled_plain > 0, "no pair settled on plain decoding: stretches were never exercised");
}
