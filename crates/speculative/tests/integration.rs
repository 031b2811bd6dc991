//! Speculative decoding inside `generate` and chat sessions: stop tokens, length, cancellation
//! and the cache left behind (it must hold exactly what plain decoding leaves, so a following
//! turn continues identically), the thinking-budget refusal, and drafter loading.
mod common;
use common::*;
use mlx_models::chat::ChatMessage;
use mlx_models::{
    generate, ChatConfig, ChatSession, FinishReason, GenerateConfig, KvCacheMode, LoadOptions,
    Model,
};
use mlx_speculative::{draft_kind, load_drafter, DraftAhead, DraftKind, DraftModel, SpeculativeDecoder};
use sampling::{SamplingConfig, SamplingOverrides};

fn cfg(n: usize, stop: Vec<u32>) -> GenerateConfig {
    GenerateConfig {
        stop_tokens: Some(stop),
        ..gen_cfg(n, SamplingConfig::greedy())
    }
}

/// Generate `n` tokens after `prompt`, then `m` more after `more`, on one cache; with or without
/// speculation. Returns both outputs, the finish reasons and the cache offset at the end.
fn two_calls(
    target: &Model,
    draft: Option<&Model>,
    prompt: &[u32],
    n: usize,
    stop: Vec<u32>,
    more: &[u32],
) -> (Vec<u32>, Option<FinishReason>, Vec<u32>, usize) {
    let mut spec =
        draft.map(|d| SpeculativeDecoder::new(Box::new(DraftModel::new(d.clone())), Some(4)));
    let mut cache = target.new_cache();
    let mut gen = generate(target, &mut cache, prompt, cfg(n, stop)).unwrap();
    if let Some(s) = spec.as_mut() {
        gen = gen.with_speculator(s);
    }
    let a: Vec<u32> = (&mut gen).map(|t| t.unwrap().id).collect();
    let reason = gen.finish_reason();
    let stop_tok = gen.stop_token();
    drop(gen);
    let held = prompt.len() + a.len() + usize::from(stop_tok.is_some());
    assert_eq!(
        cache.offset(),
        held,
        "the cache holds the prompt, the output and the stop token"
    );
    let mut gen = generate(target, &mut cache, more, cfg(12, vec![])).unwrap();
    if let Some(s) = spec.as_mut() {
        gen = gen.with_speculator(s);
    }
    let b: Vec<u32> = (&mut gen).map(|t| t.unwrap().id).collect();
    drop(gen);
    (a, reason, b, cache.offset())
}

#[test]
fn stop_length_and_continuation_match_plain_decoding() {
    let mut rng = Rng(3);
    for (t, d, kv) in [
        ("qwen3_untied", "qwen3_untied_q8g32", KvCacheMode::Flat),
        ("qwen3_untied", "qwen3_untied_q8g32", paged(4)),
        ("lfm2_moe", "lfm2_moe_q4", KvCacheMode::Flat),
    ] {
        let target = load(t, kv.clone());
        let draft = load(d, KvCacheMode::Flat);
        let prompt = gapped_prompt(&target, &mut rng, 12, 50);
        let plain = plain_greedy(&target, &prompt, 24);
        let more = [7u32, 8, 9];
        // a stop token in the middle of a cycle, at several places; and no stop (length)
        for stop in [vec![plain[6]], vec![plain[11]], vec![plain[17]], vec![]] {
            let want = two_calls(&target, None, &prompt, 24, stop.clone(), &more);
            let got = two_calls(&target, Some(&draft), &prompt, 24, stop.clone(), &more);
            assert_eq!(got, want, "{t} {kv:?}, stop {stop:?}");
        }
    }
}

#[test]
fn cancellation_leaves_the_handed_out_tokens_in_the_cache() {
    let target = load("qwen3_untied", KvCacheMode::Flat);
    let draft = load("qwen3_untied_q8g32", KvCacheMode::Flat);
    let prompt: Vec<u32> = (0..10).map(|i| 20 + i * 7).collect();
    let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(draft)), Some(5));
    let mut cache = target.new_cache();
    let mut gen = generate(&target, &mut cache, &prompt, cfg(30, vec![]))
        .unwrap()
        .with_speculator(&mut spec);
    let cancel = gen.cancel_handle();
    let mut got = Vec::new();
    for t in &mut gen {
        got.push(t.unwrap().id);
        if got.len() == 3 {
            cancel.cancel(); // mid-cycle: the cycle produced more than 3 tokens
        }
    }
    assert_eq!(gen.finish_reason(), Some(FinishReason::Cancelled));
    drop(gen);
    assert_eq!(got.len(), 3);
    assert_eq!(got, plain_greedy(&target, &prompt, 3));
    assert_eq!(cache.offset(), prompt.len() + 3);
}

#[test]
fn chat_sessions_decode_speculatively() {
    let dir = fixture("qwen3");
    let target = mlx_models::load_model(&dir, &LoadOptions::default())
        .unwrap()
        .into_lm()
        .unwrap();
    let ccfg = ChatConfig {
        max_new_tokens: 20,
        sampling: SamplingOverrides {
            temperature: Some(0.0),
            ..Default::default()
        },
        report_performance: true,
        ..Default::default()
    };
    let run = |spec: bool| {
        let mut s = ChatSession::new(target.clone()).unwrap();
        if spec {
            s.set_speculator(Some(Box::new(SpeculativeDecoder::new(
                Box::new(DraftModel::new(load("qwen3", KvCacheMode::Flat))),
                Some(3),
            ))));
        }
        let a = s
            .start(vec![ChatMessage::user("hello there")], &ccfg)
            .unwrap();
        let b = s.continue_with("and again", &ccfg).unwrap();
        let perf = b.performance.clone().unwrap();
        assert_eq!(perf.speculative.is_some(), spec);
        if spec {
            // a thinking budget forces tokens: refused while speculating
            let with_budget = ChatConfig {
                thinking_token_budget: Some(4),
                ..ccfg.clone()
            };
            assert!(s.continue_with("more", &with_budget).is_err());
        }
        (a.text, b.text, s.cached_ids().to_vec())
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn drafter_kinds_from_config() {
    let tmp = std::env::temp_dir().join(format!("spec-kinds-{}", std::process::id()));
    for (name, json, kind) in [
        (
            "assistant",
            r#"{"model_type": "gemma4_assistant"}"#,
            DraftKind::Gemma4Assistant,
        ),
        (
            "dspark",
            r#"{"model_type": "gemma4", "architectures": ["Gemma4DSparkModel"]}"#,
            DraftKind::DSpark,
        ),
        (
            "dflash",
            r#"{"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}"#,
            DraftKind::DFlash,
        ),
    ] {
        let d = tmp.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), json).unwrap();
        assert_eq!(draft_kind(&d).unwrap(), kind);
        let e = load_drafter(&d, &LoadOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("load_drafter_for"), "{e}");
    }
    std::fs::remove_dir_all(&tmp).unwrap();
    assert_eq!(draft_kind(&fixture("qwen3")).unwrap(), DraftKind::Model);
    assert!(load_drafter(&fixture("qwen3"), &LoadOptions::default()).is_ok());
    assert!(draft_kind(&fixture("does-not-exist")).is_err());
}

