//! PaddleOCR-VL parity against transformers (f32 eager reference) on the tiny fixture
//! `paddleocr_vl` made by `scripts/make_tiny_paddleocr_vl.py` (hub-style config and tensor
//! names): the image processor's pixel values within 1e-5 absolute (the smart resize, a thin
//! image's widening and Pillow's bicubic resize included), the encoder's and the projector's
//! outputs within 1e-4 relative, the logits of a merged prompt (one image; and two images over two
//! user turns, its last 16 positions) within 1e-3 relative and 8 greedy tokens identical; the
//! chat template plus placeholder expansion gives the processor's ids; a session continued with a
//! second image prefills only the new turn and replies as a fresh prefill of the whole
//! conversation does; transformers' own tensor layout loads to the same model.
mod common;
use common::vlm::{self, f32s};
use common::*;
use mlx_array::{Array, DType};
use mlx_models::families::paddleocr_vl::{VisionConfig, VisionTower};
use mlx_models::families::qwen3_5_vl::QwenImage;
use mlx_models::weights::Weights;

const NAME: &str = "paddleocr_vl";
const IMAGE_TOKEN: u32 = 498;

/// The encoder and projector of the checkpoint in `dir`, under `encoder` and `projector`.
fn tower(dir: &std::path::Path, encoder: &str, projector: &str) -> VisionTower {
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = VisionConfig::from_config(&config).unwrap();
    let w = Weights::load(dir, Some(DType::F32)).unwrap();
    VisionTower::load(&w.root().pp(encoder), &w.root().pp(projector), cfg, 64).unwrap()
}

/// Image A (100x61 to 96x64, a 12x8 patch grid): pixel values, the encoder's output and the
/// projector's, directly and as the prompt embeddings at the image tokens.
#[test]
fn processor_encoder_and_projector_match_transformers() {
    let r = reference(NAME);
    let model = fixture_lm(NAME);
    assert_eq!(model.info().model_type, "paddleocr_vl");
    let p = vlm::check_processor(&model, NAME, &r, "a");
    let img = p.data.downcast_ref::<QwenImage>().unwrap();
    let t = tower(&fixture(NAME), "visual.vision_model", "mlp_AR");
    let px = Array::from_slice(&img.pixels, &[img.grid_h * img.grid_w, img.pixels.len() / (img.grid_h * img.grid_w)]).unwrap();
    let enc = t.encode(&px, img.grid_h, img.grid_w).unwrap();
    let err = rel_err(&f32s(&enc), &f32s(&r["vision_a"]));
    eprintln!("image a: encoder rel err {err:.2e}");
    assert!(err < 1e-4, "encoder rel err {err}");
    let proj = f32s(&t.project(&enc, img.grid_h, img.grid_w).unwrap());
    let want = f32s(&r["tower_a"]);
    let err = rel_err(&proj, &want);
    eprintln!("image a: projector rel err {err:.2e}");
    assert!(err < 1e-4, "projector rel err {err}");
    let err = rel_err(&vlm::tower_rows(&model, &p, IMAGE_TOKEN), &want);
    eprintln!("image a: merged embeddings rel err {err:.2e}");
    assert!(err < 1e-4, "merged embeddings rel err {err}");
}

/// Image B (12x70: narrower than the 16-pixel factor, widened to 16x93 by the resize rule, then
/// 16x96, a 2x12 patch grid).
#[test]
fn thin_image_matches_transformers() {
    let r = reference(NAME);
    let model = fixture_lm(NAME);
    let p = vlm::check_processor(&model, NAME, &r, "b");
    assert!(r.contains_key("pixel_values_b"));
    let err = rel_err(&vlm::tower_rows(&model, &p, IMAGE_TOKEN), &f32s(&r["tower_b"]));
    eprintln!("image b: tower rel err {err:.2e}");
    assert!(err < 1e-4, "tower rel err {err}");
}

common::vlm::session_tests!(NAME, "OCR:");

