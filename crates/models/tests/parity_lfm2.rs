//! LFM2 and LFM2-MoE parity against transformers 5.23 (f32 eager reference) on the tiny fixtures:
//! full-prefill logits within 1e-3 relative, 16 greedy tokens identical, cached decode (conv state +
//! K/V) equal to a full recompute, chunked prefill equal to one-shot prefill, and chat sessions
//! through the shared session code.
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::chat::ChatMessage;
use mlx_models::{load_model, load_session, FinishReason, LayerKind, Logits};

#[test]
fn lfm2_and_lfm2_moe_match_transformers() {
    for name in ["lfm2", "lfm2_moe"] {
        check_transformers_parity(name, name);
    }
}

#[test]
fn cache_layout_follows_layer_types() {
    for name in ["lfm2", "lfm2_moe"] {
        let model = fixture_lm(name);
        let spec = model.with_runtime(|rt| rt.cache_spec());
        let conv = LayerKind::Recurrent { slots: 1 };
        let attn = LayerKind::Attention { kv_heads: 2, head_dim: 16 };
        assert_eq!(spec.layers, vec![conv.clone(), attn.clone(), conv, attn], "{name}");
        // Recurrent (conv) state cannot be rolled back: sessions re-prefill instead.
        let mut cache = model.new_cache();
        let t = Array::from_slice(&[1u32, 2, 3], &[1, 3]).unwrap();
        model.forward(&t, &mut cache, Logits::None, false).unwrap();
        assert!(cache.trim(1).is_err());
    }
}

/// Prefill in chunks (sizes that do not divide 71, including single tokens, so the conv state
/// crosses chunk boundaries with fewer than `conv_L_cache` new tokens), then greedy decode.
#[test]
fn chunked_prefill_equals_single_prefill() {
    for name in ["lfm2", "lfm2_moe"] {
        check_chunked_prefill(name, &[20, 1, 2, 1, 30], 8);
    }
}

#[test]
fn batch_rows_are_independent() {
    // Two different rows in one batch give the same logits as each row alone (conv state and MoE
    // routing are per row).
    for name in ["lfm2", "lfm2_moe"] {
        let prompt = ids(&reference(name)["input_ids"]);
        check_batch_rows_independent(&flat_lm(name), &[&prompt[..24], &prompt[30..54]]);
    }
}

/// Enough token-expert rows for the per-expert CPU products (a batch of 2 x 300 tokens at 2
/// experts a token: 1200 rows, from `mlx_models::families::moe::CPU_SEGMENT_ROWS` = 1024) gives
/// each row the logits of that row alone (600 rows: MLX's GatherMM path).
#[test]
fn long_moe_batch_per_expert_products_equal_gather() {
    let rows: Vec<Vec<u32>> = (0..2u32).map(|r| (0..300u32).map(|i| (i * 37 + r * 101 + 5) % 512).collect()).collect();
    check_batch_rows_independent(&flat_lm("lfm2_moe"), &[&rows[0], &rows[1]]);
}

fn session_smoke(name: &str) {
    let r = reference(name);
    let mut s = load_session(fixture(name), &test_load_options()).unwrap();
    let res = s.start(vec![ChatMessage::user("Hello! What is 2+2?")], &greedy_chat(16)).unwrap();
    let want = ids(&r["chat_greedy_ids"]);
    let prompt = ids(&r["chat_input_ids"]);
    assert_eq!(res.prompt_tokens, prompt.len(), "{name}: chat prompt");
    assert_eq!(res.finish_reason, FinishReason::Length);
    assert_eq!(s.cached_ids(), &want[..], "{name}: first turn equals the transformers chat reference");
    // Continue: the conv state cannot be trimmed, so the session re-prefills when it must; the
    // reply equals generation from the same tokens on a fresh cache.
    let res2 = s.continue_with("And then?", &greedy_chat(6)).unwrap();
    assert!(res2.prompt_tokens > want.len());
    assert_eq!(s.history().len(), 4);
    assert_eq!(&s.cached_ids()[..want.len()], &want[..], "{name}: second prompt extends the first turn");
    check_reply_equals_fresh_generation(name, &s, &res2);
}

#[test]
fn chat_sessions_start_and_continue() {
    for name in ["lfm2", "lfm2_moe"] {
        session_smoke(name);
    }
}