/// Adaptive depth: with a draft that never agrees the policy falls back to plain steps (depth
/// 0) after exploring; the output stays the plain greedy output. (The 8-bit draft of another
/// random model stores fewer bytes than the target: the weight gate lets it be tried.)
#[test]
fn adaptive_depth_turns_a_useless_draft_off() {
    let target = load("qwen3", KvCacheMode::Flat);
    let mut rng = Rng(8);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 10, 48);
    let mut spec = SpeculativeDecoder::adaptive(
        Box::new(DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat))),
        Some(6),
    );
    let (got, st, _) = run_spec(&target, &mut spec, &prompt, cfg(48, vec![]));
    assert_eq!(got, want);
    eprintln!("adaptive, useless draft: {st:?}");
    assert_eq!(st.accepted_mean, 0.0);
    // 2 exploring cycles of 6 drafts, then plain steps and a depth-1 probe every 16 cycles
    assert!(st.depth_mean < 1.0, "mean depth {} (max 6)", st.depth_mean);
}

/// With a catch-up window, a draft model that skipped more than the window in a plain stretch
/// starts over from the window: adaptive depth with a useless draft (probes after stretches of
/// 16 cycles and more) keeps plain decoding's tokens, and the draft restarts, on the decoder's
/// thread and on its own (where it catches up during the stretches). A flat Qwen3 target with
/// a quantized draft, and a paged Qwen3.5 one (recurrent layers) with a recurrent draft (LFM2's
/// conv state: rolled back from a snapshot, not trimmed).
#[test]
fn adaptive_depth_with_a_catch_up_window_keeps_the_output() {
    use std::sync::{Arc, Mutex};
    let mut rng = Rng(8);
    for (t, kv, draft) in [("qwen3", KvCacheMode::Flat, "qwen3_untied_q8g32"), ("qwen3_5", paged(4), "lfm2")] {
        let target = load(t, kv.clone());
        let (prompt, want) = gapped_greedy(&target, &mut rng, 10, 48);
        // on this thread, and on the draft's own (skipped stretches and proposals cross to it)
        for ahead in [DraftAhead::Steps(0), DraftAhead::Background] {
            let label = format!("{t} {kv:?}, {draft}, {ahead}");
            let d = Arc::new(Mutex::new(DraftModel::new(load(draft, KvCacheMode::Flat))));
            let spec = SpeculativeDecoder::adaptive(Box::new(Shared(d.clone())), Some(6)).with_catch_up_window(Some(4));
            let mut spec = spec.with_draft_ahead(ahead).unwrap();
            // warmed up as on a GPU (on the draft's thread: a probe's first draft forward too)
            spec.warm_up(&target).unwrap();
            let warm = d.lock().unwrap().proposals();
            let cycles = 5 + SpeculativeDecoder::WARM_UP_CYCLES + usize::from(ahead == DraftAhead::Background);
            assert_eq!(warm, cycles, "{label}: a cycle per depth, the deepest's as in a generation (and a probe's on the thread)");
            let (got, st, _) = run_spec(&target, &mut spec, &prompt, cfg(48, vec![]));
            assert_eq!(got, want, "{label}");
            assert!(st.depth_mean < 1.0, "{label}: {st:?}");
            assert!(d.lock().unwrap().restarts() > 0, "{label}: {st:?}");
            // on its own thread the draft runs the stretches' last tokens beside the target's steps
            let caught_up = d.lock().unwrap().caught_up();
            assert_eq!(caught_up > 0, ahead == DraftAhead::Background, "{label}: {caught_up} tokens caught up in stretches");
            // a second generation with the same decoder starts from the whole prompt again
            let (got, _, _) = run_spec(&target, &mut spec, &prompt, cfg(48, vec![]));
            assert_eq!(got, want, "{label}");
        }
    }
}

/// A draft model recording the depth of each proposal, its weight unknown (adaptive depth then
/// asks a self-draft), and with `agreement_fails` an error for its agreement.
struct Recorded {
    inner: DraftModel,
    depths: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
    agreement_fails: bool,
}

impl mlx_speculative::Drafter for Recorded {
    mlx_speculative::forward_drafter!(inner; except propose, propose_on, agreement, weight_bytes);
    fn propose(&mut self, history: &[u32], k: usize, s: &SamplingConfig) -> mlx_models::Result<mlx_speculative::Draft> {
        self.depths.lock().unwrap().push(k);
        self.inner.propose(history, k, s)
    }
    fn propose_on(&mut self, history: &[u32], k: usize, s: &SamplingConfig, target: &mut mlx_models::Cache) -> mlx_models::Result<mlx_speculative::Draft> {
        self.depths.lock().unwrap().push(k);
        self.inner.propose_on(history, k, s, target)
    }
    fn agreement(&mut self) -> mlx_models::Result<Vec<mlx_speculative::Agreed>> {
        if self.agreement_fails {
            return Err(mlx_models::ModelError::Worker("no agreement today".into()));
        }
        self.inner.agreement()
    }
    fn weight_bytes(&self) -> Option<u64> {
        None
    }
}

/// With adaptive depth and the draft model on its own thread, a generation opens with a plain
/// stretch during which the draft catches up and measures its agreement: a self-draft (its
/// weights not weighed against the target's, so that adaptive depth asks it) then drafts the
/// maximum depth from its first proposal, where on the decoder's thread its first proposal is
/// one draft; a draft agreeing nowhere is never asked to draft. Output is plain greedy
/// decoding's.
#[test]
fn an_opening_stretch_decides_exploring_on_the_drafts_thread() {
    use std::sync::{Arc, Mutex};
    let mut rng = Rng(45);
    let target = load("qwen3", KvCacheMode::Flat);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 10, 64);
    for (draft, ahead) in [("qwen3", DraftAhead::Background), ("qwen3", DraftAhead::Steps(0)), ("qwen3_untied_q8g32", DraftAhead::Background)] {
        let label = format!("{draft}, {ahead}");
        let depths = Arc::new(Mutex::new(Vec::new()));
        let d = Recorded { inner: DraftModel::new(load(draft, KvCacheMode::Flat)), depths: depths.clone(), agreement_fails: false };
        let mut spec = SpeculativeDecoder::adaptive(Box::new(d), Some(4)).with_draft_ahead(ahead).unwrap();
        let (got, st, _) = run_spec(&target, &mut spec, &prompt, cfg(64, vec![]));
        assert_eq!(got, want, "{label}");
        let depths = depths.lock().unwrap().clone();
        match (draft, ahead) {
            ("qwen3", DraftAhead::Background) => {
                assert_eq!(depths.first(), Some(&4), "{label}: {depths:?}");
                assert!(st.acceptance_by_position.iter().all(|&a| a == 1.0), "{label}: {st:?}");
            }
            ("qwen3", _) => assert_eq!(depths.first(), Some(&mlx_speculative::Adaptive::FIRST_DEPTH), "{label}: {depths:?}"),
            _ => {
                assert!(depths.is_empty(), "{label}: {depths:?}");
                assert_eq!((st.cycles, st.depth_mean), (64 - 1, 0.0), "{label}: {st:?}");
            }
        }
    }
}

/// A [`Recorded`] draft whose agreement keeps only the greedy guesses (no log-probs), as the
/// decoder weighed agreement before temperature > 0 took the draft's log-probs into account.
struct GuessesOnly(Recorded);

