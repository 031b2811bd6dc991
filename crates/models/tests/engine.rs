//! The continuous-batching engine ([`mlx_models::Engine`]): requests that join while others
//! decode give, for every LM family, the greedy tokens of each request run alone (wherever the
//! lone run's top-1/top-2 gap exceeds 1e-4); passes carry several sequences, and a joining
//! prompt's chunks share the decoding rows' passes; hybrid prefix reuse on the paged pool;
//! cancellation, dropped receivers, usage and the bounded queue.
mod common;
use common::*;
use mlx_models::{load_model, Engine, EngineConfig, EngineError, EngineKv, Event, FinishReason, GenerateConfig, KvCacheMode, LoadOptions, Model, PagedConfig, PromptPasses, RequestHandle, Usage};
use sampling::SamplingConfig;

/// Read `n` tokens (or everything, `n = usize::MAX`) of a request; returns them and the finish.
fn read(h: &RequestHandle, n: usize) -> (Vec<u32>, Option<(FinishReason, Usage)>) {
    let mut toks = Vec::new();
    while toks.len() < n {
        match h.events.recv().expect("the engine answers") {
            Event::Token(t) => toks.push(t.id),
            Event::Finished { reason, usage, .. } => return (toks, Some((reason, usage))),
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    (toks, None)
}

fn greedy(n: usize) -> GenerateConfig {
    GenerateConfig { max_new_tokens: n, sampling: SamplingConfig::greedy(), stop_tokens: Some(vec![]), ..Default::default() }
}

/// A fixture loaded with paged caches (blocks of 4 tokens, so every test prompt has a full block)
/// or flat ones.
fn load(name: &str, paged: bool) -> Model {
    let kv_cache = if paged { KvCacheMode::Paged(PagedConfig { block_size: 4, memory_mb: Some(8.0), ..Default::default() }) } else { KvCacheMode::Flat };
    load_model(fixture(name), &LoadOptions { kv_cache, ..test_load_options() }).unwrap().into_lm().unwrap()
}

/// Requests joining while others decode give each request's lone greedy tokens, their prompt
/// chunks sharing passes with the decoding row; with `kv` paged, each request starts on the full
/// blocks of its prompt that its lone run left in the prefix cache (hybrids: on the snapshots
/// the engine kept).
fn check_family(name: &str, kv: EngineKv) {
    let model = load(name, kv == EngineKv::Paged);
    let recurrent = matches!(name, "qwen3_5" | "qwen3_5_moe" | "lfm2" | "lfm2_moe");
    let v = model.info().vocab_size as u32;
    let mk = |n: u32, seed: u32| (0..n).map(|i| (i * 53 + seed * 97 + 3) % v).collect::<Vec<u32>>();
    let prompts = [mk(6, 1), mk(15, 2), mk(9, 3), mk(6, 1), mk(15, 2)];
    let steps = 12;
    let lone: Vec<_> = prompts.iter().map(|p| greedy_alone(&model, p, steps)).collect();
    let engine = Engine::start(model.clone(), EngineConfig { max_batch: 8, prefill_step_size: 4, mixed_step_size: 4, max_queue: 16, kv, prompt_passes: PromptPasses::Mixed }).unwrap();
    let h = engine.handle();
    // A runs alone for 3 tokens; B, C, D (A's prompt again) and E (B's: computed once for both
    // when the loop admits them in one turn) join while it decodes. A asks for many tokens, so
    // it still decodes while their prompts are computed, and is cancelled after its first 12.
    let a = h.submit(prompts[0].clone(), &greedy(300)).unwrap();
    let (mut got_a, _) = read(&a, 3);
    let others: Vec<RequestHandle> = prompts[1..].iter().map(|p| h.submit(p.clone(), &greedy(steps)).unwrap()).collect();
    let mut got = vec![(Vec::new(), None)];
    got.extend(others.iter().map(|r| read(r, usize::MAX)));
    got_a.extend(read(&a, steps - 3).0);
    a.cancel.cancel();
    assert_eq!(read(&a, usize::MAX).1.unwrap().0, FinishReason::Cancelled);
    got[0].0 = got_a;
    for (i, (toks, fin)) in got.iter().enumerate() {
        let (want, gaps) = &lone[i];
        let exact = gaps.iter().all(|&g| g > TIE);
        assert_prefix(&format!("{name}, request {i}"), toks, want, gaps);
        let Some((reason, usage)) = *fin else { continue };
        assert_eq!(reason, FinishReason::Length);
        if exact {
            // paged: every prompt was computed alone first, so its full blocks are cached; the
            // hybrids skip only up to a recurrent-state snapshot, which the lone runs (one
            // piece each) did not keep: D starts on the one A's first chunk of 4 kept
            // (E, admitted in a later turn than B, would start on B's first snapshots)
            let cached = match (kv, recurrent) {
                (EngineKv::Paged, false) => (prompts[i].len() - 1) / 4 * 4,
                (EngineKv::Paged, true) if i == 3 => 4,
                (EngineKv::Paged, true) if i == 4 => usage.cached_prompt_tokens,
                _ => 0,
            };
            assert_eq!(usage, Usage { prompt_tokens: prompts[i].len(), completion_tokens: steps, cached_prompt_tokens: cached }, "{name}, request {i}");
        }
    }
    let st = h.stats();
    assert!(st.max_rows >= 3, "{name}: passes carry several sequences: {st:?}");
    assert!(st.rows > st.forwards, "{name}: mean rows per pass above 1: {st:?}");
    assert!(st.mixed_forwards >= 1, "{name}: a pass carried prompt chunks and A's decode row: {st:?}");
}

const DENSE: [&str; 5] = ["qwen3", "llama", "qwen2", "gemma3_text", "gemma4_text"];
const HYBRID: [&str; 5] = ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "gemma4_text_moe"];

/// Every family of `names` on flat batch caches, then on the paged pool (every sequence its own
/// blocks, steps over several of them).
fn check_families(names: [&str; 5]) {
    for kv in [EngineKv::Flat, EngineKv::Paged] {
        for name in names {
            check_family(name, kv);
        }
    }
}

#[test]
fn engine_equals_alone_dense() {
    check_families(DENSE);
}

#[test]
fn engine_equals_alone_hybrid() {
    check_families(HYBRID);
}

/// `got` equals `want` up to the first step where the lone run was a near tie.
fn assert_prefix(what: &str, got: &[u32], want: &[u32], gaps: &[f32]) {
    for (s, w) in want.iter().enumerate() {
        if gaps[s] <= TIE {
            return;
        }
        assert_eq!(got.get(s), Some(w), "{what}, step {s}: engine {got:?}, alone {want:?}");
    }
}

/// A prompt submitted while another request decodes is computed in chunks inside the decoding
/// row's passes (flat and paged; a dense and a hybrid family, whose conv state must survive the
/// padded columns of its decode row): each chunk pass also carries the decode row, and both
/// requests give their lone greedy tokens. With [`PromptPasses::Separate`] the chunks run in
/// passes of their own: the same tokens, no mixed pass.
#[test]
fn prompt_chunks_share_passes_with_decode_rows() {
    for (kv, prompt_passes) in [(EngineKv::Flat, PromptPasses::Mixed), (EngineKv::Paged, PromptPasses::Mixed), (EngineKv::Flat, PromptPasses::Separate), (EngineKv::Paged, PromptPasses::Separate)] {
        for name in ["qwen3", "lfm2", "qwen3_5"] {
            let model = load(name, kv == EngineKv::Paged);
            let v = model.info().vocab_size as u32;
            let a: Vec<u32> = (0..5u32).map(|i| (i * 41 + 9) % v).collect();
            let b: Vec<u32> = (0..11u32).map(|i| (i * 29 + 5) % v).collect();
            let (want_a, gaps_a) = greedy_alone(&model, &a, 40);
            let (want_b, gaps_b) = greedy_alone(&model, &b, 8);
            let engine = Engine::start(model, EngineConfig { max_batch: 4, prefill_step_size: 8, mixed_step_size: 4, max_queue: 4, kv, prompt_passes }).unwrap();
            let h = engine.handle();
            // A decodes long enough to still be running while B's prompt is computed.
            let ra = h.submit(a, &greedy(400)).unwrap();
            let (mut got_a, _) = read(&ra, 3);
            let before = h.stats();
            let rb = h.submit(b, &greedy(8)).unwrap();
            let (got_b, fin) = read(&rb, usize::MAX);
            got_a.extend(read(&ra, 37).0);
            ra.cancel.cancel();
            assert_eq!(read(&ra, usize::MAX).1.unwrap().0, FinishReason::Cancelled);
            let (reason, usage) = fin.unwrap();
            assert_eq!(reason, FinishReason::Length);
            assert_prefix(&format!("{name} {kv:?}: A"), &got_a, &want_a, &gaps_a);
            assert_prefix(&format!("{name} {kv:?}: B"), &got_b, &want_b, &gaps_b);
            // B's prompt tokens not served by the prefix cache (paged: the full blocks its lone
            // run left, for the dense family), in mixed chunks of 4 (not the 8 of passes without
            // decoding rows), each pass with A's decode row
            let computed = 11 - usage.cached_prompt_tokens;
            assert_eq!(usage.cached_prompt_tokens, if kv == EngineKv::Paged && name == "qwen3" { 8 } else { 0 }, "{name} {kv:?}");
            let mixed = h.stats().mixed_forwards - before.mixed_forwards;
            let want = if prompt_passes == PromptPasses::Mixed { computed.div_ceil(4) } else { 0 };
            assert_eq!(mixed, want, "{name} {kv:?} {prompt_passes:?}: passes carrying B's prompt chunks and A's decode row");
        }
    }
}

/// Hybrid families on the paged pool: a request that repeats another's system prompt starts on
/// the recurrent-state snapshot the first one's prompt chunks kept at the last block boundary
/// they share (exact `cached_prompt_tokens`), and gives the greedy tokens of a flat run.
#[test]
fn hybrid_repeated_system_prompt_skips_its_prefill() {
    for name in ["qwen3_5", "lfm2"] {
        let paged = load(name, true);
        let flat = load(name, false);
        let v = paged.info().vocab_size as u32;
        let system: Vec<u32> = (0..21u32).map(|i| (i * 31 + 11) % v).collect();
        let with = |user: &[u32]| system.iter().chain(user).copied().collect::<Vec<u32>>();
        let (a, b) = (with(&[3, 1, 4, 1, 5]), with(&[9, 2, 6, 5, 3, 5]));
        let engine = Engine::start(paged, EngineConfig { max_batch: 4, prefill_step_size: 4, mixed_step_size: 4, max_queue: 4, kv: EngineKv::Paged, ..Default::default() }).unwrap();
        let h = engine.handle();
        let run = |p: &[u32]| read(&h.submit(p.to_vec(), &greedy(6)).unwrap(), usize::MAX);
        let (_, fin) = run(&a);
        assert_eq!(fin.unwrap().1.cached_prompt_tokens, 0, "{name}: nothing cached yet");
        // A's chunks of 4 kept snapshots at 4, 8, .., 24; B shares the first 21 tokens: 20.
        let (toks, fin) = run(&b);
        assert_eq!(fin.unwrap().1.cached_prompt_tokens, 20, "{name}: the repeated system prompt is not computed again");
        let (want, gaps) = greedy_alone(&flat, &b, 6);
        assert_prefix(&format!("{name}: B"), &toks, &want, &gaps);
        // A again: up to its last block boundary before its last token (24 of 26).
        let (toks, fin) = run(&a);
        assert_eq!(fin.unwrap().1.cached_prompt_tokens, 24, "{name}: repeated prompt");
        let (want, gaps) = greedy_alone(&flat, &a, 6);
        assert_prefix(&format!("{name}: A again"), &toks, &want, &gaps);
    }
}

/// Cancelling a request (or dropping its receiver) ends it with `Cancelled` at its next token;
/// the requests beside it go on unchanged.
#[test]
fn cancellation_and_dropped_receivers() {
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let p = vec![5u32, 6, 7, 8, 9];
    let (want, gaps) = greedy_alone(&model, &p, 40);
    assert!(gaps.iter().all(|&g| g > TIE));
    let engine = Engine::start(model, EngineConfig::default()).unwrap();
    let h = engine.handle();
    let keep = h.submit(p.clone(), &greedy(40)).unwrap();
    let cancel = h.submit(vec![1, 2, 3], &greedy(1000)).unwrap();
    let dropped = h.submit(vec![4, 2], &greedy(1000)).unwrap();
    let (t, _) = read(&cancel, 2);
    assert_eq!(t.len(), 2);
    cancel.cancel.cancel();
    drop(dropped);
    let (rest, fin) = read(&cancel, usize::MAX);
    assert!(rest.len() <= 2, "cancelled at the next step or the one queued before it, got {} more", rest.len());
    assert_eq!(fin.unwrap().0, FinishReason::Cancelled);
    let (toks, fin) = read(&keep, usize::MAX);
    assert_eq!(toks, want);
    assert_eq!(fin.unwrap().0, FinishReason::Length);
}

#[test]
fn invalid_requests_and_a_full_queue_are_refused() {
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let too_long = vec![1u32; model.info().max_position_embeddings];
    let engine = Engine::start(model, EngineConfig { max_batch: 1, prefill_step_size: 0, max_queue: 1, ..Default::default() }).unwrap();
    let h = engine.handle();
    assert!(matches!(h.submit(vec![], &greedy(1)), Err(EngineError::Model(_))));
    assert!(matches!(h.submit(vec![1, 1 << 30], &greedy(1)), Err(EngineError::Model(_))));
    assert!(matches!(h.submit(too_long, &greedy(1)), Err(EngineError::Model(_))));
    let bad_sampling = GenerateConfig { sampling: SamplingConfig { top_p: 7.0, ..SamplingConfig::default() }, ..greedy(1) };
    assert!(matches!(h.submit(vec![1], &bad_sampling), Err(EngineError::Model(_))));
    // One slot, one waiting place: the third request while both are taken is refused.
    let mut accepted = Vec::new();
    let mut refused = false;
    for _ in 0..50 {
        match h.submit(vec![1, 2], &greedy(200)) {
            Ok(r) => accepted.push(r),
            Err(EngineError::QueueFull(n)) => {
                assert!(n >= 1);
                refused = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused, "a bounded queue refuses requests");
    for r in &accepted {
        r.cancel.cancel();
    }
    for r in &accepted {
        assert_eq!(read(r, usize::MAX).1.unwrap().0, FinishReason::Cancelled);
    }
}
