//! Qwen3.5 vision-language parity against transformers (f32 eager reference) on the tiny
//! fixture `qwen3_5_vl_image` made by `scripts/make_tiny_qwen35_vl.py`: the image processor's
//! pixel values within 1e-5 absolute (Pillow's bicubic resize included), the tower's merged
//! output within 1e-4 relative, the logits of a merged prompt (one image; and two images over two
//! user turns, its last 16 positions) within 1e-3 relative and 8 greedy tokens identical; the chat template plus placeholder expansion gives the processor's
//! ids; a session continued with a second image prefills only the new turn and replies as a
//! fresh prefill of the whole conversation does.
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::chat::ChatMessage;
use mlx_models::families::qwen3_5_vl::QwenImage;
use mlx_models::media::{ImageInput, MediaItem, PreparedMedia};
use mlx_models::{generate, load_session, GenerateConfig, Logits, Model};

const NAME: &str = "qwen3_5_vl_image";

fn image(k: &str) -> ImageInput {
    ImageInput::path(fixture(NAME).join(format!("image_{k}.png")))
}

fn prepare(model: &Model, k: &str) -> PreparedMedia {
    model.with_runtime(|rt| rt.media().expect("a vision-language model").prepare(&MediaItem::Image(image(k)))).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(mlx_array::DType::F32).unwrap().to_vec::<f32>().unwrap()
}

/// The user turns of the reference conversations.
fn first_turn() -> ChatMessage {
    ChatMessage::user("What is in the picture?").with_image(image("a"))
}
fn second_turn() -> ChatMessage {
    ChatMessage::user("And here?").with_image(image("b"))
}

#[test]
fn processor_and_tower_match_transformers() {
    check_images(&["a"]);
}

/// Image B (50x70 to 64x64: Pillow resamples the columns first, as that leaves the smaller
/// intermediate image).
#[test]
fn second_image_matches_transformers() {
    check_images(&["b"]);
}

fn check_images(keys: &[&str]) {
    let r = reference(NAME);
    let model = fixture_lm(NAME);
    assert_eq!(model.info().model_type, "qwen3_5_vl");
    for &k in keys {
        let p = prepare(&model, k);
        let img = p.data.downcast_ref::<QwenImage>().unwrap();
        let grid = ids(&r[&format!("grid_{k}")]);
        assert_eq!(vec![1, img.grid_h as u32, img.grid_w as u32], grid, "image {k}: patch grid");
        if let Some(want) = r.get(&format!("pixel_values_{k}")) {
            let want = f32s(want);
            let d = img.pixels.iter().zip(&want).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert_eq!(img.pixels.len(), want.len());
            assert!(d < 1e-5, "image {k}: pixel values differ by {d}");
        }
        // The tower's output is what the prompt embeddings hold at the image tokens.
        let tokens = p.tokens;
        let ids: Vec<u32> = std::iter::once(1).chain(std::iter::repeat_n(498, tokens)).chain([2]).collect();
        let cache = model.new_cache();
        let e = model.with_runtime(|rt| rt.media().unwrap().embed(&ids, std::slice::from_ref(&p), &cache)).unwrap();
        let rows = f32s(&e.embeds.slice_axis(1, 1, 1 + tokens).unwrap());
        let err = rel_err(&rows, &f32s(&r[&format!("tower_{k}")]));
        assert!(err < 1e-4, "image {k}: tower rel err {err}");
    }
}

/// Logits of the whole merged prompt, then 8 greedy tokens through the cache.
#[test]
fn merged_prompt_matches_transformers() {
    check_prompts(&[("1", &["a"])]);
}

/// Two images over two user turns (its last 16 positions: image B's tokens and the text after).
#[test]
fn two_image_prompt_matches_transformers() {
    check_prompts(&[("2", &["a", "b"])]);
}