impl mlx_speculative::Drafter for GuessesOnly {
    mlx_speculative::forward_drafter!(0; except agreement);
    fn agreement(&mut self) -> mlx_models::Result<Vec<mlx_speculative::Agreed>> {
        let mut agreed = self.0.agreement()?;
        for a in &mut agreed {
            a.logprob = None;
        }
        Ok(agreed)
    }
}

/// At temperature > 0 the opening stretch's agreement weighs the draft's log-prob of each
/// sampled token against the target's: a self-draft (q = p, every draft accepted by rejection
/// sampling) then explores at the maximum depth from its first proposal, where its greedy
/// guesses alone (the tiny model at temperature 4: the sampled token is rarely the argmax)
/// leave it out of the opening.
#[test]
fn at_temperature_above_zero_the_opening_weighs_the_drafts_log_probs() {
    use std::sync::{Arc, Mutex};
    let mut rng = Rng(47);
    let target = load("qwen3", KvCacheMode::Flat);
    let prompt = rng.tokens(10, target.info().vocab_size);
    let sampled = SamplingConfig { temperature: 4.0, seed: Some(11), ..SamplingConfig::greedy() };
    for log_probs in [true, false] {
        let depths = Arc::new(Mutex::new(Vec::new()));
        let d = Recorded { inner: DraftModel::new(load("qwen3", KvCacheMode::Flat)), depths: depths.clone(), agreement_fails: false };
        let d: Box<dyn mlx_speculative::Drafter> = if log_probs { Box::new(d) } else { Box::new(GuessesOnly(d)) };
        let mut spec = SpeculativeDecoder::adaptive(d, Some(4)).with_draft_ahead(DraftAhead::Background).unwrap();
        let (got, st, _) = run_spec(&target, &mut spec, &prompt, gen_cfg(40, sampled.clone()));
        assert_eq!(got.len(), 40);
        let depths = depths.lock().unwrap().clone();
        if log_probs {
            assert_eq!(depths.first(), Some(&4), "with log-probs: {depths:?} {st:?}");
        } else {
            assert_ne!(depths.first(), Some(&4), "guesses only: {depths:?} {st:?}");
        }
    }
}

/// A drafter whose agreement cannot be read (its thread fails) ends the generation with that
/// error, typed, at the cycle after the opening stretch: the tokens before it are plain greedy
/// decoding's.
#[test]
fn an_agreement_that_fails_ends_the_generation_with_its_error() {
    let mut rng = Rng(46);
    let target = load("qwen3", KvCacheMode::Flat);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 10, 24);
    let d = Recorded { inner: DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat)), depths: Default::default(), agreement_fails: true };
    let mut spec = SpeculativeDecoder::adaptive(Box::new(d), Some(4)).with_draft_ahead(DraftAhead::Background).unwrap();
    let mut cache = target.new_cache();
    let gen = generate(&target, &mut cache, &prompt, cfg(24, vec![])).unwrap().with_speculator(&mut spec);
    let mut got = Vec::new();
    let mut error = None;
    for t in gen {
        match t {
            Ok(t) => got.push(t.id),
            Err(e) => {
                error = Some(e.to_string());
                break;
            }
        }
    }
    let e = error.expect("the generation reports the drafter's error");
    assert!(e.contains("no agreement today"), "{e}");
    // the first token and the opening stretch
    assert_eq!(got, want[..1 + mlx_speculative::Adaptive::OPENING], "{e}");
}

/// [`Drafter::skipped`]: a draft model lacking at most the window catches up; lacking more, its
/// next proposal is a fresh drafter's on the window alone (the history's last `window` tokens),
/// and later ones continue that context; a new history (a new generation) starts over from
/// its beginning. Flat and paged draft caches, and a recurrent draft (LFM2's conv state: its
/// rollback to the window's start restores a snapshot, and the window's context goes on).
#[test]
fn a_draft_model_skipping_a_stretch_restarts_from_the_window() {
    use mlx_speculative::Drafter;
    let greedy = SamplingConfig::greedy();
    let mut rng = Rng(34);
    for (name, kv) in [("qwen3", KvCacheMode::Flat), ("qwen3", paged(4)), ("lfm2", KvCacheMode::Flat)] {
        let model = load(name, kv.clone());
        let vocab = model.info().vocab_size;
        let mut toks = |n: usize| rng.tokens(n, vocab);
        let fresh = |h: &[u32]| DraftModel::new(model.clone()).propose(h, 3, &greedy).unwrap().tokens;
        let mut a = DraftModel::new(model.clone());
        let mut history = toks(20);
        a.propose(&history, 3, &greedy).unwrap();
        // a stretch of 6 within a window of 8: caught up
        history.extend(toks(6));
        a.skipped(&history, 8);
        assert_eq!(a.propose(&history, 3, &greedy).unwrap().tokens, fresh(&history), "{name} {kv:?}");
        assert_eq!(a.restarts(), 0, "{name} {kv:?}");
        // a stretch of 12: the last 8 tokens only
        history.extend(toks(12));
        a.skipped(&history, 8);
        let from = history.len() - 8;
        let drafts = a.propose(&history, 3, &greedy).unwrap().tokens;
        assert_eq!(drafts, fresh(&history[from..]), "{name} {kv:?}");
        assert_ne!(drafts, fresh(&history), "{name} {kv:?}: the window must draft differently here");
        assert_eq!(a.restarts(), 1, "{name} {kv:?}");
        // one draft accepted and the target's own token (a recurrent draft rolls its second
        // back from the snapshot at the window's start): the window's context goes on
        history.extend_from_slice(&drafts[..1]);
        history.extend(toks(1));
        assert_eq!(a.propose(&history, 3, &greedy).unwrap().tokens, fresh(&history[from..]), "{name} {kv:?}");
        // a new generation, longer than the window's start: its whole history
        let other = toks(60);
        assert_eq!(a.propose(&other, 3, &greedy).unwrap().tokens, fresh(&other), "{name} {kv:?}");
        assert_eq!(a.restarts(), 1, "{name} {kv:?}");
    }
}

