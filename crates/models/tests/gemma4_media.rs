//! Gemma 4 vision and audio against transformers (f32, sdpa attention) on the tiny `gemma4_media` fixture
//! (`scripts/make_gemma4_media_fixture.py`: vision tower with GQA, clipped linears and
//! standardisation; audio encoder of two conformer layers; both towers through their
//! projections): image processor patches equal to `Gemma4ImageProcessorPil`'s (within 1e-6),
//! log-mel features within 1e-4 relative of `Gemma4AudioFeatureExtractor`'s, tower outputs within
//! 1e-4 relative, the merged prompt's logits (text, 60 image and 23 audio soft tokens, 98
//! positions, longer than the sliding window) within 1e-3 relative, and 16 greedy tokens
//! identical through the cache. With `use_bidirectional_attention = "vision"` (each image's soft
//! tokens attending to each other both ways in sliding layers): the same prompt's logits within
//! 1e-3 and its greedy tokens, the last logits of a two-image prompt, and a continued turn with
//! a new image equal to a full recompute, flat and paged.
mod common;
use common::*;
use mlx_array::{Array, DType};
use mlx_models::families::gemma4_media::{Gemma4Media, Gemma4MediaInputs};
use mlx_models::families::gemma4_vision::Gemma4Image;
use mlx_models::chat::ChatMessage;
use mlx_models::media::{AudioInput, MediaItem, PreparedMedia};
use mlx_models::{generate, load_model, load_session, GenerateConfig, Logits, Model};
use std::collections::HashMap;

const NAME: &str = "gemma4_media";

