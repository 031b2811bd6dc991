//! The generation loop: greedy equals the transformers reference (plain and chat-templated),
//! stop tokens end on a turn boundary, cancellation, forced tokens, length.
mod common;
use common::*;
use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions};
use mlx_models::{generate, load_model, FinishReason, GenerateConfig};
use sampling::SamplingConfig;

fn greedy(n: usize) -> GenerateConfig {
    GenerateConfig { max_new_tokens: n, sampling: SamplingConfig::greedy(), stop_tokens: Some(vec![]), ..Default::default() }
}

#[test]
fn greedy_generation_matches_reference() {
    let r = reference("qwen3");
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let prompt = ids(&r["input_ids"]);
    let mut cache = model.new_cache();
    let mut g = generate(&model, &mut cache, &prompt, GenerateConfig { prefill_step_size: 16, ..greedy(16) }).unwrap();
    let toks: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
    assert_eq!(toks, ids(&r["greedy_ids"])[72..]);
    assert_eq!(g.performance().generated_tokens, 16);
    drop(g);
    assert_eq!(cache.offset(), 72 + 16, "every yielded token is in the cache");
}

#[test]
fn chat_template_to_greedy_tokens_matches_reference() {
    let r = reference("qwen3");
    let dir = fixture("qwen3");
    let model = load_model(&dir, &test_load_options()).unwrap().into_lm().unwrap();
    let f = ChatFormat::from_dir(&dir).unwrap();
    let p = f.render(&[ChatMessage::user("Hello! What is 2+2?")], &RenderOptions::default()).unwrap();
    assert_eq!(p.ids, ids(&r["chat_input_ids"]));
    let mut cache = model.new_cache();
    let toks: Vec<u32> = generate(&model, &mut cache, &p.ids, greedy(16)).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(toks, ids(&r["chat_greedy_ids"])[p.ids.len()..]);
}

#[test]
fn stop_token_is_fed_but_not_returned() {
    let r = reference("qwen3");
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let prompt = ids(&r["input_ids"]);
    let want = ids(&r["greedy_ids"])[72..].to_vec();
    let stop = want[5];
    let first = want.iter().position(|&t| t == stop).unwrap();
    let mut cache = model.new_cache();
    let cfg = GenerateConfig { stop_tokens: Some(vec![stop]), ..greedy(16) };
    let mut g = generate(&model, &mut cache, &prompt, cfg).unwrap();
    let toks: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
    assert_eq!(g.finish_reason(), Some(FinishReason::Stop));
    assert_eq!(toks, want[..first]);
    drop(g);
    assert_eq!(cache.offset(), 72 + first + 1);
}

#[test]
fn cancel_force_and_bad_input() {
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let mut cache = model.new_cache();
    let mut g = generate(&model, &mut cache, &[1, 2, 3], greedy(50)).unwrap();
    let h = g.cancel_handle();
    assert!(g.next().unwrap().is_ok());
    g.force_next(7);
    assert_eq!(g.next().unwrap().unwrap().id, 7);
    h.cancel();
    assert!(g.next().is_none());
    assert_eq!(g.finish_reason(), Some(FinishReason::Cancelled));
    drop(g);
    let mut cache = model.new_cache();
    assert!(generate(&model, &mut cache, &[], greedy(4)).is_err());
    assert!(generate(&model, &mut cache, &[100_000], greedy(4)).is_err());
    let bad = GenerateConfig { sampling: SamplingConfig { temperature: -1.0, ..Default::default() }, ..greedy(4) };
    assert!(generate(&model, &mut cache, &[1], bad).is_err());
}

#[test]
fn seeded_sampling_is_reproducible() {
    let model = load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap();
    let run = |seed| {
        let mut cache = model.new_cache();
        let cfg = GenerateConfig { sampling: SamplingConfig::default().with_seed(seed), ..greedy(12) };
        generate(&model, &mut cache, &[5, 6, 7], cfg).unwrap().map(|t| t.unwrap().id).collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

/// A checkpoint whose final norm is NaN gives NaN logits: generation stops with a typed error
/// at the first token instead of streaming token 0.
#[test]
fn nan_logits_are_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("qwen3");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
    }
    let mut w = mlx_array::io::load_safetensors(src.join("model.safetensors"), None).unwrap();
    let n = w["model.norm.weight"].shape()[0];
    w.insert("model.norm.weight".into(), mlx_array::Array::from_slice(&vec![f32::NAN; n], &[n]).unwrap());
    let named: Vec<(&str, &mlx_array::Array)> = w.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx_array::io::save_safetensors(dir.path().join("model.safetensors"), &named, None).unwrap();
    let model = load_model(dir.path(), &test_load_options()).unwrap().into_lm().unwrap();
    for sampling in [SamplingConfig::greedy(), SamplingConfig::default().with_seed(3)] {
        let mut cache = model.new_cache();
        let mut g = generate(&model, &mut cache, &[5, 6, 7], GenerateConfig { max_new_tokens: 4, sampling, stop_tokens: Some(vec![]), ..Default::default() }).unwrap();
        match g.next() {
            Some(Err(mlx_models::ModelError::NonFiniteLogits { step: 0, .. })) => {}
            other => panic!("expected NonFiniteLogits, got {:?}", other.map(|r| r.map(|t| t.id))),
        }
        assert!(g.next().is_none(), "generation ends after the error");
    }
}
