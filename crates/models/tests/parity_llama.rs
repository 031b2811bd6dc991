//! Llama, Qwen2 and scaled-rope (dynamic NTK, YaRN on Qwen3) parity against transformers (f32 eager reference from
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

#[test]
fn llama_dynamic_ntk_rope_matches_transformers() {
    // transformers grows the base with each call's longest position: no recompute comparison
    check_transformers_parity_with("llama_dynamic", "llama", false);
}

#[test]
fn qwen3_yarn_rope_matches_transformers() {
    check_transformers_parity("qwen3_yarn", "qwen3");
}

#[test]
fn unknown_rope_type_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(fixture("qwen3_yarn").join(f), dir.path().join(f)).unwrap();
    }
    let p = dir.path().join("config.json");
    let cfg = std::fs::read_to_string(&p).unwrap().replace("\"yarn\"", "\"su\"");
    std::fs::write(&p, cfg).unwrap();
    match mlx_models::load_model(dir.path(), &test_load_options()) {
        Err(mlx_models::ModelError::MalformedConfig { reason, .. }) => assert!(reason.contains("\"su\""), "{reason}"),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("an unknown rope type loaded"),
    }
}
