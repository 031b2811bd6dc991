//! Gemma 4 parity against transformers 5.23 (f32 eager reference) on the tiny fixtures
//! (gemma4_text: PLE, KV sharing, double-wide MLP; gemma4_text_moe: k_eq_v, MoE;
//! gemma4: ConditionalGeneration key layout): full-prefill logits within 1e-3 relative,
//! 16 greedy tokens identical, cached decode equal to a full recompute. The 72-token prompt is
//! longer than the sliding window (16).
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::chat::ChatMessage;
use mlx_models::families::gemma4::{Gemma4Config, Gemma4Model};
use mlx_models::registry;
use mlx_models::{load_model, load_session, FinishReason, LayerKind, LoadOptions, Logits, ModelRuntime};
use sampling::SamplingOverrides;

/// gemma4_text (PLE, KV sharing, double-wide MLP), gemma4_text_moe (k_eq_v, MoE) and the
/// ConditionalGeneration layout; rotating sliding-window caches and KV-shared layers are
/// exercised by the cached decode.
#[test]
fn every_fixture_matches_transformers() {
    for name in ["gemma4_text", "gemma4_text_moe"] {
        check_transformers_parity(name, "gemma4");
    }
    // The ConditionalGeneration fixture loads with its vision tower (registry row gemma4_vlm).
    check_transformers_parity("gemma4", "gemma4_vlm");
}

#[test]
fn chunked_prefill_across_the_window_equals_single_prefill() {
    // Chunks of 20 and 7 cross the 16-position window of the rotating caches.
    for name in ["gemma4_text", "gemma4_text_moe"] {
        for step in [20, 7] {
            check_chunked_prefill(name, &[step], 6);
        }
    }
}

#[test]
fn cache_layout_follows_layer_types_and_kv_sharing() {
    let model = load_model(fixture("gemma4_text"), &test_load_options()).unwrap().into_lm().unwrap();
    let spec = model.with_runtime(|rt| rt.cache_spec());
    // layer_types: s s f s | s f, with the last 2 layers KV-shared: 4 -> 3 (sliding), 5 -> 2 (full).
    assert_eq!(
        spec.layers,
        vec![
            LayerKind::SlidingAttention { kv_heads: 2, head_dim: 16, window: 16 },
            LayerKind::SlidingAttention { kv_heads: 2, head_dim: 16, window: 16 },
            LayerKind::Attention { kv_heads: 2, head_dim: 32 },
            LayerKind::SlidingAttention { kv_heads: 2, head_dim: 16, window: 16 },
            LayerKind::SharedKv { anchor: 3 },
            LayerKind::SharedKv { anchor: 2 },
        ]
    );
    // k_eq_v full layers use num_global_key_value_heads.
    let moe = load_model(fixture("gemma4_text_moe"), &test_load_options()).unwrap().into_lm().unwrap();
    let spec = moe.with_runtime(|rt| rt.cache_spec());
    assert_eq!(spec.layers[2], LayerKind::Attention { kv_heads: 1, head_dim: 32 });
    assert_eq!(spec.layers[0], LayerKind::SlidingAttention { kv_heads: 2, head_dim: 16, window: 16 });

    // The sliding layers' rotating caches hold fewer positions than were seen (flat caches:
    // gemma4 defaults to the paged pool, which keeps its storage out of `Cache`).
    assert!(model.new_cache().is_paged());
    let flat = LoadOptions { kv_cache: mlx_models::KvCacheMode::Flat, ..Default::default() };
    let model = load_model(fixture("gemma4_text"), &flat).unwrap().into_lm().unwrap();
    let mut cache = model.new_cache();
    let prompt = ids(&reference("gemma4_text")["input_ids"]);
    model.forward(&Array::from_slice(&prompt, &[1, 72]).unwrap(), &mut cache, Logits::Last, false).unwrap();
    assert_eq!(cache.offset(), 72);
    assert!(cache.kv(0).unwrap().stored() < 72);
    assert_eq!(cache.kv(2).unwrap().stored(), 72);
    assert!(cache.kv(4).is_err(), "KV-shared layers have no storage of their own");
}

