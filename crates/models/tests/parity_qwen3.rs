//! Qwen3 parity against transformers 5.23 (f32 eager reference) on the tiny fixtures:
//! full-prefill logits within 1e-3 relative, 16 greedy tokens identical, cached decode equal to
//! a full recompute.
mod common;
use common::*;
use mlx_models::{load_model, LoadOptions};

fn check_family(name: &str) {
    let r = reference(name);
    let model = load_model(fixture(name), &LoadOptions::default()).unwrap().into_lm().unwrap();
    let prompt = ids(&r["input_ids"]);
    let greedy_ref = ids(&r["greedy_ids"]);
    assert_eq!(prompt.len(), 72);

    // 1. Full prefill logits.
    let ours = full_logits(&model, &prompt);
    let theirs = r["logits"].to_vec::<f32>().unwrap();
    let flat: Vec<f32> = ours.iter().flatten().copied().collect();
    let e = rel_err(&flat, &theirs);
    assert!(e < 1e-3, "{name}: prefill logits rel err {e}");

    // 2. Greedy through the cache, and its per-step logits vs the reference's decode logits.
    let mut cache = model.new_cache();
    let (toks, step_logits) = greedy_cached(&model, &mut cache, &prompt, 16);
    assert_eq!(toks, greedy_ref[72..], "{name}: greedy tokens");
    let dref = r["decode_logits"].to_vec::<f32>().unwrap();
    let flat: Vec<f32> = step_logits.iter().flatten().copied().collect();
    let e = rel_err(&flat, &dref);
    assert!(e < 1e-3, "{name}: decode logits rel err {e}");

    // 3. Cached decode equals full recompute over the same tokens.
    let full = full_logits(&model, &greedy_ref[..87]);
    for (s, l) in step_logits.iter().enumerate() {
        let e = rel_err(l, &full[71 + s]);
        assert!(e < 1e-4, "{name}: step {s} cached vs recomputed rel err {e}");
        assert_eq!(argmax(l), argmax(&full[71 + s]));
    }
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
    let model = load_model(fixture("qwen3"), &LoadOptions::default()).unwrap().into_lm().unwrap();
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