/// A copy of fixture `name` whose config.json is `edit(config)`.
fn with_config(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

#[test]
fn transformers5_configs_give_the_same_logits() {
    // transformers 5 writes rope_parameters, full_attn_idxs null and (LFM2) no block_dim /
    // block_ff_dim: the FFN width then comes from intermediate_size through the block_* rule.
    for name in ["lfm2", "lfm2_moe"] {
        let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.hf-5.23-save.json")).unwrap()).unwrap();
        let dir = with_config(name, |c| *c = saved);
        let model = load_model(dir.path(), &test_load_options()).unwrap().into_lm().unwrap();
        let r = reference(name);
        let prompt = ids(&r["input_ids"]);
        let flat: Vec<f32> = full_logits(&model, &prompt).into_iter().flatten().collect();
        let e = rel_err(&flat, &r["logits"].to_vec::<f32>().unwrap());
        assert!(e < 1e-3, "{name} (transformers-5 config): rel err {e}");
    }
}

#[test]
fn bad_configs_are_refused() {
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("lfm2", Box::new(|c| c["layer_types"] = serde_json::json!(["conv", "conv", "conv", "conv"])), "full_attention"),
        ("lfm2", Box::new(|c| c["layer_types"] = serde_json::json!(["conv", "mamba", "conv", "full_attention"])), "mamba"),
        ("lfm2", Box::new(|c| c["full_attn_idxs"] = serde_json::json!([1, 7])), "full_attn_idxs"),
        ("lfm2", Box::new(|c| c["block_multiple_of"] = serde_json::json!(256)), "shape"),
        ("lfm2_moe", Box::new(|c| c["num_experts_per_tok"] = serde_json::json!(5)), "num_experts_per_tok"),
    ];
    for (name, edit, want) in cases {
        let mut edited = None;
        let dir = with_config(name, |c| {
            c.as_object_mut().unwrap().remove("full_attn_idxs");
            edit(c);
            edited = Some(c.clone());
        });
        let err = match load_model(dir.path(), &test_load_options()) {
            Ok(_) => panic!("{name}: config {:?} was accepted", edited),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{name}: error {err:?} should mention {want:?}");
    }
}

#[test]
fn random_checkpoints_load_and_decode_consistently() {
    for moe in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = mlx_models::preset_config(if moe { "lfm2_moe" } else { "lfm2" }, "tiny").unwrap();
        cfg["conv_bias"] = (!moe).into(); // exercise the conv biases on the dense one
        cfg["tie_word_embeddings"] = moe.into(); // and an untied head
        mlx_models::create_random_checkpoint(&cfg, dir.path(), mlx_array::DType::BF16, 7).unwrap();
        let model = load_model(dir.path(), &test_load_options()).unwrap().into_lm().unwrap();
        assert_eq!(model.info().model_type, if moe { "lfm2_moe" } else { "lfm2" });
        assert_eq!(model.info().eos_token_ids, vec![488]);
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
        let mut cache = model.new_cache();
        let (toks, steps) = greedy_cached(&model, &mut cache, &prompt, 6);
        let all: Vec<u32> = prompt.iter().chain(&toks[..5]).copied().collect();
        let full = full_logits(&model, &all);
        for (s, l) in steps.iter().enumerate() {
            assert!(rel_err(l, &full[39 + s]) < 1e-4, "moe={moe}: step {s}");
        }
        // The bundled tokenizer makes it a chat model.
        let mut s = load_session(dir.path(), &test_load_options()).unwrap();
        assert_eq!(s.start(vec![ChatMessage::user("hi")], &greedy_chat(3)).unwrap().num_tokens, 3);
    }
}

#[test]
fn mlx_lm_stacked_expert_layout_loads() {
    // mlx-lm's sanitize stacks experts into `switch_mlp.{gate,up,down}_proj` and transposes the
    // conv weight to [H, K, 1]; both layouts give the same model.
    use mlx_array::ops;
    let dir = with_config("lfm2_moe", |_| {});
    let src = mlx_array::io::load_safetensors(fixture("lfm2_moe").join("model.safetensors"), None).unwrap();
    let mut out: Vec<(String, Array)> = Vec::new();
    for (name, a) in &src {
        if name.contains(".experts.") {
            continue;
        }
        let a = if name.ends_with("conv.conv.weight") { a.transpose(&[0, 2, 1]).unwrap() } else { a.clone() };
        out.push((name.clone(), a));
    }
    for l in 1..4 {
        for (hf, mlx) in [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")] {
            let per: Vec<&Array> = (0..4).map(|e| &src[&format!("model.layers.{l}.feed_forward.experts.{e}.{hf}.weight")]).collect();
            out.push((format!("model.layers.{l}.feed_forward.switch_mlp.{mlx}.weight"), ops::stack(&per, 0).unwrap()));
        }
    }
    let refs: Vec<(&str, &Array)> = out.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx_array::io::save_safetensors(dir.path().join("model.safetensors"), &refs, None).unwrap();
    let model = load_model(dir.path(), &test_load_options()).unwrap().into_lm().unwrap();
    let r = reference("lfm2_moe");
    let flat: Vec<f32> = full_logits(&model, &ids(&r["input_ids"])).into_iter().flatten().collect();
    let e = rel_err(&flat, &r["logits"].to_vec::<f32>().unwrap());
    assert!(e < 1e-3, "stacked layout: rel err {e}");
}

/// The last layer is attention in both fixtures: a last-position prefill queries only that
/// position there and matches all positions' last row (flat and paged attention layers).
#[test]
fn last_position_prefill_equals_all_positions() {
    check_last_position_prefill("lfm2");
    check_last_position_prefill("lfm2_moe");
}

/// A fixture with flat caches (batches of several rows; LFM2 is paged by default, and a paged
/// cache takes one sequence a forward call).
fn flat_lm(name: &str) -> mlx_models::Model {
    let opts = mlx_models::LoadOptions { kv_cache: mlx_models::KvCacheMode::Flat, ..test_load_options() };
    mlx_models::load_model(fixture(name), &opts).unwrap().into_lm().unwrap()
}
