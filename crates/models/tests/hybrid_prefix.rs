//! Prefix reuse for the hybrid families (Qwen3.5, LFM2) on the paged cache: a new sequence that
//! repeats a system prompt restores the recurrent-state snapshot kept at a block boundary of it,
//! skips that prefix's prefill, and computes what a flat cache computes from scratch.
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::{load_model, KvCacheMode, LoadOptions, Logits, Model, PagedConfig};

/// Prefill `prompt` in a new cache, then `steps` greedy tokens: (first logits, tokens, skipped).
fn run(model: &Model, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>, usize) {
    let mut cache = model.new_cache();
    let t = Array::from_slice(prompt, &[1, prompt.len()]).unwrap();
    let first = model.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    let skipped = cache.last_skipped();
    let (mut l, mut toks) = (first.clone(), Vec::new());
    for _ in 0..steps {
        let next = argmax(&l);
        toks.push(next);
        let t = Array::from_slice(&[next], &[1, 1]).unwrap();
        l = model.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    }
    (first, toks, skipped)
}

#[test]
fn repeated_system_prompt_skips_its_prefill() {
    for name in ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe"] {
        let load = |kv| load_model(fixture(name), &LoadOptions { kv_cache: kv, ..test_load_options() }).unwrap().into_lm().unwrap();
        let cfg = PagedConfig { block_size: 4, snapshot_interval: 8, memory_mb: Some(8.0), ..Default::default() };
        let (paged, flat) = (load(KvCacheMode::Paged(cfg)), load(KvCacheMode::Flat));
        let v = paged.info().vocab_size as u32;
        let system: Vec<u32> = (0..21u32).map(|i| (i * 31 + 11) % v).collect();
        let with = |user: &[u32]| system.iter().chain(user).copied().collect::<Vec<u32>>();
        let (a, b) = (with(&[3, 1, 4, 1, 5]), with(&[9, 2, 6, 5, 3, 5]));
        // The first request computes everything and keeps snapshots at 8, 16 and 24.
        let (_, _, skipped) = run(&paged, &a, 6);
        assert_eq!(skipped, 0, "{name}: nothing cached yet");
        // The second shares the system prompt: the 16 positions up to its last snapshot inside it.
        let (first, toks, skipped) = run(&paged, &b, 6);
        assert_eq!(skipped, 16, "{name}: the repeated system prompt is not prefilled again");
        let (want_first, want, _) = run(&flat, &b, 6);
        let d = first.iter().zip(&want_first).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d < 1e-4, "{name}: logits after the skipped prefix differ from a flat run by {d}");
        assert_eq!(toks, want, "{name}: greedy tokens");
        // The same prompt again: up to its last snapshot (24 of 26 tokens).
        let (first, toks, skipped) = run(&paged, &a, 6);
        assert_eq!(skipped, 24, "{name}");
        let (want_first, want, _) = run(&flat, &a, 6);
        let d = first.iter().zip(&want_first).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d < 1e-4 && toks == want, "{name}: repeated prompt: logits diff {d}, tokens {toks:?} vs {want:?}");
    }
}

/// Without snapshots (`recurrent_snapshots: 0`) nothing is skipped, even with the attention
/// blocks cached: a recurrent state cannot be rebuilt from them.
#[test]
fn no_snapshot_no_skip() {
    let cfg = PagedConfig { block_size: 4, snapshot_interval: 8, memory_mb: Some(8.0), recurrent_snapshots: 0, ..Default::default() };
    let m = load_model(fixture("lfm2"), &LoadOptions { kv_cache: KvCacheMode::Paged(cfg), ..test_load_options() }).unwrap().into_lm().unwrap();
    let p: Vec<u32> = (0..30).collect();
    assert_eq!(run(&m, &p, 2).2, 0);
    assert_eq!(run(&m, &p, 2).2, 0);
}