#[test]
fn registry_routes_gemma4_aliases_and_unified_probe() {
    let dir = std::path::Path::new("/nonexistent");
    for mt in ["gemma4", "gemma4_text", "gemma4_unified"] {
        let f = registry::detect_from_value(dir, &serde_json::json!({ "model_type": mt })).unwrap();
        assert_eq!(f.model_type, "gemma4");
    }
    // The unified architecture is authoritative, whatever model_type says.
    for mt in [serde_json::json!("qwen3"), serde_json::Value::Null] {
        let v = serde_json::json!({ "model_type": mt, "architectures": ["Gemma4UnifiedForConditionalGeneration"] });
        assert_eq!(registry::detect_from_value(dir, &v).unwrap().model_type, "gemma4");
    }
    assert_eq!(registry::FAMILIES[0].model_type, "gemma4", "first in probe order");
    registry::validate_registry().unwrap();
    for name in ["gemma4_text", "gemma4_text_moe"] {
        assert_eq!(registry::detect_model_type(&fixture(name)).unwrap().model_type, "gemma4");
    }
    // ConditionalGeneration checkpoints with a tower load with it (the vlm row).
    for name in ["gemma4", "gemma4_media"] {
        assert_eq!(registry::detect_model_type(&fixture(name)).unwrap().model_type, "gemma4_vlm");
    }
}

#[test]
fn config_only_model_refuses_to_run() {
    let dir = fixture("gemma4");
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = Gemma4Config::from_root(&dir, &raw).unwrap();
    // ConditionalGeneration: decoder settings from text_config, top-level vocab_size.
    assert_eq!((cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers), (64, 1024, 6));
    let m = Gemma4Model::from_config(cfg, vec![1]).unwrap();
    assert!(!m.is_initialized());
    assert_eq!(m.info().model_type, "gemma4");
    assert_eq!(m.cache_spec().layers.len(), 6);
    let mut cache = mlx_models::Cache::new(&m.cache_spec());
    let t = Array::from_slice(&[2u32, 3], &[1, 2]).unwrap();
    let err = m.forward(&t, &mut cache, Logits::Last, false).err().expect("a config-only model must not run");
    let msg = err.to_string();
    assert!(msg.contains("not initialized") && msg.contains("weights not loaded"), "{msg}");
}

#[test]
fn transformers5_per_layer_config_is_read() {
    // transformers 5 writes per_layer_config instead of global_head_dim/num_global_key_value_heads.
    let dir = fixture("gemma4_text_moe");
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.hf-5.23-save.json")).unwrap()).unwrap();
    let cfg = Gemma4Config::from_root(&dir, &raw).unwrap();
    assert_eq!((cfg.layer_head_dim(0), cfg.layer_head_dim(2)), (16, 32));
    assert_eq!((cfg.layer_kv_heads(0), cfg.layer_kv_heads(2)), (2, 1));
}

#[test]
fn model_sampling_defaults_come_from_generation_config() {
    // The fixture's generation_config.json sets no sampling values: the defaults stay unset
    // (so the request / library defaults apply), and its eos id is a stop token.
    let s = load_session(fixture("gemma4_text"), &test_load_options()).unwrap();
    let d = s.model_sampling_defaults();
    assert_eq!(*d, SamplingOverrides::from_generation_config(&serde_json::json!({"bos_token_id": 2, "eos_token_id": 1})));
    assert_eq!((d.temperature, d.top_k, d.top_p), (None, None, None));
    assert!(load_model(fixture("gemma4_text"), &test_load_options()).unwrap().into_lm().unwrap().info().eos_token_ids.contains(&1));

    // A Gemma 4 style generation_config (temperature 1, top_k 64, top_p 0.95) flows through.
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("gemma4_text")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let gc = serde_json::json!({"bos_token_id": 2, "eos_token_id": [1, 106], "do_sample": true, "temperature": 1.0, "top_k": 64, "top_p": 0.95});
    let gpath = tmp.path().join("generation_config.json");
    let _ = std::fs::remove_file(&gpath);
    std::fs::write(&gpath, gc.to_string()).unwrap();
    let s = load_session(tmp.path(), &test_load_options()).unwrap();
    let d = s.model_sampling_defaults();
    assert_eq!((d.temperature, d.top_k, d.top_p), (Some(1.0), Some(64), Some(0.95)));
    assert!(load_model(tmp.path(), &test_load_options()).unwrap().into_lm().unwrap().info().eos_token_ids.contains(&106));
}

