//! Qwen3 parity against transformers 5.23 (f32 eager reference) on the tiny fixtures:
//! full-prefill logits within 1e-3 relative, 16 greedy tokens identical, cached decode equal to
//! a full recompute.
mod common;
use common::*;
use mlx_models::load_model;

fn check_family(name: &str) {
    check_transformers_parity(name, "qwen3");
}

#[test]
fn qwen3_tied_matches_transformers() {
    check_family("qwen3");
}

#[test]
fn qwen3_untied_matches_transformers() {
    check_family("qwen3_untied");
}

#[test]
fn chunked_prefill_equals_single_prefill() {
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let prompt = ids(&reference("qwen3")["input_ids"]);
    let mut one = model.new_cache();
    let (a, _) = greedy_cached(&model, &mut one, &prompt, 8);
    // Prefill in chunks of 20 (not a divisor of 72), then the same greedy decode.
    let mut chunked = model.new_cache();
    for c in prompt[..71].chunks(20) {
        let t = mlx_array::Array::from_slice(c, &[1, c.len()]).unwrap();
        model.forward(&t, &mut chunked, mlx_models::Logits::None, false).unwrap();
    }
    let (b, _) = greedy_cached(&model, &mut chunked, &prompt[71..], 8);
    assert_eq!(a, b);
}

/// A prefill that reads only the last position's logits queries only that position in the last
/// layer: the same logits as the last row of all positions', flat and paged.
#[test]
fn last_position_prefill_equals_all_positions() {
    check_last_position_prefill("qwen3");
}