fn media() -> Gemma4Media {
    Gemma4Media::load(&fixture(NAME), Some(DType::F32)).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

fn rgb(r: &HashMap<String, Array>, key: &str) -> (Vec<u8>, usize, usize) {
    let a = &r[key];
    let s = a.shape();
    (a.astype(DType::U8).unwrap().to_vec::<u8>().unwrap(), s[1], s[0])
}

fn reference_image(r: &HashMap<String, Array>, prefix: &str) -> Gemma4Image {
    let grid = ids(&r[&format!("{prefix}_grid")]);
    let (gh, gw) = (grid[0] as usize, grid[1] as usize);
    Gemma4Image { patches: r[&format!("{prefix}_pixel_values")].clone(), grid: (gh, gw), num_soft_tokens: (gh / 2) * (gw / 2) }
}

#[test]
fn image_processor_matches_transformers() {
    let r = reference(NAME);
    let m = media();
    for prefix in ["image", "tall"] {
        let (px, w, h) = rgb(&r, &format!("{prefix}_rgb"));
        let got = m.prepare_image(&px, w, h).unwrap();
        let want = reference_image(&r, prefix);
        assert_eq!(got.grid, want.grid, "{prefix}: patch grid");
        assert_eq!(got.num_soft_tokens, want.num_soft_tokens);
        let (g, e) = (f32s(&got.patches), f32s(&want.patches));
        assert_eq!(g.len(), e.len());
        let worst = g.iter().zip(&e).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{prefix}: patches max |diff| {worst}");
        assert!(worst <= 1e-6, "{prefix}: patches differ by {worst}");
    }
    let p = m.image_processor().unwrap();
    assert_eq!((p.patch_size, p.pooling_kernel_size, p.max_soft_tokens), (4, 2, 70));
    assert!(m.prepare_image(&[0u8; 10], 2, 2).is_err(), "buffer size is checked");
}

#[test]
fn audio_features_match_the_extractor() {
    let r = reference(NAME);
    let m = media();
    let samples = f32s(&r["audio_samples"]);
    let got = m.prepare_audio(&samples).unwrap();
    let want = &r["audio_features"];
    assert_eq!(got.shape(), want.shape(), "valid mel frames");
    let err = rel_err(&f32s(&got), &f32s(want));
    eprintln!("log-mel features: rel err {err}");
    assert!(err < 1e-4, "log-mel features: rel err {err}");
}

#[test]
fn towers_match_transformers() {
    let r = reference(NAME);
    let m = media();
    let img = reference_image(&r, "image");
    let vision = m.vision().unwrap();
    for (got, key) in [(vision.encode(&img).unwrap(), "vision_hidden"), (vision.embed(&img).unwrap(), "vision_embeds")] {
        assert_eq!(got.shape(), r[key].shape(), "{key}");
        let err = rel_err(&f32s(&got), &f32s(&r[key]));
        eprintln!("{key}: rel err {err}");
        assert!(err < 1e-4, "{key}: rel err {err}");
    }
    let audio = m.audio().unwrap();
    let feats = &r["audio_features"];
    for (got, key) in [(audio.encode(feats).unwrap(), "audio_hidden"), (audio.embed(feats).unwrap(), "audio_embeds")] {
        assert_eq!(got.shape(), r[key].shape(), "{key}");
        let err = rel_err(&f32s(&got), &f32s(&r[key]));
        eprintln!("{key}: rel err {err}");
        assert!(err < 1e-4, "{key}: rel err {err}");
    }
}

/// The merged prompt's embeddings from the fixture's raw media through our processors.
fn merged_inputs(m: &Gemma4Media, r: &HashMap<String, Array>) -> Gemma4MediaInputs {
    let (px, w, h) = rgb(r, "image_rgb");
    Gemma4MediaInputs { images: vec![m.prepare_image(&px, w, h).unwrap()], audio: vec![m.prepare_audio(&f32s(&r["audio_samples"])).unwrap()] }
}

fn forward_embeddings(model: &Model, tokens: &Array, embeds: &Array, cache: &mut mlx_models::Cache, logits: Logits) -> Array {
    model.with_runtime(|rt| rt.as_gemma4().expect("a Gemma 4 runtime").forward_embeddings(tokens, embeds, cache, logits, false)).unwrap().logits.unwrap()
}

#[test]
fn merged_prompt_logits_and_greedy_match_transformers() {
    let r = reference(NAME);
    let m = media();
    let model = load_model(fixture(NAME), &test_load_options()).unwrap().into_lm().unwrap();
    let prompt = ids(&r["input_ids"]);
    let inputs = merged_inputs(&m, &r);
    let merged = model.with_runtime(|rt| m.merge(rt.as_gemma4().unwrap(), &prompt, &inputs)).unwrap();
    let mut cache = model.new_cache();
    let logits = forward_embeddings(&model, &merged.ple_tokens, &merged.embeds, &mut cache, Logits::All);
    let err = rel_err(&f32s(&logits), &f32s(&r["logits"]));
    eprintln!("merged-prompt logits: rel err {err}");
    assert!(err < 1e-3, "merged-prompt logits: rel err {err}");

    // Greedy through the cache: the media prefill, then plain decode steps.
    let want = ids(&r["greedy_ids"])[prompt.len()..].to_vec();
    for paged in [false, true] {
        let kv_cache = if paged { mlx_models::KvCacheMode::Paged(Default::default()) } else { mlx_models::KvCacheMode::Flat };
        let opts = mlx_models::LoadOptions { kv_cache, ..test_load_options() };
        let model = load_model(fixture(NAME), &opts).unwrap().into_lm().unwrap();
        let mut cache = model.new_cache();
        let last = forward_embeddings(&model, &merged.ple_tokens, &merged.embeds, &mut cache, Logits::Last);
        let mut next = argmax(&f32s(&last));
        let mut got = vec![];
        for _ in 0..want.len() {
            got.push(next);
            let t = Array::from_slice(&[next], &[1, 1]).unwrap();
            next = argmax(&f32s(&model.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap()));
        }
        assert_eq!(got, want, "greedy tokens (paged cache: {paged})");
    }
}

#[test]
fn placeholder_counts_must_match_the_media() {
    let r = reference(NAME);
    let m = media();
    let model = load_model(fixture(NAME), &test_load_options()).unwrap().into_lm().unwrap();
    let mut prompt = ids(&r["input_ids"]);
    let inputs = merged_inputs(&m, &r);
    let image = m.tokens().image;
    let pos = prompt.iter().position(|&t| t == image).unwrap();
    prompt.remove(pos);
    let err = model.with_runtime(|rt| m.merge(rt.as_gemma4().unwrap(), &prompt, &inputs)).err().expect("one image placeholder short");
    assert!(err.to_string().contains("59 image"), "{err}");
    // The placeholder runs the processor writes.
    let t = m.tokens();
    assert_eq!(t.image_placeholder(2), vec![t.boi, t.image, t.image, t.eoi]);
    assert_eq!(t.audio_placeholder(1), vec![t.boa, t.audio, t.eoa]);
}

/// A two-turn conversation with a clip in each user turn: the second turn's prefill runs on
/// its own tokens over the cache of the first (and of the reply) and gives the logits of a
/// full recompute of the whole conversation, flat and paged.
#[test]
fn second_audio_turn_prefills_only_its_tokens_and_matches_a_full_recompute() {
    let samples = f32s(&reference(NAME)["audio_samples"]);
    let clips = [&samples[..6000], &samples[5000..]].map(|s| MediaItem::Audio(AudioInput::Pcm(s.to_vec())));
    second_turn_matches_a_full_recompute(&fixture(NAME), clips);
}

/// A conversation of a user turn with `items[0]`, a 4-token greedy reply and a user turn with
/// `items[1]`, through the model's media side: the second turn prefilled over the cache of the
/// rest gives the logits (within 1e-4 relative) and next token of a full recompute of the
/// whole conversation, flat and paged.
fn second_turn_matches_a_full_recompute(dir: &std::path::Path, items: [MediaItem; 2]) {
    let t = *media().tokens();
    for cache in CACHES {
        let model = load_lm(dir, cache());
        let prepared: Vec<PreparedMedia> = items.iter().map(|i| model.with_runtime(|rt| rt.media().unwrap().prepare(i))).collect::<mlx_models::Result<_>>().unwrap();
        let mark = |p: &PreparedMedia| if p.kind == mlx_models::media::MediaKind::Image { t.image } else { t.audio };
        let expand = |ids: Vec<u32>, p: &[PreparedMedia]| model.with_runtime(|rt| rt.media().unwrap().expand(&ids, p)).unwrap();
        let turn1 = expand(vec![2, 105, 300, 301, mark(&prepared[0]), 106, 107, 105, 400], &prepared[..1]);
        let mut cache = model.new_cache();
        let mut reply = vec![argmax(&media_forward(&model, &turn1, &prepared[..1], &mut cache, Logits::Last))];
        for _ in 0..3 {
            let x = Array::from_slice(&[*reply.last().unwrap()], &[1, 1]).unwrap();
            reply.push(argmax(&f32s(&model.forward(&x, &mut cache, Logits::Last, false).unwrap().logits.unwrap())));
        }
        // the last sampled token is fed with the new turn
        let turn2 = expand(vec![reply.pop().unwrap(), 106, 107, 105, 500, 501, mark(&prepared[1]), 106, 107, 105], &prepared[1..]);
        let inc = media_forward(&model, &turn2, &prepared[1..], &mut cache, Logits::All);

        let full: Vec<u32> = turn1.iter().chain(&reply).chain(&turn2).copied().collect();
        assert_eq!(cache.offset(), full.len(), "the cache holds the whole conversation");
        let whole = media_forward(&model, &full, &prepared, &mut model.new_cache(), Logits::All);
        let tail = &whole[whole.len() - inc.len()..];
        let err = rel_err(&inc, tail);
        eprintln!("incremental turn vs full recompute: rel err {err}");
        assert!(err < 1e-4, "incremental turn vs full recompute: rel err {err}");
        assert_eq!(argmax(&inc[inc.len() - 1024..]), argmax(&tail[tail.len() - 1024..]));
    }
}

/// A chat session (registry row `gemma4_vlm`) with a clip in each user turn: the continued turn
/// reuses the whole cached first turn, prefills only itself, and its reply equals greedy
/// generation over the same tokens and both clips on a fresh cache.
#[test]
fn session_audio_turn_prefills_only_that_turn() {
    let r = reference(NAME);
    let samples = f32s(&r["audio_samples"]);
    let clips = [AudioInput::Pcm(samples[..6000].to_vec()), AudioInput::Pcm(samples[5000..].to_vec())];
    let mut s = load_session(fixture(NAME), &test_load_options()).unwrap();
    assert!(s.supports_images());
    let cfg = greedy_chat(6);
    let first = s.start(vec![ChatMessage::user("Listen.").with_audio(clips[0].clone())], &cfg).unwrap();
    assert_eq!(first.cached_tokens, 0);
    // <boa> + 10 soft tokens + <eoa> in place of the template's <|audio|>
    assert!(s.cached_ids().windows(12).any(|w| w[0] == 11 && w[1..11].iter().all(|&t| t == 13) && w[11] == 12), "expanded clip");
    let held = s.cached_ids().len();
    let second = s.continue_stream(vec![ChatMessage::user("And this?").with_audio(clips[1].clone())], &cfg).unwrap().collect_result().unwrap();
    assert_eq!(second.cached_tokens, held, "the first turn stays in the cache");
    assert!(second.prompt_tokens > held + 16, "the new turn holds the second clip's 16 soft tokens");
    let all = s.cached_ids().to_vec();
    let prompt = &all[..second.prompt_tokens];
    let model = fixture_lm(NAME);
    let media: Vec<PreparedMedia> =
        clips.iter().map(|c| model.with_runtime(|rt| rt.media().unwrap().prepare(&MediaItem::Audio(c.clone())))).collect::<mlx_models::Result<_>>().unwrap();
    let mut cache = model.new_cache();
    let gcfg = GenerateConfig { max_new_tokens: second.num_tokens, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(s.format().stop_token_ids()), ..Default::default() };
    let fresh: Vec<u32> = generate(&model, &mut cache, prompt, gcfg).unwrap().with_media(media).map(|t| t.unwrap().id).collect();
    assert_eq!(fresh, all[prompt.len()..prompt.len() + second.num_tokens]);
}

/// A copy of the fixture (references left out) in a temporary directory, with `edit` applied to
/// the JSON file `file` (`config.json`, `tokenizer_config.json`).
fn fixture_variant(file: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(NAME)).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if !name.to_string_lossy().starts_with("reference") {
            std::fs::copy(e.path(), dir.path().join(&name)).unwrap();
        }
    }
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture(NAME).join(file)).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(dir.path().join(file), serde_json::to_string_pretty(&json).unwrap()).unwrap();
    dir
}

