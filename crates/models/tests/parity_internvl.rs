//! InternVL parity against transformers (f32 eager reference) on the tiny fixtures made by
//! `scripts/make_tiny_internvl.py`, for both layouts: `internvl` (transformers' native
//! `InternVLForConditionalGeneration`) and `internvl_chat` (the same weights in the layout
//! InternVL-Chat and Qianfan-OCR checkpoints ship, tiling settings in config.json). Both are held
//! to the native model's references: the image processor's pixel values (dynamic tiling plus
//! thumbnail, Pillow's bicubic resize included) within 1e-5 absolute, the projector's output
//! within 1e-4 relative, the logits of a merged prompt (one image; and two images over two user
//! turns, its last 16 positions) within 1e-3 relative and 8 greedy tokens identical; the chat
//! template plus placeholder expansion gives the processor's ids; a session continued with a
//! second image prefills only the new turn and replies as a fresh prefill of the whole
//! conversation does; the OCR entry point reads the image as greedy generation does.
mod common;
use common::*;
use mlx_models::chat::ChatMessage;
use mlx_models::families::internvl::InternImage;
use mlx_models::media::{ImageInput, PreparedMedia};
use mlx_models::ocr::Ocr;
use mlx_models::{load_session, Model, ModelError};

/// The native fixture (which holds the references) and its InternVL-Chat re-keying.
const LAYOUTS: [&str; 2] = ["internvl", "internvl_chat"];
const REF: &str = "internvl";
/// `<IMG_CONTEXT>`, `<img>`, `</img>` of the fixture's tokenizer.
const CONTEXT: u32 = 498;
const START: u32 = 495;
const END: u32 = 496;

/// Image `k` of the fixtures (`a`: 100x45, `b`: 40x70).
fn image(k: &str) -> ImageInput {
    ImageInput::path(fixture(REF).join(format!("image_{k}.png")))
}

fn prepare(model: &Model, k: &str) -> PreparedMedia {
    prepare_image(model, fixture(REF).join(format!("image_{k}.png")))
}

/// The reference conversation: a user turn with image A, an assistant reply, a user turn with
/// image B.
fn turns() -> [ChatMessage; 3] {
    [
        ChatMessage::user("Read the text in the image.").with_image(image("a")),
        ChatMessage::assistant("A red square."),
        ChatMessage::user("And here?").with_image(image("b")),
    ]
}
fn first_turn() -> ChatMessage {
    turns()[0].clone()
}

#[test]
fn processor_and_tower_match_transformers() {
    let r = reference(REF);
    for name in LAYOUTS {
        let model = fixture_lm(name);
        assert_eq!(model.info().model_type, "internvl");
        for k in ["a", "b"] {
            let p = prepare(&model, k);
            let img = p.data.downcast_ref::<InternImage>().unwrap();
            let want = r[&format!("pixel_values_{k}")].clone();
            assert_eq!(
                img.tiles,
                want.dims()[0] as usize,
                "{name} image {k}: tiles"
            );
            let want = f32s(&want);
            assert_eq!(img.pixels.len(), want.len());
            let d = img
                .pixels
                .iter()
                .zip(&want)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            // The tower over the reference's pixel values: the projector's output is what the
            // prompt embeddings hold at the context tokens.
            let p = PreparedMedia {
                data: std::sync::Arc::new(InternImage {
                    pixels: want,
                    tiles: img.tiles,
                }),
                ..p.clone()
            };
            let n = p.tokens - 2;
            let ids: Vec<u32> = [1, START]
                .into_iter()
                .chain(std::iter::repeat_n(CONTEXT, n))
                .chain([END, 2])
                .collect();
            let expanded = model
                .with_runtime(|rt| {
                    rt.media()
                        .unwrap()
                        .expand(&[1, CONTEXT, 2], std::slice::from_ref(&p))
                })
                .unwrap();
            assert_eq!(expanded, ids, "{name} image {k}: placeholder expansion");
            let cache = model.new_cache();
            let e = model
                .with_runtime(|rt| {
                    rt.media()
                        .unwrap()
                        .embed(&ids, std::slice::from_ref(&p), &cache)
                })
                .unwrap();
            let rows = f32s(&e.embeds.slice_axis(1, 2, 2 + n).unwrap());
            let err = rel_err(&rows, &f32s(&r[&format!("tower_{k}")]));
            eprintln!("{name} image {k}: {} tiles, pixel values max abs diff {d:e}, tower rel err {err:e}", img.tiles);
            assert!(err < 1e-4, "{name} image {k}: tower rel err {err}");
            assert!(d < 1e-5, "{name} image {k}: pixel values differ by {d}");
        }
    }
}

/// Logits of the whole merged prompt, then 8 greedy tokens through the cache; one image, then two
/// images over two user turns (the reference keeps the last 16 positions of that one).
#[test]
fn merged_prompts_match_transformers() {
    for name in LAYOUTS {
        check_prompts(name, &fixture_lm(name));
    }
}

fn check_prompts(name: &str, model: &Model) {
    let r = reference(REF);
    for (n, keys) in [("1", &["a"][..]), ("2", &["a", "b"][..])] {
        let prompt = ids(&r[&format!("ids_{n}")]);
        let media: Vec<PreparedMedia> = keys.iter().map(|k| prepare(model, k)).collect();
        let want = f32s(&r[&format!("logits_{n}")]);
        let got = media_prompt_logits(model, &prompt, &media);
        let err = rel_err(&got[got.len() - want.len()..], &want);
        eprintln!(
            "{name} prompt {n}: {} tokens, logits rel err {err:e}",
            prompt.len()
        );
        assert!(err < 1e-3, "{name} prompt {n}: logits rel err {err}");
        let got = media_greedy(model, &prompt, media, 8, vec![]);
        assert_eq!(
            got,
            ids(&r[&format!("greedy_{n}")])[prompt.len()..],
            "{name} prompt {n}: greedy tokens"
        );
    }
}