/// [`Drafter::catch_up`] during a plain stretch (as the decoder asks it of a drafter on its own
/// thread: every few tokens of the window's part the stretch has produced, the last with a few
/// tokens to come) leaves the probe after the stretch drafting what catching up at the probe
/// does: the same tokens and draft probabilities, and a context started over at the same
/// place, with only the tokens since the last catch-up left to run. Flat and paged draft
/// caches; stretches within the window and longer; a window of 1 token runs nothing.
#[test]
fn catching_up_during_a_stretch_drafts_what_the_probe_would() {
    use mlx_speculative::Drafter;
    let sampling = SamplingConfig { temperature: 1.0, seed: Some(4), ..SamplingConfig::greedy() };
    let mut rng = Rng(38);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let model = load("qwen3", kv.clone());
        let vocab = model.info().vocab_size;
        let (mut during, mut after) = (DraftModel::new(model.clone()), DraftModel::new(model.clone()));
        let mut history = rng.tokens(20, vocab);
        for d in [&mut during, &mut after] {
            d.propose(&history, 3, &sampling).unwrap();
        }
        let (window, every, lead) = (12, 4, 3);
        for (stretch, restarts) in [(10, 0), (30, 1), (7, 1)] {
            let label = format!("{kv:?}, a stretch of {stretch}");
            let base = history.len();
            history.extend(rng.tokens(stretch, vocab));
            let before = during.caught_up();
            // the decoder's calls: `left` tokens to come, within the window, every 4
            for left in (1..stretch).rev().filter(|l| l % every == lead && *l < window) {
                during.catch_up(&history[..base + stretch - left], window - left, &sampling).unwrap();
            }
            for d in [&mut during, &mut after] {
                d.skipped(&history, window);
            }
            let fed = during.caught_up() - before;
            // the window but the last catch-up's lead and the newest token (the probe runs them)
            assert_eq!(fed + lead + 1, stretch.min(window), "{label}");
            let (a, b) = (during.propose(&history, 3, &sampling).unwrap(), after.propose(&history, 3, &sampling).unwrap());
            assert_eq!(a.tokens, b.tokens, "{label}");
            let r = rel(&a.logprobs.unwrap().exp().unwrap(), &b.logprobs.unwrap().exp().unwrap());
            assert!(r < 1e-5, "{label}: draft probabilities differ by {r}");
            assert_eq!((during.restarts(), after.restarts()), (restarts, restarts), "{label}");
            history.extend_from_slice(&a.tokens[..1]);
        }
        // a window of 1 token (the stretch's last to come): nothing to run from it
        let before = (during.caught_up(), during.cache().offset());
        history.extend(rng.tokens(40, vocab));
        during.catch_up(&history, 1, &sampling).unwrap();
        assert_eq!((during.caught_up(), during.cache().offset()), before, "{kv:?}");
    }
}

/// [`Drafter::catch_up`] at random cadences (windows of 2-20 tokens, a catch-up every 1 to
/// half the window, the last 0 to `every - 1` tokens before the stretch's end, as the decoder
/// places them) over random stretches, each probe's drafts partly accepted: the probes draft
/// what catching up at the probe does and restart at the same places. Flat and paged draft
/// caches, and a recurrent draft (LFM2's conv state, rolled back from snapshots).
#[test]
fn catching_up_at_random_cadences_drafts_what_the_probe_would() {
    use mlx_speculative::Drafter;
    let sampling = SamplingConfig { temperature: 1.0, seed: Some(6), ..SamplingConfig::greedy() };
    let mut rng = Rng(41);
    for (name, kv) in [("qwen3", KvCacheMode::Flat), ("qwen3", paged(4)), ("lfm2", KvCacheMode::Flat)] {
        let model = load(name, kv.clone());
        let vocab = model.info().vocab_size;
        let (mut during, mut after) = (DraftModel::new(model.clone()), DraftModel::new(model.clone()));
        let n = rng.range(4, 20);
        let mut history = rng.tokens(n, vocab);
        for round in 0..6 {
            let (window, stretch) = (rng.range(2, 20), rng.range(1, 40));
            let every = rng.range(1, (window / 2).max(1));
            let lead = rng.range(0, every - 1);
            let label = format!("{name} {kv:?}, round {round}: a stretch of {stretch}, window {window}, every {every}, lead {lead}");
            let a = during.propose(&history, 3, &sampling).unwrap();
            let b = after.propose(&history, 3, &sampling).unwrap();
            assert_eq!(a.tokens, b.tokens, "{label}: the proposal before the stretch");
            // some drafts accepted, then the target's own token, then the stretch
            let accepted = rng.range(0, 3);
            history.extend_from_slice(&a.tokens[..accepted]);
            history.extend(rng.tokens(1, vocab));
            let base = history.len();
            history.extend(rng.tokens(stretch, vocab));
            for left in (1..stretch).rev().filter(|l| l % every == lead % every && *l < window) {
                during.catch_up(&history[..base + stretch - left], window - left, &sampling).unwrap();
            }
            for d in [&mut during, &mut after] {
                d.skipped(&history, window);
            }
            let (a, b) = (during.propose(&history, 3, &sampling).unwrap(), after.propose(&history, 3, &sampling).unwrap());
            assert_eq!(a.tokens, b.tokens, "{label}");
            let r = rel(&a.logprobs.unwrap().exp().unwrap(), &b.logprobs.unwrap().exp().unwrap());
            assert!(r < 1e-5, "{label}: draft probabilities differ by {r}");
            assert_eq!(during.restarts(), after.restarts(), "{label}");
            history.extend_from_slice(&a.tokens[..1]);
        }
        assert!(during.caught_up() > 0, "{name} {kv:?}");
    }
}

/// [`Drafter::agreement`]: after catch-ups over a stretch (at the decoder's cadence, in pieces
/// and whole), whether the draft's greedy guess after each caught-up token was the next one, as
/// the draft model's own forward over the whole history says. The stretch is the draft's own
/// greedy continuation (agreed throughout), then random tokens; flat and paged caches and a
/// recurrent draft. Asking again gives nothing new, and a new prefill forgets what was measured.
/// At temperature > 0 each caught-up token also carries the draft's log-prob of the next one
/// under the processed distribution (temperature, top-k and a repetition penalty that reads
/// each row's history), as the sampler's own distribution over the whole-history forward gives
/// it, within 1e-5.
#[test]
fn catching_up_measures_the_drafts_agreement() {
    use mlx_models::Logits;
    use mlx_speculative::Drafter;
    let mut rng = Rng(44);
    for (name, kv) in [("qwen3", KvCacheMode::Flat), ("qwen3", paged(4)), ("lfm2", KvCacheMode::Flat)] {
        let model = load(name, kv.clone());
        let vocab = model.info().vocab_size;
        let (prompt, own) = gapped_greedy(&model, &mut rng, 10, 12);
        let mut history = prompt.clone();
        history.extend_from_slice(&own);
        history.extend(rng.tokens(14, vocab));
        for pieces in [None, Some(3)] {
            let label = format!("{name} {kv:?}, pieces {pieces:?}");
            let mut d = DraftModel::new(model.clone()).with_catch_up_pieces(pieces);
            d.prefill(&prompt).unwrap();
            // every 5 tokens of the stretch, the last with 2 to come
            let cuts: Vec<usize> = (prompt.len() + 2..history.len() - 2).step_by(5).collect();
            for &cut in &cuts {
                d.catch_up(&history[..cut], 64, &SamplingConfig::greedy()).unwrap();
            }
            let measured = d.agreement().unwrap();
            assert!(measured.iter().all(|a| a.logprob.is_none()), "{label}: greedy catch-ups note no log-probs");
            let agreed: Vec<bool> = measured.iter().map(|a| a.guessed).collect();
            // the tokens from the prompt's end to the last catch-up's but its newest
            let last = *cuts.last().unwrap();
            assert_eq!(agreed.len(), last - 1 - prompt.len(), "{label}");
            let mut cache = model.new_cache();
            let logits = model
                .forward(&mlx_array::Array::from_slice(&history[..last - 1], &[1, last - 1]).unwrap(), &mut cache, Logits::All, false)
                .unwrap()
                .logits
                .unwrap();
            let guesses = ids(&logits.reshape(&[(last - 1) as i32, -1]).unwrap().argmax(-1, false).unwrap());
            let want: Vec<bool> = (prompt.len()..last - 1).map(|p| guesses[p] == history[p + 1]).collect();
            assert_eq!(agreed, want, "{label}");
            // the draft's own greedy tokens agree, the random ones mostly not
            assert!(agreed[..own.len() - 1].iter().all(|&a| a), "{label}: {agreed:?}");
            assert!(agreed[own.len()..].iter().filter(|&&a| a).count() < 3, "{label}: {agreed:?}");
            assert!(d.agreement().unwrap().is_empty(), "{label}: asked again");
            d.catch_up(&history, 64, &SamplingConfig::greedy()).unwrap();
            d.prefill(&history[..5]).unwrap();
            assert!(d.agreement().unwrap().is_empty(), "{label}: after a new prefill");

            // at temperature > 0: the processed log-prob of each next token
            let sampled = SamplingConfig { temperature: 0.7, top_k: 40, repetition_penalty: 1.3, seed: Some(3), ..SamplingConfig::greedy() };
            let mut d = DraftModel::new(model.clone()).with_catch_up_pieces(pieces);
            d.prefill(&prompt).unwrap();
            for &cut in &cuts {
                d.catch_up(&history[..cut], 64, &sampled).unwrap();
            }
            let measured = d.agreement().unwrap();
            assert_eq!(measured.iter().map(|a| (a.position, a.guessed)).collect::<Vec<_>>(), (prompt.len() + 1..last).zip(want.iter().copied()).collect::<Vec<_>>(), "{label}");
            let sampler = sampling::Sampler::new(sampled.clone()).unwrap();
            let rows = logits.reshape(&[(last - 1) as i32, -1]).unwrap();
            for a in &measured {
                let row = rows.slice_axis(0, a.position - 1, a.position).unwrap();
                let lp = sampler.distribution(&row, &[&history[..a.position]]).unwrap().to_vec_f32().unwrap();
                let want = lp[history[a.position] as usize];
                let got = a.logprob.unwrap_or(f32::NAN);
                let close = (got == want) || (got - want).abs() <= 1e-5 * want.abs().max(1.0);
                assert!(close, "{label}: position {}: log q {got} against {want}", a.position);
            }
            assert!(measured.iter().any(|a| a.logprob.is_some_and(f32::is_finite)), "{label}: some next token within the top 40");
        }
    }
}