fn check_prompts(cases: &[(&str, &[&str])]) {
    let r = reference(NAME);
    let model = fixture_lm(NAME);
    for &(n, keys) in cases {
        let prompt = ids(&r[&format!("ids_{n}")]);
        let media: Vec<PreparedMedia> = keys.iter().map(|k| prepare(&model, k)).collect();
        let mut cache = model.new_cache();
        let logits = model
            .with_runtime(|rt| {
                let m = rt.media().unwrap();
                let input = m.embed(&prompt, &media, &cache)?;
                m.forward_embedded(&input, &mut cache, Logits::All, false)
            })
            .unwrap()
            .logits
            .unwrap();
        // The reference keeps the last rows of the second prompt only.
        let want = f32s(&r[&format!("logits_{n}")]);
        let got = f32s(&logits);
        let err = rel_err(&got[got.len() - want.len()..], &want);
        assert!(err < 1e-3, "prompt {n}: logits rel err {err}");
        let mut cache = model.new_cache();
        let cfg = GenerateConfig { max_new_tokens: 8, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(vec![]), ..Default::default() };
        let got: Vec<u32> = generate(&model, &mut cache, &prompt, cfg).unwrap().with_media(media).map(|t| t.unwrap().id).collect();
        assert_eq!(got, ids(&r[&format!("greedy_{n}")])[prompt.len()..], "prompt {n}: greedy tokens");
    }
}

#[test]
fn chat_template_and_expansion_give_the_processor_ids() {
    let r = reference(NAME);
    let want = ids(&r["ids_1"]);
    let mut s = load_session(fixture(NAME), &test_load_options()).unwrap();
    assert!(s.supports_images());
    let cfg = greedy_chat(4);
    assert_eq!(s.expanded_prompt_tokens(&[first_turn()], &cfg).unwrap(), want.len());
    let res = s.start(vec![first_turn()], &cfg).unwrap();
    assert_eq!(res.prompt_tokens, want.len());
    assert_eq!(&s.cached_ids()[..want.len()], &want[..]);
    // The two-turn conversation of the reference, rendered whole.
    let full = vec![first_turn(), ChatMessage::assistant("A red square."), second_turn()];
    assert_eq!(s.expanded_prompt_tokens(&full, &cfg).unwrap(), ids(&r["ids_2"]).len());
}

#[test]
fn continued_turn_with_a_new_image_prefills_only_that_turn() {
    let mut s = load_session(fixture(NAME), &test_load_options()).unwrap();
    let cfg = greedy_chat(6);
    let first = s.start(vec![first_turn()], &cfg).unwrap();
    assert_eq!(first.cached_tokens, 0);
    let held = s.cached_ids().len();
    let second = s.continue_stream(vec![second_turn()], &cfg).unwrap().collect_result().unwrap();
    assert_eq!(second.cached_tokens, held, "the first turn stays in the cache");
    assert!(second.prompt_tokens > held + 4, "the new turn holds the second image's tokens");
    // The reply equals greedy generation over the same tokens and both images on a fresh cache.
    let all = s.cached_ids().to_vec();
    let prompt = &all[..second.prompt_tokens];
    let model = fixture_lm(NAME);
    let media = vec![prepare(&model, "a"), prepare(&model, "b")];
    let mut cache = model.new_cache();
    let gcfg = GenerateConfig { max_new_tokens: second.num_tokens, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(s.format().stop_token_ids()), ..Default::default() };
    let fresh: Vec<u32> = generate(&model, &mut cache, prompt, gcfg).unwrap().with_media(media).map(|t| t.unwrap().id).collect();
    assert_eq!(fresh, all[prompt.len()..prompt.len() + second.num_tokens]);
    // A restart with a different first image reuses nothing past the tokens before it.
    let other = ChatMessage::user("What is in the picture?").with_image(image("b"));
    let res = s.start(vec![other], &cfg).unwrap();
    assert!(res.cached_tokens < 8, "a changed image is prefilled again (cached {})", res.cached_tokens);
}

#[test]
fn text_only_models_refuse_images() {
    let mut s = load_session(fixture("qwen3_5"), &test_load_options()).unwrap();
    assert!(!s.supports_images());
    let err = s.start(vec![first_turn()], &greedy_chat(2)).err().unwrap();
    assert!(err.to_string().contains("takes no"), "{err}");
}
