//! Every family reads `rope_scaling`: the hybrid families (Qwen3.5, LFM2) too. A scaled rope
//! changes the logits, `mrope` (text positions) and `default` leave them as they are, both the
//! `rope_type` and the older `type` key are read, and an unknown type is a typed error (Gemma 4's
//! per-type `rope_parameters` too).
mod common;

use common::{fixture, full_logits, test_load_options};
use mlx_models::{load_model, ModelError};
use serde_json::{json, Value};
use std::path::Path;

/// A copy of fixture `name` whose text config gets `rope_scaling = scaling`.
fn with_scaling(name: &str, scaling: Value, dir: &Path) {
    let src = fixture(name);
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let text = match cfg.get_mut("text_config") {
        Some(t) => t,
        None => &mut cfg,
    };
    text["rope_scaling"] = scaling;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

fn logits_with(name: &str, scaling: Value) -> Result<Vec<Vec<f32>>, ModelError> {
    let dir = tempfile::tempdir().unwrap();
    with_scaling(name, scaling, dir.path());
    let m = load_model(dir.path(), &test_load_options())?.into_lm()?;
    Ok(full_logits(&m, &(1..40).collect::<Vec<u32>>()))
}

#[test]
fn hybrid_families_read_rope_scaling() {
    for name in ["qwen3_5", "lfm2"] {
        let plain = logits_with(name, Value::Null).unwrap();
        let same = [
            json!({"rope_type": "default"}),
            json!({"type": "mrope", "mrope_section": [2, 1, 1]}),
            json!({"rope_type": "default", "type": "default", "mrope_section": [2, 1, 1]}),
        ];
        for s in same {
            assert_eq!(logits_with(name, s.clone()).unwrap(), plain, "{name}: {s} is plain rope");
        }
        for s in [json!({"rope_type": "linear", "factor": 4.0}), json!({"type": "linear", "factor": 4.0}), json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})] {
            let scaled = logits_with(name, s.clone()).unwrap();
            let diff = scaled.iter().flatten().zip(plain.iter().flatten()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff > 1e-3, "{name}: {s} changes the logits (max diff {diff})");
        }
        for s in [json!({"rope_type": "longrope-ish", "factor": 2.0}), json!({"rope_type": "linear"})] {
            match logits_with(name, s.clone()) {
                Err(ModelError::MalformedConfig { reason, .. }) => assert!(reason.contains("rope_scaling"), "{name}: {reason}"),
                Err(e) => panic!("{name}: {s}: unexpected error {e}"),
                Ok(_) => panic!("{name}: {s} must be refused"),
            }
        }
    }
}

/// Gemma 4 reads its per-layer-type `rope_parameters` itself: a type other than `default` and
/// `proportional` is refused, not run as plain rope.
#[test]
fn gemma4_refuses_unknown_rope_types() {
    let dir = tempfile::tempdir().unwrap();
    with_scaling("gemma4_text", Value::Null, dir.path());
    let path = dir.path().join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let text = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
    assert!(text["rope_parameters"]["full_attention"].is_object(), "the fixture has per-type rope parameters");
    text["rope_parameters"]["full_attention"]["rope_type"] = json!("yarn");
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    match load_model(dir.path(), &test_load_options()) {
        Err(ModelError::MalformedConfig { reason, .. }) => assert!(reason.contains("\"yarn\""), "{reason}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a yarn rope_type must be refused"),
    }
}