/// A draft model's catching up in pieces (as on a GPU) drafts what catching up in one forward
/// does: the same draft distributions (within f32 rounding of attention split over pieces) and
/// tokens, for the opening catch-up over a whole prompt and for one over a long gap of tokens
/// it never drafted (a plain stretch), on the flat and the paged cache.
#[test]
fn catching_up_in_pieces_drafts_the_same() {
    use mlx_speculative::Drafter;
    let mut rng = Rng(21);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let model = load("qwen3", kv.clone());
        let vocab = model.info().vocab_size;
        let history: Vec<u32> = rng.tokens(70, vocab);
        let sampling = SamplingConfig {
            temperature: 1.0,
            seed: Some(5),
            ..SamplingConfig::greedy()
        };
        let mut whole = DraftModel::new(model.clone()).with_catch_up_pieces(None);
        let mut pieces = DraftModel::new(model.clone()).with_catch_up_pieces(Some(6));
        // the prompt's 30 tokens, then 37 more after a gap (its last draft never fed)
        for end in [30, 67, 70] {
            let a = whole.propose(&history[..end], 3, &sampling).unwrap();
            let b = pieces.propose(&history[..end], 3, &sampling).unwrap();
            let (la, lb) = (a.logprobs.unwrap(), b.logprobs.unwrap());
            let r = rel(&la.exp().unwrap(), &lb.exp().unwrap());
            assert!(r < 1e-5, "{kv:?}, history of {end}: draft probabilities differ by {r}");
            assert_eq!(a.tokens, b.tokens, "{kv:?}, history of {end}");
        }
    }
}

/// `warm_up` runs cycles on a throwaway cache and leaves the decoder as `start` does: the
/// generation after it gives plain greedy decoding's tokens and, at a fixed depth, the same
/// counters as without it (flat and paged targets; adaptive depth warms every depth).
#[test]
fn warming_up_changes_no_output() {
    let mut rng = Rng(12);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let target = load("qwen3_untied", kv.clone());
        let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 30);
        let cold = {
            let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat))), Some(4));
            check_identity(&target, &mut spec, &prompt, &want, &format!("{kv:?} cold"))
        };
        let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat))), Some(4));
        spec.warm_up(&target).unwrap();
        let warm = check_identity(&target, &mut spec, &prompt, &want, &format!("{kv:?} warmed up"));
        assert_eq!((warm.cycles, warm.accepted_mean, warm.depth_mean), (cold.cycles, cold.accepted_mean, cold.depth_mean), "{kv:?}");
        assert_eq!(warm.acceptance_by_position, cold.acceptance_by_position, "{kv:?}");
        let mut adaptive = SpeculativeDecoder::adaptive(Box::new(DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat))), Some(4));
        adaptive.warm_up(&target).unwrap();
        assert!(matches!(adaptive.depth(), mlx_speculative::Depth::Adaptive(4)), "{kv:?}: the depth setting is restored");
        let (got, _, offset) = run_spec(&target, &mut adaptive, &prompt, gen_cfg(want.len(), SamplingConfig::greedy()));
        assert_eq!(got, want, "{kv:?} adaptive, warmed up");
        assert_eq!(offset, prompt.len() + want.len());
    }
}

/// At a fixed depth `warm_up` runs [`SpeculativeDecoder::with_warm_up_cycles`] cycles (at
/// least one) one after another, as a generation does: each drafts from the history the one
/// before grew, starting from the drafts it ran ahead. The generation after it is plain greedy decoding's.
#[test]
fn warming_up_runs_its_cycles_one_after_another() {
    use std::sync::{Arc, Mutex};
    let mut rng = Rng(47);
    let target = load("qwen3", KvCacheMode::Flat);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 10, 20);
    for (cycles, proposals) in [(0, 1), (1, 1), (5, 5)] {
        let draft = Arc::new(Mutex::new(DraftModel::new(load("qwen3", KvCacheMode::Flat))));
        let mut spec = SpeculativeDecoder::new(Box::new(Shared(draft.clone())), Some(3))
            .with_draft_ahead(DraftAhead::Steps(4))
            .unwrap()
            .with_warm_up_cycles(cycles);
        spec.warm_up(&target).unwrap();
        let (made, reused, held) = {
            let d = draft.lock().unwrap();
            (d.proposals(), d.reused_drafts(), d.cache().offset())
        };
        assert_eq!(made, proposals, "{cycles} cycles asked");
        // a self-draft's every draft is accepted: each cycle adds 4 tokens to the history the
        // next one drafts from
        let grown = SpeculativeDecoder::WARM_UP_PROMPT + 4 * (proposals - 1);
        assert!(held >= grown, "{cycles} cycles asked: the draft holds {held} positions, under {grown}");
        if proposals == 1 {
            assert_eq!(reused, 0, "{cycles} cycles asked");
        } else {
            assert!(reused > 0, "{cycles} cycles asked: no cycle started from drafts run ahead");
        }
        check_identity(&target, &mut spec, &prompt, &want, &format!("after {cycles} warm-up cycles"));
    }
}

