//! Block-scaled FP8 checkpoints (Qwen3's FP8 release layout: F8_E4M3 `weight` and f32
//! `weight_scale_inv` per 32 x 32 block, `quantization_config.quant_method = "fp8"`), made by
//! `scripts/make_fp8_fixture.py` from the tiny Qwen3 fixture, dequantized at load. The same
//! checkpoint with ml_dtypes' decoding of the bytes times the scales (f32, stored dense) gives the
//! same logits and greedy tokens: the decoding is exact, and the dense path is the Qwen3 family's,
//! checked against transformers in `parity_qwen3.rs`.
mod common;
use common::*;
use mlx_models::load_model;

/// A checkpoint of the fp8 fixture's config.json without `quantization_config` and its
/// `weights` file as `model.safetensors`; returns the directory and that config.
fn without_fp8_config(weights: &str) -> (tempfile::TempDir, serde_json::Value) {
    let src = fixture("qwen3_fp8");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join(weights), dir.path().join("model.safetensors")).unwrap();
    (dir, cfg)
}

#[test]
fn fp8_checkpoint_equals_its_independent_dequantization() {
    let src = fixture("qwen3_fp8");
    let (dense, _) = without_fp8_config("dequantized.safetensors");

    let prompt = ids(&mlx_array::io::load_safetensors(src.join("prompt.safetensors"), None).unwrap()["input_ids"]);
    let fp8 = load_model(&src, &test_load_options()).unwrap().into_lm().unwrap();
    let want = load_model(dense.path(), &test_load_options()).unwrap().into_lm().unwrap();
    let (a, b) = (full_logits(&fp8, &prompt).concat(), full_logits(&want, &prompt).concat());
    let e = rel_err(&a, &b);
    assert!(e < 1e-6, "fp8 vs ml_dtypes-dequantized logits rel err {e}");
    let (ta, _) = greedy_cached(&fp8, &mut fp8.new_cache(), &prompt, 16);
    let (tb, _) = greedy_cached(&want, &mut want.new_cache(), &prompt, 16);
    assert_eq!(ta, tb);
    // and it is a quantization of the bf16 model: close to it, not equal
    let orig = fixture_lm("qwen3");
    let e = rel_err(&a, &full_logits(&orig, &prompt).concat());
    assert!(e > 1e-6 && e < 0.2, "fp8 vs bf16 logits rel err {e}");
}

#[test]
fn fp8_scales_without_their_config_are_an_error() {
    let (dir, mut cfg) = without_fp8_config("model.safetensors");
    let e = load_model(dir.path(), &test_load_options()).err().expect("loads without its fp8 config");
    assert!(e.to_string().contains("weight_scale_inv"), "{e}");
    cfg["quantization_config"] = serde_json::json!({"quant_method": "fp8", "weight_block_size": [32]});
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let e = load_model(dir.path(), &test_load_options()).err().expect("a bad block size loads");
    assert!(matches!(e, mlx_models::ModelError::MalformedConfig { .. }), "{e}");
}
