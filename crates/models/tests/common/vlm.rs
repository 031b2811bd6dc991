//! Helpers shared by the vision-language parity tests. A fixture made by a
//! `scripts/make_tiny_*vl*.py` generator holds `image_{k}.png` and references `ids_{n}` (an
//! expanded prompt), `logits_{n}` (its logits, or the last rows of them) and `greedy_{n}` (the
//! prompt and greedy tokens).
use super::*;
use mlx_models::chat::ChatMessage;
use mlx_models::families::qwen3_5_vl::QwenImage;
use mlx_models::media::{ImageInput, MediaItem, PreparedMedia};
use mlx_models::{generate, load_session, GenerateConfig};

/// Image `k` of fixture `name`.
pub fn image(name: &str, k: &str) -> ImageInput {
    ImageInput::path(fixture(name).join(format!("image_{k}.png")))
}

/// Image `k` of fixture `name`, preprocessed by `model`.
pub fn prepare(model: &Model, name: &str, k: &str) -> PreparedMedia {
    model
        .with_runtime(|rt| rt.media().expect("a vision-language model").prepare(&MediaItem::Image(image(name, k))))
        .unwrap()
}

pub fn f32s(a: &Array) -> Vec<f32> {
    a.astype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

/// The largest absolute difference of two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Image `k` of fixture `name` preprocessed by `model`: its patch grid equals the reference's
/// `grid_{k}`, its pixel values (a [`QwenImage`]) `pixel_values_{k}` within 1e-5 absolute when
/// the reference keeps them.
pub fn check_processor(model: &Model, name: &str, r: &HashMap<String, Array>, k: &str) -> PreparedMedia {
    let p = prepare(model, name, k);
    let img = p.data.downcast_ref::<QwenImage>().expect("a Qwen-style image");
    assert_eq!(
        vec![1, img.grid_h as u32, img.grid_w as u32],
        ids(&r[&format!("grid_{k}")]),
        "image {k}: patch grid"
    );
    if let Some(want) = r.get(&format!("pixel_values_{k}")) {
        let d = max_abs_diff(&img.pixels, &f32s(want));
        eprintln!("{name} image {k}: pixel values max |diff| {d:.2e}");
        assert!(d < 1e-5, "image {k}: pixel values differ by {d}");
    }
    p
}

/// The merged tower output of `p`: the prompt embeddings at its image tokens (`image_token`)
/// between two text tokens.
pub fn tower_rows(model: &Model, p: &PreparedMedia, image_token: u32) -> Vec<f32> {
    let ids: Vec<u32> = std::iter::once(1).chain(std::iter::repeat_n(image_token, p.tokens)).chain([2]).collect();
    let cache = model.new_cache();
    let e = model
        .with_runtime(|rt| rt.media().unwrap().embed(&ids, std::slice::from_ref(p), &cache))
        .unwrap();
    f32s(&e.embeds.slice_axis(1, 1, 1 + p.tokens).unwrap())
}

/// The logits of every position of the expanded `prompt` with `media` merged in, on a fresh cache.
pub fn merged_logits(model: &Model, prompt: &[u32], media: &[PreparedMedia]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let out = model
        .with_runtime(|rt| {
            let m = rt.media().unwrap();
            let input = m.embed(prompt, media, &cache)?;
            m.forward_embedded(&input, &mut cache, Logits::All, false)
        })
        .unwrap();
    f32s(&out.logits.unwrap())
}

/// For each `(n, images)`: the logits of the merged prompt `ids_{n}` with those images (the
/// reference's rows, the last ones when it keeps fewer) within 1e-3 relative, and its greedy
/// tokens (`greedy_{n}`) through the cache identical.
pub fn check_prompts(name: &str, cases: &[(&str, &[&str])]) {
    let r = reference(name);
    let model = fixture_lm(name);
    for &(n, keys) in cases {
        let prompt = ids(&r[&format!("ids_{n}")]);
        let media: Vec<PreparedMedia> = keys.iter().map(|k| prepare(&model, name, k)).collect();
        let want = f32s(&r[&format!("logits_{n}")]);
        let got = merged_logits(&model, &prompt, &media);
        let err = rel_err(&got[got.len() - want.len()..], &want);
        eprintln!("{name} prompt {n}: logits rel err {err:.2e}");
        assert!(err < 1e-3, "{name} prompt {n}: logits rel err {err}");
        let mut cache = model.new_cache();
        let cfg = GenerateConfig {
            max_new_tokens: 8,
            sampling: sampling::SamplingConfig::greedy(),
            stop_tokens: Some(vec![]),
            ..Default::default()
        };
        let got: Vec<u32> = generate(&model, &mut cache, &prompt, cfg)
            .unwrap()
            .with_media(media)
            .map(|t| t.unwrap().id)
            .collect();
        assert_eq!(got, ids(&r[&format!("greedy_{n}")])[prompt.len()..], "{name} prompt {n}: greedy tokens");
    }
}

/// A session over fixture `name` renders `first` (one user turn with image A) to the
/// reference's `ids_1`, and the whole conversation `full` to as many tokens as `ids_2`.
pub fn check_template_expansion(name: &str, first: ChatMessage, full: Vec<ChatMessage>) {
    let r = reference(name);
    let want = ids(&r["ids_1"]);
    let mut s = load_session(fixture(name), &test_load_options()).unwrap();
    assert!(s.supports_images());
    let cfg = greedy_chat(4);
    assert_eq!(s.expanded_prompt_tokens(std::slice::from_ref(&first), &cfg).unwrap(), want.len());
    let res = s.start(vec![first], &cfg).unwrap();
    assert_eq!(res.prompt_tokens, want.len());
    assert_eq!(&s.cached_ids()[..want.len()], &want[..]);
    assert_eq!(s.expanded_prompt_tokens(&full, &cfg).unwrap(), ids(&r["ids_2"]).len());
}

/// A session over fixture `name` started with `first` (image A) and continued with `second`
/// (image B) prefills only the second turn, and replies as greedy generation over the same
/// tokens and both images on a fresh cache does; a restart with `other` (a different first
/// image) reuses nothing past the tokens before it.
pub fn check_continued_turn(name: &str, first: ChatMessage, second: ChatMessage, other: ChatMessage) {
    let mut s = load_session(fixture(name), &test_load_options()).unwrap();
    let cfg = greedy_chat(6);
    let res = s.start(vec![first], &cfg).unwrap();
    assert_eq!(res.cached_tokens, 0);
    let held = s.cached_ids().len();
    let res = s.continue_stream(vec![second], &cfg).unwrap().collect_result().unwrap();
    assert_eq!(res.cached_tokens, held, "{name}: the first turn stays in the cache");
    assert!(res.prompt_tokens > held + 4, "{name}: the new turn holds the second image's tokens");
    let all = s.cached_ids().to_vec();
    let prompt = &all[..res.prompt_tokens];
    let model = fixture_lm(name);
    let media = vec![prepare(&model, name, "a"), prepare(&model, name, "b")];
    let mut cache = model.new_cache();
    let gcfg = GenerateConfig {
        max_new_tokens: res.num_tokens,
        sampling: sampling::SamplingConfig::greedy(),
        stop_tokens: Some(s.format().stop_token_ids()),
        ..Default::default()
    };
    let fresh: Vec<u32> = generate(&model, &mut cache, prompt, gcfg)
        .unwrap()
        .with_media(media)
        .map(|t| t.unwrap().id)
        .collect();
    assert_eq!(
        fresh,
        all[prompt.len()..prompt.len() + res.num_tokens],
        "{name}: the reply equals a fresh prefill's"
    );
    let res = s.start(vec![other], &cfg).unwrap();
    assert!(
        res.cached_tokens < 8,
        "{name}: a changed image is prefilled again (cached {})",
        res.cached_tokens
    );
}

/// A user turn of `text` with image `k` of fixture `name`.
pub fn turn(name: &str, text: &str, k: &str) -> ChatMessage {
    ChatMessage::user(text).with_image(image(name, k))
}

/// The prompt, template and session tests every vision-language fixture runs (the generators
/// write the same conversations): `$name` the fixture, `$first` the text of the first user turn
/// (with image A; the second is "And here?" with image B, after the assistant's "A red
/// square.").
#[allow(unused_macros)]
macro_rules! session_tests {
    ($name:expr, $first:expr) => {
        /// Logits of the whole merged prompt, then 8 greedy tokens through the cache.
        #[test]
        fn merged_prompt_matches_transformers() {
            common::vlm::check_prompts($name, &[("1", &["a"])]);
        }

        /// Two images over two user turns (its last 16 positions: image B's tokens and the text
        /// after).
        #[test]
        fn two_image_prompt_matches_transformers() {
            common::vlm::check_prompts($name, &[("2", &["a", "b"])]);
        }

        #[test]
        fn chat_template_and_expansion_give_the_processor_ids() {
            use common::vlm::turn;
            let full = vec![
                turn($name, $first, "a"),
                mlx_models::chat::ChatMessage::assistant("A red square."),
                turn($name, "And here?", "b"),
            ];
            common::vlm::check_template_expansion($name, turn($name, $first, "a"), full);
        }

        #[test]
        fn continued_turn_with_a_new_image_prefills_only_that_turn() {
            use common::vlm::turn;
            common::vlm::check_continued_turn($name, turn($name, $first, "a"), turn($name, "And here?", "b"), turn($name, $first, "b"));
        }
    };
}
#[allow(unused_imports)]
pub(crate) use session_tests;