/// A [`DraftModel`] the test keeps a handle on, to read its counters after a generation. Every
/// method is passed on under the lock but `target_taps` (a slice the lock cannot lend; a draft
/// model has none).
struct Shared(std::sync::Arc<std::sync::Mutex<DraftModel>>);

impl mlx_speculative::Drafter for Shared {
    mlx_speculative::forward_drafter!(lock 0; except target_taps);
    fn target_taps(&self) -> &[usize] {
        &[] // a draft model reads none of the target's layers
    }
}

/// [`Drafter::reserve`]: a draft model's flat cache is allocated once for the positions asked
/// ([`mlx_models::kv::flat_capacity`]) and drafts as an unreserved one does (same tokens and
/// draft probabilities through growth past 256 positions); a generation asks its speculator
/// for what it sized the target's flat cache for (prompt + new tokens + 32).
#[test]
fn a_draft_cache_is_sized_as_the_generation_asks() {
    use mlx_models::kv::flat_capacity;
    use mlx_speculative::Drafter;
    use std::sync::{Arc, Mutex};
    let capacity = |d: &DraftModel| d.cache().arrays()[0].dim(2).unwrap();
    let sampling = SamplingConfig { temperature: 1.0, seed: Some(9), ..SamplingConfig::greedy() };
    let mut rng = Rng(35);
    let model = load("qwen3", KvCacheMode::Flat);
    let vocab = model.info().vocab_size;
    let history: Vec<u32> = rng.tokens(300, vocab);
    let (mut plain, mut reserved) = (DraftModel::new(model.clone()), DraftModel::new(model.clone()));
    reserved.reserve(600);
    for end in [20, 21, 200, 260, 300] {
        let a = plain.propose(&history[..end], 3, &sampling).unwrap();
        let b = reserved.propose(&history[..end], 3, &sampling).unwrap();
        assert_eq!(a.tokens, b.tokens, "history of {end}");
        let r = rel(&a.logprobs.unwrap().exp().unwrap(), &b.logprobs.unwrap().exp().unwrap());
        assert!(r < 1e-6, "history of {end}: draft probabilities differ by {r}");
        assert_eq!(capacity(&reserved), flat_capacity(600), "history of {end}: one allocation for 600 positions");
        // unreserved: a first step's storage, then grown for what it holds
        let first = flat_capacity(1);
        assert_eq!(capacity(&plain), if end + 2 <= first { first } else { flat_capacity(end + 2) }, "history of {end}");
    }
    // through a generation: 12 prompt tokens and up to 300 new ones (344 positions: `flat_capacity(344)`, 520)
    let target = load("qwen3_untied", KvCacheMode::Flat);
    let d = Arc::new(Mutex::new(DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat))));
    let mut spec = SpeculativeDecoder::new(Box::new(Shared(d.clone())), Some(3));
    let prompt: Vec<u32> = rng.tokens(12, vocab);
    let mut cache = target.new_cache();
    let gen = generate(&target, &mut cache, &prompt, gen_cfg(300, SamplingConfig::greedy())).unwrap().with_speculator(&mut spec);
    let got = gen.take(10).map(|t| t.unwrap().id).count();
    assert_eq!(got, 10);
    assert_eq!(capacity(&d.lock().unwrap()), flat_capacity(344), "the draft's cache is sized for the generation");
}

/// [`Drafter::prefill`]: a draft model that ran the prompt with the target (whole, or in
/// catch-up pieces of 4) proposes what one that catches up in its first proposal does (same
/// tokens, draft probabilities within 1e-5 at temperature 1), and a generation has the draft run
/// the prompt before its first cycle. A token outside the draft's vocabulary is a typed error.
#[test]
fn a_draft_model_runs_the_prompt_with_the_target() {
    use mlx_speculative::Drafter;
    use std::sync::{Arc, Mutex};
    let sampling = SamplingConfig { temperature: 1.0, seed: Some(4), ..SamplingConfig::greedy() };
    let mut rng = Rng(36);
    let model = load("qwen3", KvCacheMode::Flat);
    let vocab = model.info().vocab_size;
    let history: Vec<u32> = rng.tokens(40, vocab);
    for pieces in [None, Some(4)] {
        for n in [1, 13, 39] {
            let label = format!("{n} prompt tokens, pieces {pieces:?}");
            let mut ran = DraftModel::new(model.clone()).with_catch_up_pieces(pieces);
            ran.prefill(&history[..n]).unwrap();
            assert_eq!(ran.cache().offset(), n, "{label}: the prompt is in the draft's cache");
            let mut late = DraftModel::new(model.clone()).with_catch_up_pieces(pieces);
            let a = ran.propose(&history[..n + 1], 3, &sampling).unwrap();
            let b = late.propose(&history[..n + 1], 3, &sampling).unwrap();
            assert_eq!(a.tokens, b.tokens, "{label}");
            let r = rel(&a.logprobs.unwrap().exp().unwrap(), &b.logprobs.unwrap().exp().unwrap());
            assert!(r < 1e-5, "{label}: draft probabilities differ by {r}");
        }
    }
    let mut d = DraftModel::new(model.clone());
    let err = d.prefill(&[1, vocab as u32]).unwrap_err();
    assert!(matches!(err, mlx_models::ModelError::InvalidInput(_)), "{err}");
    // through a generation: the draft holds the prompt when the first token is handed out
    let target = load("qwen3_untied", KvCacheMode::Flat);
    let d = Arc::new(Mutex::new(DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat))));
    let mut spec = SpeculativeDecoder::new(Box::new(Shared(d.clone())), Some(3));
    let prompt = &history[..17];
    let mut cache = target.new_cache();
    let mut gen = generate(&target, &mut cache, prompt, gen_cfg(20, SamplingConfig::greedy())).unwrap().with_speculator(&mut spec);
    gen.next().unwrap().unwrap();
    assert_eq!(d.lock().unwrap().cache().offset(), prompt.len(), "the draft ran the prompt before its first cycle");
    assert_eq!(d.lock().unwrap().proposals(), 0);
}