/// The checkpoint rewritten with transformers' tensor names (`model.language_model.*`,
/// `model.visual.*`, `model.projector.*`) loads and gives the same tower output and logits.
#[test]
fn transformers_layout_loads_the_same_model() {
    let src = fixture(NAME);
    let tmp = copy_without_weights();
    let dir = tmp.path();
    let tensors = mlx_array::io::load_safetensors(src.join("model.safetensors"), None).unwrap();
    let renamed: Vec<(String, Array)> = tensors
        .into_iter()
        .map(|(k, v)| {
            let k = if let Some(rest) = k.strip_prefix("mlp_AR.") {
                format!("model.projector.{rest}")
            } else if let Some(rest) = k.strip_prefix("visual.") {
                format!("model.visual.{rest}")
            } else if let Some(rest) = k.strip_prefix("model.") {
                format!("model.language_model.{rest}")
            } else {
                k
            };
            (k, v)
        })
        .collect();
    let refs: Vec<(&str, &Array)> = renamed.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx_array::io::save_safetensors(dir.join("model.safetensors"), &refs, None).unwrap();
    let r = reference(NAME);
    let model = mlx_models::load_model(dir, &test_load_options()).unwrap().into_lm().unwrap();
    let p = model
        .with_runtime(|rt| {
            rt.media()
                .unwrap()
                .prepare(&mlx_models::media::MediaItem::Image(mlx_models::media::ImageInput::path(
                    dir.join("image_a.png"),
                )))
        })
        .unwrap();
    let err = rel_err(&vlm::tower_rows(&model, &p, IMAGE_TOKEN), &f32s(&r["tower_a"]));
    eprintln!("transformers layout: tower rel err {err:.2e}");
    assert!(err < 1e-4, "tower rel err {err}");
    let logits = vlm::merged_logits(&model, &ids(&r["ids_1"]), std::slice::from_ref(&p));
    let err = rel_err(&logits, &f32s(&r["logits_1"]));
    eprintln!("transformers layout: prompt 1 logits rel err {err:.2e}");
    assert!(err < 1e-3, "logits rel err {err}");
}

/// The fixture's files but its weights, in a temporary directory.
fn copy_without_weights() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "image_a.png",
    ] {
        std::fs::copy(fixture(NAME).join(f), tmp.path().join(f)).unwrap();
    }
    tmp
}

/// Configs the model cannot follow are config errors naming the key; sounds are refused.
#[test]
fn bad_configs_and_audio_are_typed_errors() {
    let load = |edit: &dyn Fn(&std::path::Path)| {
        let tmp = copy_without_weights();
        std::fs::copy(fixture(NAME).join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
        edit(tmp.path());
        mlx_models::load_model(tmp.path(), &test_load_options()).err().map(|e| e.to_string())
    };
    let set = |file: &'static str, key: &'static str, value: serde_json::Value| {
        move |dir: &std::path::Path| {
            let path = dir.join(file);
            let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let (outer, inner) = key.split_once('.').unwrap_or((key, ""));
            if inner.is_empty() {
                v[outer] = value.clone();
            } else {
                v[outer][inner] = value.clone();
            }
            std::fs::write(&path, v.to_string()).unwrap();
        }
    };
    let err = load(&set("config.json", "rope_scaling.mrope_section", serde_json::json!([16, 24, 24]))).unwrap();
    assert!(err.contains("mrope_section [16, 24, 24] must sum to head_dim / 2 = 8"), "{err}");
    let err = load(&set("preprocessor_config.json", "temporal_patch_size", serde_json::json!(2))).unwrap();
    assert!(err.contains("temporal_patch_size 2"), "{err}");
    let err = load(&set(
        "config.json",
        "vision_config.rope_parameters",
        serde_json::json!({"rope_type": "default"}),
    ))
    .unwrap();
    assert!(err.contains("only axial rope"), "{err}");
    let err = load(&set("config.json", "image_token_id", serde_json::json!(600))).unwrap();
    assert!(err.contains("image_token_id 600"), "{err}");
    let model = fixture_lm(NAME);
    let audio = mlx_models::media::MediaItem::Audio(mlx_models::media::AudioInput::Pcm(vec![0.0; 160]));
    let err = model.with_runtime(|rt| rt.media().unwrap().prepare(&audio)).unwrap_err().to_string();
    assert!(err.contains("takes images"), "{err}");
}
