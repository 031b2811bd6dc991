//! Bad checkpoints and bad calls give typed errors with clear messages, never panics.
mod common;
use common::*;
use mlx_models::registry::detect_model_type;
use mlx_models::{create_random_preset, load_model, LoadOptions, ModelError};
use std::path::Path;

fn write(dir: &Path, name: &str, body: &str) {
    std::fs::write(dir.join(name), body).unwrap();
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, t.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    t
}

fn err(dir: &Path) -> ModelError {
    match load_model(dir, &LoadOptions::default()) {
        Ok(_) => panic!("expected an error loading {}", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn config_detection_rules() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let msg = err(d).to_string();
    assert_eq!(msg, format!("Cannot detect model type: config.json not found in {}", d.display()));

    write(d, "config.json", "{not json");
    assert!(matches!(err(d), ModelError::MalformedConfig { .. }), "{}", err(d));
    write(d, "config.json", "[1, 2]");
    assert_eq!(err(d).to_string(), format!("Malformed config.json in {}: root must be a JSON object", d.display()));
    write(d, "config.json", r#"{"model_type": "qwen3", "architectures": 5}"#);
    assert_eq!(err(d).to_string(), format!("Malformed config.json in {}: \"architectures\" must be an array or a string", d.display()));
    write(d, "config.json", r#"{"model_type": "llama9"}"#);
    assert_eq!(err(d).to_string(), format!("Unsupported model_type \"llama9\" in {}/config.json", d.display()));
    write(d, "config.json", r#"{"model_type": 7}"#);
    assert_eq!(err(d).to_string(), format!("Unsupported model_type \"7\" in {}/config.json", d.display()));

    // Blessed lenient shapes: {} and null model_type default to qwen3; string architectures.
    for (cfg, want) in [
        (r#"{}"#, "qwen3"),
        (r#"{"model_type": null}"#, "qwen3"),
        (r#"{"model_type": "qwen3", "architectures": "Qwen3Model"}"#, "harrier"),
        (r#"{"model_type": "qwen3", "architectures": ["Qwen3Model", "Qwen3ForCausalLM"]}"#, "qwen3"),
        (r#"{"architectures": ["Qwen3Model", 3]}"#, "harrier"),
        (r#"{"model_type": "harrier"}"#, "harrier"),
    ] {
        write(d, "config.json", cfg);
        assert_eq!(detect_model_type(d).unwrap().model_type, want, "{cfg}");
    }
    mlx_models::registry::validate_registry().unwrap();
}

#[test]
fn broken_weights() {
    // Truncated safetensors.
    let t = copy_fixture("qwen3");
    let p = t.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(t.path());
    assert!(matches!(e, ModelError::Array(_)) && e.to_string().contains("truncated"), "{e}");

    // No weights at all.
    std::fs::remove_file(&p).unwrap();
    let e = err(t.path()).to_string();
    assert!(e.contains("safetensors"), "{e}");

    // A missing tensor and a wrong shape, in otherwise valid checkpoints.
    let t = tempfile::tempdir().unwrap();
    create_random_preset("qwen3", "tiny", t.path(), mlx_array::DType::BF16, 0).unwrap();
    let mut w = mlx_array::io::load_safetensors(t.path().join("model.safetensors"), None).unwrap();
    w.remove("model.layers.1.mlp.up_proj.weight");
    let refs: Vec<(&str, &mlx_array::Array)> = w.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx_array::io::save_safetensors(t.path().join("model.safetensors"), &refs, None).unwrap();
    let e = err(t.path()).to_string();
    assert!(e.contains("missing tensor model.layers.1.mlp.up_proj.weight"), "{e}");

    let mut w = mlx_array::io::load_safetensors(fixture("qwen3").join("model.safetensors"), None).unwrap();
    w.insert("model.norm.weight".into(), mlx_array::Array::zeros(&[65], mlx_array::DType::BF16).unwrap());
    let t = copy_fixture("qwen3");
    let refs: Vec<(&str, &mlx_array::Array)> = w.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx_array::io::save_safetensors(t.path().join("model.safetensors"), &refs, None).unwrap();
    let e = err(t.path()).to_string();
    assert!(e.contains("tensor model.norm.weight has shape [65], expected [64]"), "{e}");
}

#[test]
fn invalid_config_values() {
    let t = copy_fixture("qwen3");
    let cfg = std::fs::read_to_string(t.path().join("config.json")).unwrap();
    write(t.path(), "config.json", &cfg.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"));
    let e = err(t.path()).to_string();
    assert!(e.contains("num_attention_heads 4 must be a positive multiple of num_key_value_heads 3"), "{e}");
    write(t.path(), "config.json", &cfg.replace("\"hidden_size\": 64,", "\"hidden_size\": \"big\","));
    assert!(matches!(err(t.path()), ModelError::MalformedConfig { .. }));
}

#[test]
fn bad_tokens_to_forward() {
    let model = load_model(fixture("qwen3"), &LoadOptions::default()).unwrap().into_lm().unwrap();
    let mut cache = model.new_cache();
    for bad in [
        mlx_array::Array::from_slice(&[1i32, 9999], &[1, 2]).unwrap(),
        mlx_array::Array::from_slice(&[-1i32], &[1, 1]).unwrap(),
        mlx_array::Array::from_slice(&[1.0f32], &[1, 1]).unwrap(),
        mlx_array::Array::from_slice(&[1i32, 2], &[2]).unwrap(),
    ] {
        let e = model.forward(&bad, &mut cache, mlx_models::Logits::Last, false).err().unwrap();
        assert!(matches!(e, ModelError::InvalidInput(_)), "{e}");
    }
    assert_eq!(cache.offset(), 0, "rejected input leaves the cache untouched");
}

#[test]
fn random_checkpoint_roundtrip() {
    let t = tempfile::tempdir().unwrap();
    create_random_preset("qwen3", "tiny", t.path(), mlx_array::DType::BF16, 7).unwrap();
    let m = load_model(t.path(), &LoadOptions::default()).unwrap().into_lm().unwrap();
    assert_eq!(m.info().vocab_size, 512);
    assert_eq!(m.info().eos_token_ids, vec![488]);
    mlx_models::chat::ChatFormat::from_dir(t.path()).unwrap();
    // Same seed, same bytes; no temp files left behind.
    let t2 = tempfile::tempdir().unwrap();
    create_random_preset("qwen3", "tiny", t2.path(), mlx_array::DType::BF16, 7).unwrap();
    assert_eq!(std::fs::read(t.path().join("model.safetensors")).unwrap(), std::fs::read(t2.path().join("model.safetensors")).unwrap());
    let names: Vec<String> = std::fs::read_dir(t.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
}
