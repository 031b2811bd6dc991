//! Random checkpoints come from the loader itself: for every registered family and preset, the
//! tensors the model reads while being built from the config alone are what the writer saves,
//! and the saved checkpoint loads strictly (every tensor consumed) and decodes.
use mlx_array::DType;
use mlx_models::registry::FAMILIES;
use mlx_models::{create_random_checkpoint, expected_tensors, generate, load_model, preset_config, GenerateConfig, KvCacheMode, LoadOptions, ModelError};

fn opts() -> LoadOptions {
    LoadOptions { kv_cache: KvCacheMode::Flat, ..Default::default() }
}

fn decode(dir: &std::path::Path) -> Vec<u32> {
    let model = load_model(dir, &opts()).unwrap().into_lm().unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
    let mut cache = model.new_cache();
    let cfg = GenerateConfig { max_new_tokens: 4, sampling: sampling::SamplingConfig::greedy(), prefill_step_size: 2048, stop_tokens: Some(vec![]), context: Vec::new() };
    generate(&model, &mut cache, &prompt, cfg).unwrap().map(|t| t.unwrap().id).collect()
}

#[test]
fn every_preset_has_an_expected_layout() {
    for f in FAMILIES {
        assert!(f.presets.iter().any(|(n, _)| *n == "tiny"), "{} has no tiny preset", f.model_type);
        for (name, _) in f.presets {
            let cfg = preset_config(f.model_type, name).unwrap();
            let t = expected_tensors(&cfg).unwrap_or_else(|e| panic!("{}/{name}: {e}", f.model_type));
            assert!(t.len() > 4, "{}/{name}", f.model_type);
            let mut names: Vec<&str> = t.iter().map(|x| x.name.as_str()).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), t.len(), "{}/{name}: a tensor is read twice", f.model_type);
        }
    }
}

#[test]
fn tiny_presets_load_strictly_and_decode() {
    for f in FAMILIES {
        let dir = tempfile::tempdir().unwrap();
        let cfg = preset_config(f.model_type, "tiny").unwrap();
        create_random_checkpoint(&cfg, dir.path(), DType::F32, 3).unwrap();
        let saved = mlx_array::io::load_safetensors(dir.path().join("model.safetensors"), None).unwrap();
        let mut keys: Vec<String> = saved.keys().cloned().collect();
        keys.sort();
        let mut want: Vec<String> = expected_tensors(&cfg).unwrap().into_iter().map(|t| t.name).collect();
        want.sort();
        assert_eq!(keys, want, "{}", f.model_type);
        let loaded = load_model(dir.path(), &opts()).unwrap();
        if f.kind == mlx_models::registry::FamilyKind::Embedding {
            let e = loaded.into_embedding().unwrap();
            assert_eq!(e.encode_ids(&[1, 2, 3]).unwrap().len(), e.hidden_size());
            continue;
        }
        let m = loaded.into_lm().unwrap();
        assert_eq!(m.info().model_type, f.model_type);
        drop(m);
        let toks = decode(dir.path());
        assert_eq!(toks.len(), 4, "{}", f.model_type);
        assert!(toks.iter().all(|&t| t < 512));
    }
}

/// Gemma 4's other layout: MoE blocks, k = v full layers, no PLE, no KV sharing, untied head.
#[test]
fn gemma4_moe_k_eq_v_untied() {
    let mut cfg = preset_config("gemma4", "tiny").unwrap();
    for (k, v) in serde_json::json!({"enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
        "attention_k_eq_v": true, "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "tie_word_embeddings": false})
    .as_object()
    .unwrap()
    {
        cfg[k] = v.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    create_random_checkpoint(&cfg, dir.path(), DType::F32, 3).unwrap();
    assert_eq!(decode(dir.path()).len(), 4);
}

#[test]
fn unexpected_tensors_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    create_random_checkpoint(&preset_config("qwen3", "tiny").unwrap(), dir.path(), DType::F32, 1).unwrap();
    let p = dir.path().join("model.safetensors");
    let mut w = mlx_array::io::load_safetensors(&p, None).unwrap();
    w.insert("model.layers.0.mlp.extra_proj.weight".into(), mlx_array::Array::zeros(&[4, 4], DType::F32).unwrap());
    // set aside on purpose: a rotary table and a tied head's copy
    w.insert("model.layers.0.self_attn.rotary_emb.inv_freq".into(), mlx_array::Array::zeros(&[8], DType::F32).unwrap());
    w.insert("lm_head.weight".into(), mlx_array::Array::zeros(&[512, 64], DType::F32).unwrap());
    let refs: Vec<(&str, &mlx_array::Array)> = w.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx_array::io::save_safetensors(&p, &refs, None).unwrap();
    let e = load_model(dir.path(), &opts()).err().unwrap();
    assert!(matches!(&e, ModelError::Checkpoint { msg, .. } if msg.contains("1 unexpected tensor(s)") && msg.contains("model.layers.0.mlp.extra_proj.weight")), "{e}");
}

#[test]
fn unknown_presets_and_families_are_errors() {
    assert!(preset_config("qwen3", "huge").unwrap_err().to_string().contains("known: tiny, small, 0.6b, 8b"));
    assert!(preset_config("nope", "tiny").is_err());
}
