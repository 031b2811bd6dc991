//! Qwen3 parity against transformers 5.23 (f32 eager reference) on the tiny fixtures:
//! full-prefill logits within 1e-3 relative, 16 greedy tokens identical, cached decode equal to
//! a full recompute.
mod common;
use common::*;
use mlx_models::{load_model, LoadOptions};

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

/// A prefill that reads only the last position's logits queries only that position in the last
/// layer (its K/V are cached for all): the same logits as the last row of all positions', flat
/// and paged, and the same decode after it.
#[test]
fn last_position_prefill_equals_all_positions() {
    use mlx_models::{KvCacheMode, Logits, PagedConfig};
    let r = reference("qwen3");
    let prompt = ids(&r["input_ids"]);
    for kv in [KvCacheMode::Flat, KvCacheMode::Paged(PagedConfig { block_size: 4, ..Default::default() })] {
        let m = load_model(fixture("qwen3"), &LoadOptions { kv_cache: kv.clone(), ..Default::default() }).unwrap().into_lm().unwrap();
        let all = full_logits(&m, &prompt);
        for n in [2usize, 37, 72] {
            let mut cache = m.new_cache();
            let t = mlx_array::Array::from_slice(&prompt[..n], &[1, n]).unwrap();
            let last = m.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
            let want = if n == prompt.len() { all[n - 1].clone() } else { full_logits(&m, &prompt[..n])[n - 1].clone() };
            let e = rel_err(&last, &want);
            assert!(e < 1e-5, "{kv:?} prompt {n}: last-position logits vs all positions' last row: rel err {e}");
            // The cache holds every position: the next step matches a recompute.
            let next = mlx_array::Array::from_slice(&[prompt[n % prompt.len()]], &[1, 1]).unwrap();
            let step = m.forward(&next, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
            let mut longer = prompt[..n].to_vec();
            longer.push(prompt[n % prompt.len()]);
            let e = rel_err(&step, &full_logits(&m, &longer)[n]);
            assert!(e < 1e-5, "{kv:?} prompt {n}: decode after the prefill vs recompute: rel err {e}");
        }
    }
}