/// The fixture with `text_config.use_bidirectional_attention = "vision"` (the references of that
/// variant: `reference_bidirectional.safetensors`).
fn bidirectional_fixture() -> tempfile::TempDir {
    fixture_variant("config.json", |c| c["text_config"]["use_bidirectional_attention"] = "vision".into())
}

fn bidirectional_reference() -> HashMap<String, Array> {
    mlx_array::io::load_safetensors(fixture(NAME).join("reference_bidirectional.safetensors"), Some(DType::F32)).unwrap()
}

fn load_lm(dir: &std::path::Path, kv_cache: mlx_models::KvCacheMode) -> Model {
    load_model(dir, &mlx_models::LoadOptions { kv_cache, ..test_load_options() }).unwrap().into_lm().unwrap()
}

const CACHES: [fn() -> mlx_models::KvCacheMode; 2] = [|| mlx_models::KvCacheMode::Flat, || mlx_models::KvCacheMode::Paged(Default::default())];

/// A reference image (`[h, w, 3]` u8) prepared by the model's media side.
fn prepared_image(model: &Model, r: &HashMap<String, Array>, key: &str) -> PreparedMedia {
    model.with_runtime(|rt| rt.media().unwrap().prepare(&MediaItem::Image(image_input(r, key)))).unwrap()
}