/// transformers' `qianfan_ocr` config (`config.qianfan_ocr.json`, as transformers saves it) over
/// the InternVL-Chat weights, the form hub Qianfan-OCR checkpoints take for transformers: the same
/// references.
#[test]
fn qianfan_ocr_config_over_chat_weights_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let (native, chat) = (fixture(REF), fixture("internvl_chat"));
    let copy =
        |from: std::path::PathBuf, to: &str| std::fs::copy(from, dir.path().join(to)).unwrap();
    copy(native.join("config.qianfan_ocr.json"), "config.json");
    copy(
        native.join("preprocessor_config.json"),
        "preprocessor_config.json",
    );
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        copy(chat.join(f), f);
    }
    let model = mlx_models::load_model(dir.path(), &test_load_options())
        .unwrap()
        .into_lm()
        .unwrap();
    assert_eq!(model.info().model_type, "internvl");
    check_prompts("qianfan_ocr", &model);
}

#[test]
fn chat_template_and_expansion_give_the_processor_ids() {
    let r = reference(REF);
    let want = ids(&r["ids_1"]);
    for name in LAYOUTS {
        let mut s = load_session(fixture(name), &test_load_options()).unwrap();
        assert!(s.supports_images());
        let cfg = greedy_chat(4);
        assert_eq!(
            s.expanded_prompt_tokens(&[first_turn()], &cfg).unwrap(),
            want.len()
        );
        let res = s.start(vec![first_turn()], &cfg).unwrap();
        assert_eq!(res.prompt_tokens, want.len());
        assert_eq!(&s.cached_ids()[..want.len()], &want[..], "{name}");
        let full = turns().to_vec();
        assert_eq!(
            s.expanded_prompt_tokens(&full, &cfg).unwrap(),
            ids(&r["ids_2"]).len(),
            "{name}"
        );
    }
}

#[test]
fn continued_turn_with_a_new_image_prefills_only_that_turn() {
    let name = "internvl_chat";
    let mut s = load_session(fixture(name), &test_load_options()).unwrap();
    let cfg = greedy_chat(6);
    let first = s.start(vec![first_turn()], &cfg).unwrap();
    assert_eq!(first.cached_tokens, 0);
    let held = s.cached_ids().len();
    let second = s
        .continue_stream(vec![turns()[2].clone()], &cfg)
        .unwrap()
        .collect_result()
        .unwrap();
    assert_eq!(
        second.cached_tokens, held,
        "the first turn stays in the cache"
    );
    assert!(
        second.prompt_tokens > held + 12,
        "the new turn holds the second image's tokens"
    );
    // The reply equals greedy generation over the same tokens and both images on a fresh cache.
    let all = s.cached_ids().to_vec();
    let prompt = &all[..second.prompt_tokens];
    let model = fixture_lm(name);
    let media = vec![prepare(&model, "a"), prepare(&model, "b")];
    let fresh = media_greedy(
        &model,
        prompt,
        media,
        second.num_tokens,
        s.format().stop_token_ids(),
    );
    assert_eq!(fresh, all[prompt.len()..prompt.len() + second.num_tokens]);
    // A restart with a different first image reuses nothing past the tokens before it.
    let other = ChatMessage::user("Read the text in the image.").with_image(image("b"));
    let res = s.start(vec![other], &cfg).unwrap();
    assert!(
        res.cached_tokens < 8,
        "a changed image is prefilled again (cached {})",
        res.cached_tokens
    );
}

/// The OCR entry point with the reference prompt replies with the reference's greedy tokens, both
/// through the session (the fixture's template writes the placeholder) and, for a template that
/// drops image parts (a text-only Qwen template), through the InternVL-Chat prompt; a text-only
/// checkpoint is refused.
#[test]
fn ocr_reads_the_image_as_greedy_generation_does() {
    let r = reference(REF);
    let prompt = ids(&r["ids_1"]);
    let want = &ids(&r["greedy_1"])[prompt.len()..];
    let plain = tempfile::tempdir().unwrap();
    let chat = fixture("internvl_chat");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    ] {
        std::fs::copy(chat.join(f), plain.path().join(f)).unwrap();
    }
    let mut tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chat.join("tokenizer_config.json")).unwrap())
            .unwrap();
    tc["chat_template"] = serde_json::json!(concat!(
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}",
        "{%- if message.content is string %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ));
    std::fs::write(plain.path().join("tokenizer_config.json"), tc.to_string()).unwrap();
    for (dir, templated) in [
        (fixture("internvl"), true),
        (chat, true),
        (plain.path().to_path_buf(), false),
    ] {
        let mut ocr = Ocr::load(&dir, &test_load_options()).unwrap();
        assert_eq!(ocr.model_type(), "internvl");
        let res = ocr
            .read(image("a"), Some("Read the text in the image."), want.len())
            .unwrap();
        assert_eq!(res.templated, templated, "{}", dir.display());
        assert_eq!(res.prompt, prompt, "{}", dir.display());
        assert_eq!(res.tokens, want, "{}", dir.display());
        // The family's default instruction is what an OCR request without one sends.
        let res = ocr.read(image("a"), None, 2).unwrap();
        assert!(
            res.prompt.len() > 20 && res.tokens.len() <= 2,
            "{}: the image's tokens are in the prompt",
            dir.display()
        );
    }
    match Ocr::load(fixture("qwen3"), &test_load_options()) {
        Err(ModelError::WrongKind(m)) => assert!(m.contains("internvl"), "{m}"),
        other => panic!("a text-only model must be refused, got {:?}", other.err()),
    }
}