#[test]
fn chat_session_start_and_continue_on_gemma4_text() {
    let r = reference("gemma4_text");
    let mut s = load_session(fixture("gemma4_text"), &test_load_options()).unwrap();
    // The template's stop token is <end_of_turn> (106).
    assert!(s.format().stop_token_ids().contains(&106), "{:?}", s.format().stop_token_ids());
    let res = s.start(vec![ChatMessage::user("Hello! What is 2+2?")], &greedy_chat(16)).unwrap();
    let prompt = ids(&r["chat_input_ids"]);
    let want = ids(&r["chat_greedy_ids"]);
    assert_eq!(res.prompt_tokens, prompt.len());
    assert_eq!(&s.cached_ids()[..prompt.len()], &prompt[..], "template + tokenizer give the reference prompt");
    assert_eq!(res.finish_reason, FinishReason::Length);
    assert_eq!(s.cached_ids(), &want[..], "greedy reply equals transformers'");

    // Continue: the first turn's tokens are reused from the cache.
    let turn1 = s.cached_ids().len();
    let res = s.continue_with("And then?", &greedy_chat(8)).unwrap();
    assert!(res.cached_tokens > 0 && res.cached_tokens <= turn1, "cached {} of {turn1}", res.cached_tokens);
    assert!(res.prompt_tokens > turn1);
    let text = s.format().tokenizer().decode(&s.cached_ids()[turn1 - 16..], false).unwrap();
    assert!(text.contains("<start_of_turn>user\nAnd then?<end_of_turn>"), "{text}");

    // The continued reply equals a fresh greedy run over the same prompt tokens.
    let all = s.cached_ids().to_vec();
    let n = res.num_tokens + usize::from(res.finish_reason == FinishReason::Stop);
    let p = &all[..all.len() - n];
    let model = load_model(fixture("gemma4_text"), &test_load_options()).unwrap().into_lm().unwrap();
    let mut cache = model.new_cache();
    let (fresh, _) = greedy_cached(&model, &mut cache, p, res.num_tokens);
    assert_eq!(fresh, all[p.len()..p.len() + res.num_tokens]);
}

fn paged_model(name: &str, block: Option<usize>) -> mlx_models::Model {
    paged_model_with(name, block, true)
}

/// `contiguous`: `PagedConfig::contiguous_reads` (attention reads per-sequence mirrors of the
/// pool, rotating ones for sliding layers) or not (it gathers from the pool).
fn paged_model_with(name: &str, block: Option<usize>, contiguous: bool) -> mlx_models::Model {
    use mlx_models::{KvCacheMode, PagedConfig};
    let kv_cache = match block {
        Some(bs) => KvCacheMode::Paged(PagedConfig { block_size: bs, memory_mb: Some(8.0), contiguous_reads: contiguous, ..Default::default() }),
        None => KvCacheMode::Flat,
    };
    load_model(fixture(name), &LoadOptions { kv_cache, ..Default::default() }).unwrap().into_lm().unwrap()
}