/// A reference image (`[h, w, 3]` u8) as decoded pixels.
fn image_input(r: &HashMap<String, Array>, key: &str) -> mlx_models::media::ImageInput {
    let (px, w, h) = rgb(r, key);
    mlx_models::media::ImageInput::Rgb(mlx_models::media::RgbImage::new(w as u32, h as u32, px).unwrap())
}

/// `tokens` with their `media` through the model's media side (as a session prefills a turn).
fn media_forward(model: &Model, tokens: &[u32], media: &[PreparedMedia], cache: &mut mlx_models::Cache, logits: Logits) -> Vec<f32> {
    let out = model
        .with_runtime(|rt| {
            let m = rt.media().unwrap();
            let input = m.embed(tokens, media, cache)?;
            m.forward_embedded(&input, cache, logits, false)
        })
        .unwrap();
    f32s(&out.logits.unwrap())
}

/// `use_bidirectional_attention == "vision"`: the merged prompt (an image and a clip) against
/// transformers with `mm_token_type_ids`: all logits within 1e-3 relative and 16 greedy tokens
/// identical through the cache, flat and paged; a prompt with two images, the logits of its
/// last 4 positions within 1e-3. The causal reference lies far from the bidirectional one
/// (1.02 by this measure), so a causal mask fails the bound.
#[test]
fn bidirectional_vision_matches_transformers() {
    let (r, rc) = (bidirectional_reference(), reference(NAME));
    let dir = bidirectional_fixture();
    let samples = f32s(&rc["audio_samples"]);
    let prompt = ids(&r["input_ids"]);
    let want = ids(&r["greedy_ids"])[prompt.len()..].to_vec();
    for cache in CACHES {
        let model = load_lm(dir.path(), cache());
        let media = vec![
            prepared_image(&model, &rc, "image_rgb"),
            model.with_runtime(|rt| rt.media().unwrap().prepare(&MediaItem::Audio(AudioInput::Pcm(samples.clone())))).unwrap(),
        ];
        let logits = media_forward(&model, &prompt, &media, &mut model.new_cache(), Logits::All);
        let (err, causal) = (rel_err(&logits, &f32s(&r["logits"])), rel_err(&f32s(&rc["logits"]), &f32s(&r["logits"])));
        eprintln!("bidirectional merged-prompt logits: rel err {err} (causal reference: {causal})");
        assert!(err < 1e-3, "bidirectional merged-prompt logits: rel err {err}");
        assert!(causal > 0.1, "the fixture tells causal from bidirectional attention");
        assert_eq!(media_greedy(&model, &prompt, media, want.len(), vec![]), want, "greedy tokens");

        let two = ids(&r["two_images_ids"]);
        let media = vec![prepared_image(&model, &rc, "image_rgb"), prepared_image(&model, &r, "second_rgb")];
        let logits = media_forward(&model, &two, &media, &mut model.new_cache(), Logits::All);
        let tail = &f32s(&r["two_images_logits_tail"]);
        let err = rel_err(&logits[logits.len() - tail.len()..], tail);
        eprintln!("two images, last positions: rel err {err}");
        assert!(err < 1e-3, "two images, last positions: rel err {err}");
    }
}

