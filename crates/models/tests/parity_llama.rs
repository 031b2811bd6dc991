//! Llama and Qwen2 parity against transformers (f32 eager reference from
//! `scripts/make_tiny_dense.py`): full-prefill logits within 1e-3 relative, 16 greedy tokens
//! identical, cached decode equal to a full recompute, last-position prefill equal to all
//! positions' last row (flat and paged).
mod common;
use common::*;

#[test]
fn llama_tied_matches_transformers() {
    check_transformers_parity("llama", "llama");
}

#[test]
fn llama_untied_with_biases_and_llama3_rope_matches_transformers() {
    check_transformers_parity("llama_scaled", "llama");
}

#[test]
fn qwen2_matches_transformers() {
    check_transformers_parity("qwen2", "qwen2");
}

#[test]
fn llama_last_position_prefill_equals_all_positions() {
    check_last_position_prefill("llama");
}