#[test]
fn paged_equals_flat() {
    // Full layers in the kv-paged block pool, sliding layers in its sliding groups, KV-shared
    // layers reading their anchor's K/V of the same forward.
    for name in ["gemma4_text", "gemma4_text_moe"] {
        let r = reference(name);
        let prompt = ids(&r["input_ids"]);
        let flat = paged_model(name, None);
        let want = greedy_gen(&flat, &prompt, 16, 2048);
        assert_eq!(want, ids(&r["greedy_ids"])[72..], "{name}");
        let a = full_logits(&flat, &prompt);
        for (bs, c) in [(1, true), (5, true), (16, true), (1, false), (5, false), (16, false)] {
            let p = paged_model_with(name, Some(bs), c);
            assert!(p.new_cache().is_paged());
            let b = full_logits(&p, &prompt);
            let e = rel_err(&b.concat(), &a.concat());
            assert!(e < 1e-5, "{name} block size {bs}, contiguous reads {c}: paged vs flat logits rel err {e}");
            // Chunked prefill of 20 plus decode, over a pool holding the prompt's blocks (prefix hit).
            assert_eq!(greedy_gen(&p, &prompt, 16, 20), want, "{name} block size {bs}, contiguous reads {c}");
            assert_eq!(greedy_gen(&paged_model_with(name, Some(bs), c), &prompt, 16, 20), want, "{name} block size {bs}, contiguous reads {c}, cold pool");
        }
    }
}

#[test]
fn chat_sessions_on_paged_equal_flat() {
    let run = |m: mlx_models::Model| {
        let mut s = mlx_models::ChatSession::new(m).unwrap();
        let a = s.start(vec![ChatMessage::user("Hello there")], &greedy_chat(8)).unwrap();
        let b = s.continue_with("And then?", &greedy_chat(8)).unwrap();
        (a.raw_text, b.raw_text, b.cached_tokens, s.cached_ids().to_vec())
    };
    let f = run(paged_model("gemma4_text", None));
    for c in [true, false] {
        assert_eq!(run(paged_model_with("gemma4_text", Some(4), c)), f, "contiguous reads {c}");
    }
    assert!(f.2 > 0);
}

/// Rollback on a paged cache after decode steps: the sliding layers' rotating mirrors cannot go
/// back (they keep only the window), so they start over from the pool, which keeps the window
/// plus the rollback margin. The next tokens' logits equal a flat model's on the rewritten
/// sequence, with the mirrors on and off.
#[test]
fn paged_rollback_past_a_rotating_mirror() {
    use mlx_array::Array;
    let prompt = ids(&reference("gemma4_text")["input_ids"]);
    let last = |m: &mlx_models::Model, cache: &mut mlx_models::Cache, t: &[u32]| -> Vec<f32> {
        let a = Array::from_slice(t, &[1, t.len()]).unwrap();
        m.forward(&a, cache, mlx_models::Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap()
    };
    // The rewritten sequence: prompt[..57], then 5 other tokens.
    let other: Vec<u32> = prompt[57..62].iter().map(|&x| (x + 7) % 200 + 3).collect();
    let mut want_seq = prompt[..57].to_vec();
    want_seq.extend(&other);
    let flat = paged_model("gemma4_text", None);
    let want = full_logits(&flat, &want_seq);
    // Block size 32: the rollback writes 20 kept decode rows (40..60), more than a rotating
    // mirror holds, so they come from the kept rows instead of the mirror.
    for (bs, c) in [(4, true), (4, false), (32, true)] {
        let p = paged_model_with("gemma4_text", Some(bs), c);
        let mut cache = p.new_cache();
        last(&p, &mut cache, &prompt[..40]);
        for i in 40..60 {
            last(&p, &mut cache, &prompt[i..i + 1]); // decode steps: the rotating mirrors wrap (window 16)
        }
        cache.trim(3).unwrap(); // back to 57 positions
        assert_eq!(cache.offset(), 57);
        let got = last(&p, &mut cache, &other[..2]);
        let e = rel_err(&got, &want[58]);
        assert!(e < 1e-5, "block size {bs}, contiguous reads {c}: chunk after rollback, rel err {e}");
        for (i, &t) in other[2..].iter().enumerate() {
            let got = last(&p, &mut cache, &[t]);
            let e = rel_err(&got, &want[59 + i]);
            assert!(e < 1e-5, "block size {bs}, contiguous reads {c}: decode step {i} after rollback, rel err {e}");
        }
    }
}

/// Sliding and global layers, KV sharing after the last cache-writing layer: a last-position
/// prefill queries only that position there and matches all positions' last row.
#[test]
fn last_position_prefill_equals_all_positions() {
    check_last_position_prefill("gemma4_text");
    check_last_position_prefill("gemma4_text_moe");
}