/// Drafting ahead (the GPU default) changes no output: greedy tokens equal plain decoding's on
/// flat and paged caches, at depths 1, 3 and 5 with 1 and 3 forwards ahead, for a self-draft
/// (every guess holds, so guesses become drafts: at depth 1 with 3 ahead whole cycles run no
/// draft forward) and a quantized draft (rejections roll the guesses back). A recurrent draft
/// (Qwen3.5's GatedDeltaNet layers cannot trim) does not run ahead.
#[test]
fn drafting_ahead_changes_no_output() {
    use std::sync::{Arc, Mutex};
    let mut rng = Rng(31);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let target = load("qwen3_untied", kv.clone());
        let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 30);
        for draft in ["qwen3_untied", "qwen3_untied_q8g32"] {
            for depth in [1, 3, 5] {
                for ahead in [1, 3] {
                    let d = Arc::new(Mutex::new(DraftModel::new(load(draft, kv.clone()))));
                    let mut spec = SpeculativeDecoder::new(Box::new(Shared(d.clone())), Some(depth)).with_draft_ahead(DraftAhead::Steps(ahead)).unwrap();
                    let label = format!("{kv:?} {draft} depth {depth}, {ahead} ahead");
                    let st = check_identity(&target, &mut spec, &prompt, &want, &label);
                    let reused = d.lock().unwrap().reused_drafts();
                    if draft == "qwen3_untied" {
                        assert!(st.acceptance_by_position.iter().all(|&a| a == 1.0), "{label}: a self-draft is always accepted");
                        // none in the first cycle, nor in the last (a plain step for the last token)
                        assert!(reused >= st.cycles.saturating_sub(2) * (ahead - 1).min(depth), "{label}: {reused} drafts reused in {} cycles", st.cycles);
                    }
                    if ahead == 1 {
                        // one forward ahead draws only the guess of the target's token
                        assert_eq!(reused, 0, "{label}");
                    }
                }
            }
        }
    }
    // a draft model takes the library's default (until verified on a GPU, none on the CPU)
    let spec = SpeculativeDecoder::new(Box::new(DraftModel::new(load("qwen3_untied", KvCacheMode::Flat))), Some(3));
    assert_eq!(spec.draft_ahead(), SpeculativeDecoder::default_draft_ahead());
    // until the verify's result is ready: as many forwards as the timing allows
    let target = load("qwen3_untied", KvCacheMode::Flat);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 30);
    for (draft, depth) in [("qwen3_untied", 3), ("qwen3_untied_q8g32", 5)] {
        let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(load(draft, KvCacheMode::Flat))), Some(depth)).with_draft_ahead(DraftAhead::UntilVerified).unwrap();
        check_identity(&target, &mut spec, &prompt, &want, &format!("{draft} depth {depth}, until verified"));
    }
    let target = load("qwen3_5", KvCacheMode::Flat);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 24);
    let d = Arc::new(Mutex::new(DraftModel::new(load("qwen3_5", KvCacheMode::Flat))));
    let mut spec = SpeculativeDecoder::new(Box::new(Shared(d.clone())), Some(3)).with_draft_ahead(DraftAhead::Steps(3)).unwrap();
    check_identity(&target, &mut spec, &prompt, &want, "qwen3_5 self-draft, 3 ahead");
    assert_eq!(d.lock().unwrap().reused_drafts(), 0, "a recurrent draft does not run ahead");
}

/// After `draft_ahead`, a proposal is what a drafter that never ran ahead proposes for the
/// same history: when the target took every draft and the guess (the guesses after it are the
/// first drafts, no forward needed for them), when it took every draft but gave another token,
/// and when it rejected a draft (flat and paged draft caches).
#[test]
fn proposals_after_drafting_ahead_are_a_fresh_drafters() {
    use mlx_speculative::Drafter;
    let greedy = SamplingConfig::greedy();
    let mut rng = Rng(32);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let model = load("qwen3", kv.clone());
        let vocab = model.info().vocab_size;
        let fresh = |h: &[u32], k: usize| DraftModel::new(model.clone()).propose(h, k, &greedy).unwrap().tokens;
        let other = |t: u32| (t + 1) % vocab as u32;
        let mut a = DraftModel::new(model.clone());
        let mut history: Vec<u32> = rng.tokens(20, vocab);
        let mut drafts = a.propose(&history, 4, &greedy).unwrap().tokens;
        for (case, ahead) in [("guess held", 3), ("another token", 2), ("draft rejected", 3)] {
            a.draft_ahead(&history, &drafts, ahead, None).unwrap();
            let before = a.reused_drafts();
            let base: Vec<u32> = history.iter().chain(&drafts).copied().collect();
            let guess = fresh(&base, 1)[0];
            history = match case {
                "guess held" => [base, vec![guess]].concat(),
                "another token" => [base, vec![other(guess)]].concat(),
                _ => [&history[..], &drafts[..2], &[other(drafts[2])]].concat(),
            };
            drafts = a.propose(&history, 4, &greedy).unwrap().tokens;
            assert_eq!(drafts, fresh(&history, 4), "{kv:?}, {case}");
            let reused = a.reused_drafts() - before;
            assert_eq!(reused, if case == "guess held" { ahead - 1 } else { 0 }, "{kv:?}, {case}");
        }
    }
}