/// `use_bidirectional_attention == "vision"`, a two-turn conversation with an image in each
/// user turn: the second turn's prefill over the cache of the first (and of the reply) gives
/// the logits of a full recompute of the whole conversation with both images, flat and paged.
#[test]
fn bidirectional_second_image_turn_matches_a_full_recompute() {
    let (r, rc) = (bidirectional_reference(), reference(NAME));
    let images = [image_input(&rc, "image_rgb"), image_input(&r, "second_rgb")].map(MediaItem::Image);
    second_turn_matches_a_full_recompute(bidirectional_fixture().path(), images);
}

/// A chat template that writes the text `<image>` for an image part instead of the model's
/// `<|image|>` placeholder: a session refuses such a turn with a typed error and is left as it
/// was (start and continue); with the placeholder's text in the message content the image is
/// expanded where that text stands and the reply equals a fresh generation over the prompt.
#[test]
fn session_with_a_text_image_marker_template() {
    let dir = fixture_variant("tokenizer_config.json", |t| {
        let tpl = t["chat_template"].as_str().unwrap();
        let from = "{%- if item['type'] == 'image' -%}\n                {{ '<|image|>' }}";
        assert!(tpl.contains(from), "chat template layout changed");
        t["chat_template"] = tpl.replace(from, "{%- if item['type'] == 'image' -%}\n                {{ '<image>' }}").into();
    });
    let r = reference(NAME);
    let image = image_input(&r, "image_rgb");
    let mut s = load_session(dir.path(), &test_load_options()).unwrap();
    let cfg = greedy_chat(4);
    let refused = |e: mlx_models::ModelError| assert!(matches!(&e, mlx_models::ModelError::InvalidInput(m) if m.contains("0 media placeholders for 1")), "{e}");
    refused(s.start(vec![ChatMessage::user("Look.").with_image(image.clone())], &cfg).expect_err("no placeholder rendered"));
    assert!(s.history().is_empty() && s.cached_ids().is_empty(), "a refused start leaves the session empty");

    let first = s.start(vec![ChatMessage::user("Hello.")], &cfg).unwrap();
    let (history, cached) = (s.history().len(), s.cached_ids().to_vec());
    refused(s.continue_stream(vec![ChatMessage::user("Look.").with_image(image.clone())], &cfg).err().expect("no placeholder rendered"));
    assert_eq!((s.history().len(), s.cached_ids()), (history, &cached[..]), "a refused turn leaves the session as it was");

    // The placeholder's text in the content: expanded to <boi> image*60 <eoi>.
    let t = *media().tokens();
    let res = s.continue_stream(vec![ChatMessage::user("<|image|> Look.").with_image(image)], &cfg).unwrap().collect_result().unwrap();
    assert_eq!(res.cached_tokens, cached.len(), "the first turn stays in the cache");
    let ids = &s.cached_ids()[..res.prompt_tokens];
    assert!(ids.windows(62).any(|w| w[0] == t.boi && w[1..61].iter().all(|&x| x == t.image) && w[61] == t.eoi), "expanded image");
    assert_eq!(ids.iter().filter(|&&x| x == t.image).count(), 60, "one image");
    assert!(first.num_tokens > 0 && res.num_tokens > 0);
    let model = load_model(dir.path(), &test_load_options()).unwrap().into_lm().unwrap();
    let media = vec![prepared_image(&model, &r, "image_rgb")];
    let all = s.cached_ids();
    assert_eq!(media_greedy(&model, ids, media, res.num_tokens, s.format().stop_token_ids()), all[ids.len()..ids.len() + res.num_tokens]);
}
