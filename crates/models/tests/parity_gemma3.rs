//! Gemma 3 parity against transformers 5.17 (f32 eager reference from
//! `scripts/make_tiny_dense.py`): Gemma3ForCausalLM (`gemma3_text`, untied head) and the language
//! model of Gemma3ForConditionalGeneration (`gemma3`: linear-scaled global rope, logit softcap).
//! Both have sliding layers with a 16-position window under a 72-token prompt: full-prefill logits
//! within 1e-3 relative, 16 greedy tokens identical, cached decode equal to a recompute, and
//! paged = flat.
mod common;
use common::*;
use mlx_models::{load_model, KvCacheMode, LoadOptions, PagedConfig};

#[test]
fn gemma3_text_matches_transformers() {
    check_transformers_parity("gemma3_text", "gemma3");
}

#[test]
fn gemma3_conditional_generation_language_model_matches_transformers() {
    check_transformers_parity("gemma3", "gemma3");
}

#[test]
fn gemma3_last_position_prefill_equals_all_positions() {
    check_last_position_prefill("gemma3_text");
}

fn model(name: &str, kv_cache: KvCacheMode) -> mlx_models::Model {
    load_model(fixture(name), &LoadOptions { kv_cache, ..test_load_options() }).unwrap().into_lm().unwrap()
}

#[test]
fn gemma3_paged_equals_flat() {
    for name in ["gemma3_text", "gemma3"] {
        let r = reference(name);
        let prompt = ids(&r["input_ids"]);
        let flat = model(name, KvCacheMode::Flat);
        assert!(!flat.new_cache().is_paged());
        let want = greedy_gen(&flat, &prompt, 16, 2048);
        assert_eq!(want, ids(&r["greedy_ids"])[72..], "{name}");
        let a = full_logits(&flat, &prompt);
        for (bs, c) in [(1, true), (5, true), (16, false)] {
            let p = model(name, KvCacheMode::Paged(PagedConfig { block_size: bs, memory_mb: Some(8.0), contiguous_reads: c, ..Default::default() }));
            assert!(p.new_cache().is_paged());
            let e = rel_err(&full_logits(&p, &prompt).concat(), &a.concat());
            assert!(e < 1e-5, "{name} block size {bs}, contiguous reads {c}: paged vs flat logits rel err {e}");
            // chunked prefill of 20 (longer than the window) plus decode; then again on the warm pool
            assert_eq!(greedy_gen(&p, &prompt, 16, 20), want, "{name} block size {bs}, contiguous reads {c}");
            assert_eq!(greedy_gen(&p, &prompt, 16, 20), want, "{name} block size {bs}, contiguous reads {c}, prefix hit");
        }
    }
}
