//! Qwen3.5 vision-language parity against transformers (f32 eager reference) on the tiny
//! fixture `qwen3_5_vl_image` made by `scripts/make_tiny_qwen35_vl.py`: the image processor's
//! pixel values within 1e-5 absolute (Pillow's bicubic resize included), the tower's merged
//! output within 1e-4 relative, the logits of a merged prompt (one image; and two images over two
//! user turns, its last 16 positions) within 1e-3 relative and 8 greedy tokens identical; the chat template plus placeholder expansion gives the processor's
//! ids; a session continued with a second image prefills only the new turn and replies as a
//! fresh prefill of the whole conversation does.
mod common;
use common::vlm::{self, f32s};
use common::*;
use mlx_models::load_session;

const NAME: &str = "qwen3_5_vl_image";
const IMAGE_TOKEN: u32 = 498;

#[test]
fn processor_and_tower_match_transformers() {
    check_images(&["a"]);
}

/// Image B (50x70 to 64x64: the height shrinks while the width grows, so Pillow 13 runs the
/// vertical pass first, [`mlx_models::media::resize`]).
#[test]
fn second_image_matches_transformers() {
    check_images(&["b"]);
}

fn check_images(keys: &[&str]) {
    let r = reference(NAME);
    let model = fixture_lm(NAME);
    assert_eq!(model.info().model_type, "qwen3_5_vl");
    for &k in keys {
        let p = vlm::check_processor(&model, NAME, &r, k);
        // The tower's output is what the prompt embeddings hold at the image tokens.
        let err = rel_err(&vlm::tower_rows(&model, &p, IMAGE_TOKEN), &f32s(&r[&format!("tower_{k}")]));
        assert!(err < 1e-4, "image {k}: tower rel err {err}");
    }
}

common::vlm::session_tests!(NAME, "What is in the picture?");

#[test]
fn text_only_models_refuse_images() {
    let mut s = load_session(fixture("qwen3_5"), &test_load_options()).unwrap();
    assert!(!s.supports_images());
    let err = s.start(vec![vlm::turn(NAME, "What is in the picture?", "a")], &greedy_chat(2)).err().unwrap();
    assert!(err.to_string().contains("takes no"), "{err}");
}