/// A draft model on its own thread (`DraftAhead::Background`) drafts there, from each proposal
/// until the next, and the output is plain greedy decoding's over flat and paged caches, at
/// several depths, with a self-draft (always accepted) and a disagreeing 8-bit draft. Moving
/// the drafter there after it drafted on this thread, and back, keeps it working; errors come
/// back typed.
#[test]
fn drafting_in_the_background_changes_no_output() {
    use mlx_speculative::{Background, Draft, Drafter};
    use std::sync::{Arc, Mutex};
    /// A draft model recording the threads it proposed and drafted ahead on.
    struct Where(DraftModel, Arc<Mutex<Vec<Option<String>>>>);
    impl Where {
        fn note(&self) {
            self.1.lock().unwrap().push(std::thread::current().name().map(str::to_string));
        }
    }
    impl Drafter for Where {
        mlx_speculative::forward_drafter!(0; except propose, propose_on, draft_ahead);
        fn propose(&mut self, history: &[u32], k: usize, s: &SamplingConfig) -> mlx_models::Result<Draft> {
            self.note();
            self.0.propose(history, k, s)
        }
        fn propose_on(&mut self, history: &[u32], k: usize, s: &SamplingConfig, target: &mut mlx_models::Cache) -> mlx_models::Result<Draft> {
            self.note();
            self.0.propose_on(history, k, s, target)
        }
        fn draft_ahead(&mut self, history: &[u32], drafts: &[u32], steps: usize, until: Option<&dyn Fn() -> bool>) -> mlx_models::Result<()> {
            self.note();
            self.0.draft_ahead(history, drafts, steps, until)
        }
    }
    let mut rng = Rng(37);
    for kv in [KvCacheMode::Flat, paged(4)] {
        let target = load("qwen3_untied", kv.clone());
        let (prompt, want) = gapped_greedy(&target, &mut rng, 12, 30);
        for draft in ["qwen3_untied", "qwen3_untied_q8g32"] {
            for depth in [1, 3, 5] {
                let threads = Arc::new(Mutex::new(Vec::new()));
                let d = Where(DraftModel::new(load(draft, kv.clone())), threads.clone());
                // first on this thread, 3 forwards ahead: guesses left pending move with it
                let label = format!("{kv:?} {draft} depth {depth}");
                let mut spec = SpeculativeDecoder::new(Box::new(d), Some(depth)).with_draft_ahead(DraftAhead::Steps(3)).unwrap();
                check_identity(&target, &mut spec, &prompt, &want, &format!("{label}, 3 ahead"));
                threads.lock().unwrap().clear();
                let mut spec = spec.with_draft_ahead(DraftAhead::Background).unwrap();
                let label = format!("{label}, in the background");
                let st = check_identity(&target, &mut spec, &prompt, &want, &label);
                if draft == "qwen3_untied" {
                    assert!(st.acceptance_by_position.iter().all(|&a| a == 1.0), "{label}: a self-draft is always accepted");
                }
                // an answer from the thread: the last cycle's drafting ahead (no reply) has run
                spec.drafter().target_positions_run();
                let seen = std::mem::take(&mut *threads.lock().unwrap());
                assert!(seen.len() >= 2 * st.cycles.saturating_sub(1), "{label}: proposals and drafting ahead: {}", seen.len());
                assert!(seen.iter().all(|t| t.as_deref() == Some("mlx-draft")), "{label}: {seen:?}");
                // back on this thread, drafting ahead until verified
                let mut spec = spec.with_draft_ahead(DraftAhead::UntilVerified).unwrap();
                check_identity(&target, &mut spec, &prompt, &want, &format!("{label}, moved back"));
                let here = std::thread::current().name().map(str::to_string);
                let seen = threads.lock().unwrap();
                assert!(!seen.is_empty() && seen.iter().all(|t| *t == here), "{label}, moved back: {seen:?}");
            }
        }
    }
    // sampling at temperature > 0 on the draft's thread draws what it draws on this one (the
    // draft's key moves with it; the draft distributions cross evaluated): seeded runs agree
    let target = load("qwen3_untied", KvCacheMode::Flat);
    let (prompt, _) = gapped_greedy(&target, &mut rng, 12, 4);
    let sampled = SamplingConfig { temperature: 1.0, top_k: 6, seed: Some(13), ..SamplingConfig::greedy() };
    let runs: Vec<_> = [DraftAhead::Steps(0), DraftAhead::Background]
        .into_iter()
        .map(|ahead| {
            let d = DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat));
            let mut spec = SpeculativeDecoder::new(Box::new(d), Some(3)).with_draft_ahead(ahead).unwrap();
            let (got, st, _) = run_spec(&target, &mut spec, &prompt, gen_cfg(30, sampled.clone()));
            assert!(st.cycles > 0 && st.accepted_mean > 0.0, "{ahead}: {st:?}");
            got
        })
        .collect();
    assert_eq!(runs[0], runs[1], "sampled on this thread and on the draft's");
    // a proposal's error crosses the thread typed
    let model = load("qwen3", KvCacheMode::Flat);
    let vocab = model.info().vocab_size as u32;
    let mut b = Background::spawn(Box::new(DraftModel::new(model.clone()))).unwrap();
    let e = b.propose(&[1, vocab + 5], 2, &SamplingConfig::greedy()).err().expect("refused").to_string();
    assert!(e.contains("outside the draft model's vocabulary"), "{e}");
    assert_eq!(b.propose(&[1, 2, 3], 2, &SamplingConfig::greedy()).unwrap().tokens.len(), 2);
    assert!(b.into_inner().is_ok());
    // a drafter that panics on its thread: typed errors, no panic here, and no hang at drop
    struct Panics;
    impl Drafter for Panics {
        fn propose(&mut self, _: &[u32], _: usize, _: &SamplingConfig) -> mlx_models::Result<Draft> {
            panic!("a drafter's bug")
        }
        fn runs_ahead(&self) -> bool {
            true
        }
        fn vocab_size(&self) -> usize {
            8
        }
        fn default_depth(&self) -> usize {
            2
        }
    }
    let mut b = Background::spawn(Box::new(Panics)).unwrap();
    let e = b.propose(&[1, 2], 2, &SamplingConfig::greedy()).err().expect("no answer").to_string();
    assert!(e.contains("worker thread"), "{e}");
    assert!(b.propose(&[1, 2], 2, &SamplingConfig::greedy()).is_err());
    assert!(b.into_inner().err().expect("lost").to_string().contains("panicked"));
    let spec = SpeculativeDecoder::new(Box::new(Panics), Some(2)).with_draft_ahead(DraftAhead::Background).unwrap();
    drop(spec);
}

/// `draft_ahead` with `until` runs no forward once that array is ready, and every forward
/// while it is not (a lazy array never evaluated): the next proposal then reuses none of the
/// guesses, or all of them but the guess of the target's token.
#[test]
fn drafting_ahead_stops_once_the_verdict_is_ready() {
    use mlx_speculative::Drafter;
    let greedy = SamplingConfig::greedy();
    let model = load("qwen3", KvCacheMode::Flat);
    let vocab = model.info().vocab_size;
    let mut rng = Rng(33);
    let history: Vec<u32> = rng.tokens(20, vocab);
    let ready = mlx_array::Array::from_slice(&[1u32], &[1]).unwrap();
    ready.eval().unwrap();
    let pending = ready.add(&ready).unwrap();
    for (until, reused) in [(&ready, 0), (&pending, 3)] {
        let mut a = DraftModel::new(model.clone());
        let drafts = a.propose(&history, 4, &greedy).unwrap().tokens;
        a.draft_ahead(&history, &drafts, 4, Some(&|| until.is_available())).unwrap();
        let base: Vec<u32> = history.iter().chain(&drafts).copied().collect();
        let guess = DraftModel::new(model.clone()).propose(&base, 1, &greedy).unwrap().tokens[0];
        let next = [base, vec![guess]].concat();
        let got = a.propose(&next, 4, &greedy).unwrap().tokens;
        assert_eq!(got, DraftModel::new(model.clone()).propose(&next, 4, &greedy).unwrap().tokens);
        assert_eq!(a.reused_drafts(), reused, "until ready: {}", until.is_available());
    }
    assert!(!pending.is_available(), "the lazy array stayed unevaluated");
}

/// Adaptive depth never asks a draft whose stored weights are at least the target's (bf16
/// `qwen3_untied`, its untied head included, against bf16 `qwen3`): no draft forward runs, the
/// generation is one plain stretch with plain decoding's tokens, and warming up runs nothing.
/// A fixed depth still drafts with it.
#[test]
fn adaptive_depth_leaves_out_a_draft_as_heavy_as_the_target() {
    use std::sync::{Arc, Mutex};
    let target = load("qwen3", KvCacheMode::Flat);
    let mut rng = Rng(9);
    let (prompt, want) = gapped_greedy(&target, &mut rng, 10, 24);
    let heavy = || Arc::new(Mutex::new(DraftModel::new(load("qwen3_untied", KvCacheMode::Flat))));
    use mlx_speculative::Drafter;
    let d = heavy();
    assert!(d.lock().unwrap().weight_bytes() > mlx_models::weights::checkpoint_bytes(&fixture("qwen3")).unwrap());
    let mut spec = SpeculativeDecoder::adaptive(Box::new(Shared(d.clone())), Some(4));
    spec.warm_up(&target).unwrap();
    let (got, st, offset) = run_spec(&target, &mut spec, &prompt, gen_cfg(want.len(), SamplingConfig::greedy()));
    assert_eq!(got, want);
    assert_eq!(offset, prompt.len() + want.len());
    // every token after the prefill's first is a plain cycle
    assert_eq!((st.depth_mean, st.cycles), (0.0, want.len() - 1), "{st:?}");
    assert_eq!(d.lock().unwrap().proposals(), 0, "the draft never ran");
    assert_eq!(d.lock().unwrap().cache().offset(), 0, "not even over the prompt");
    let d = heavy();
    let mut fixed = SpeculativeDecoder::new(Box::new(Shared(d.clone())), Some(2));
    let st = check_identity(&target, &mut fixed, &prompt, &want, "fixed depth, heavy draft");
    assert!(st.depth_mean > 1.0);
    assert!(d.lock().unwrap().proposals() > 0);
}
