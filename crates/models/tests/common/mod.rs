//! Helpers shared by the parity tests: fixture paths, reference loading, tolerances.
#![allow(dead_code)]
use mlx_array::{Array, DType};
use mlx_models::{Cache, Logits, Model};
use std::collections::HashMap;
use std::path::PathBuf;

pub mod vlm;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name)
}

/// Load options of the model-loading tests. `MLX_MODELS_TEST_DTYPE=f32|bf16|f16` sets the
/// compute dtype: on the GPU the default is the fixtures' bf16, and the f32 references need
/// f32 (`scripts/gpu/run_tests.sh` runs them so). Unset: the library's default (f32 on the CPU).
pub fn test_load_options() -> mlx_models::LoadOptions {
    let dtype = match std::env::var("MLX_MODELS_TEST_DTYPE").as_deref() {
        Ok("f32") => Some(DType::F32),
        Ok("bf16") => Some(DType::BF16),
        Ok("f16") => Some(DType::F16),
        Ok(other) => panic!("MLX_MODELS_TEST_DTYPE={other}: want f32, bf16 or f16"),
        Err(_) => None,
    };
    mlx_models::LoadOptions { dtype, ..Default::default() }
}

pub fn reference(name: &str) -> HashMap<String, Array> {
    mlx_array::io::load_safetensors(fixture(name).join("reference.safetensors"), Some(DType::F32)).unwrap()
}

pub fn ids(a: &Array) -> Vec<u32> {
    a.astype(DType::I64).unwrap().to_vec::<i64>().unwrap().into_iter().map(|x| x as u32).collect()
}

/// max |a - b| / max |b|: the relative error the parity tests bound by 1e-3.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in row.iter().enumerate() {
        if *x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill `prompt`, then `steps` greedy tokens through the cache; returns (tokens, per-step logits).
pub fn greedy_cached(model: &Model, cache: &mut Cache, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let t = Array::from_slice(prompt, &[1, prompt.len()]).unwrap();
    let mut logits = model.forward(&t, cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    let (mut out, mut all) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let next = argmax(&logits);
        out.push(next);
        all.push(logits.clone());
        let t = Array::from_slice(&[next], &[1, 1]).unwrap();
        logits = model.forward(&t, cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    }
    (out, all)
}

/// Full-sequence logits `[L, V]` without a cache carried over.
pub fn full_logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let t = Array::from_slice(tokens, &[1, tokens.len()]).unwrap();
    let l = model.forward(&t, &mut cache, Logits::All, false).unwrap().logits.unwrap();
    let v = *l.shape().last().unwrap();
    l.to_vec::<f32>().unwrap().chunks(v).map(|c| c.to_vec()).collect()
}

/// The parity contract every family meets against its transformers fixture `name` (72-token
/// prompt, f32 eager reference): full-prefill logits within 1e-3 relative, 16 greedy tokens
/// identical through the cache, per-step decode logits within 1e-3, and cached decode equal to
/// a full recompute (1e-4, same argmax). `model_type` is the canonical family expected.
pub fn check_transformers_parity(name: &str, model_type: &str) {
    check_transformers_parity_with(name, model_type, true)
}

/// [`check_transformers_parity`]; `recompute: false` leaves out the cached-vs-recomputed
/// comparison, for models whose positions depend on the call's length (dynamic NTK rope: as in
/// transformers, each call's frequencies follow its longest position, so a full recompute
/// rotates every position differently from the steps that cached them).
pub fn check_transformers_parity_with(name: &str, model_type: &str, recompute: bool) {
    let r = reference(name);
    let model = fixture_lm(name);
    assert_eq!(model.info().model_type, model_type);
    let prompt = ids(&r["input_ids"]);
    let greedy_ref = ids(&r["greedy_ids"]);
    assert_eq!(prompt.len(), 72);

    // 1. Full prefill logits.
    let ours = full_logits(&model, &prompt);
    let theirs = r["logits"].to_vec::<f32>().unwrap();
    let e = rel_err(&ours.concat(), &theirs);
    eprintln!("{name}: prefill logits rel err {e:.2e}");
    assert!(e < 1e-3, "{name}: prefill logits rel err {e}");

    // 2. Greedy through the cache, and its per-step logits vs the reference's decode logits.
    let mut cache = model.new_cache();
    let (toks, step_logits) = greedy_cached(&model, &mut cache, &prompt, 16);
    assert_eq!(toks, greedy_ref[72..], "{name}: greedy tokens");
    let dref = r["decode_logits"].to_vec::<f32>().unwrap();
    let e = rel_err(&step_logits.concat(), &dref);
    eprintln!("{name}: decode logits rel err {e:.2e}");
    assert!(e < 1e-3, "{name}: decode logits rel err {e}");
    assert_eq!(cache.offset(), 72 + 16);

    // 3. Cached decode equals full recompute over the same tokens.
    if !recompute {
        return;
    }
    let full = full_logits(&model, &greedy_ref[..87]);
    for (s, l) in step_logits.iter().enumerate() {
        let e = rel_err(l, &full[71 + s]);
        assert!(e < 1e-4, "{name}: step {s} cached vs recomputed rel err {e}");
        assert_eq!(argmax(l), argmax(&full[71 + s]));
    }
}

/// A prefill that reads only the last position's logits queries only that position in the last
/// cache-writing layer (its K/V are cached for all): the same logits as the last row of all
/// positions', flat and paged, at several prompt lengths, and the next decode step matches a
/// recompute (the cache holds every position).
pub fn check_last_position_prefill(name: &str) {
    use mlx_models::{KvCacheMode, PagedConfig};
    let r = reference(name);
    let prompt = ids(&r["input_ids"]);
    for kv in [KvCacheMode::Flat, KvCacheMode::Paged(PagedConfig { block_size: 4, ..Default::default() })] {
        let m = mlx_models::load_model(fixture(name), &mlx_models::LoadOptions { kv_cache: kv.clone(), ..test_load_options() }).unwrap().into_lm().unwrap();
        for n in [2usize, 37, 72] {
            let mut cache = m.new_cache();
            let t = Array::from_slice(&prompt[..n], &[1, n]).unwrap();
            let last = m.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
            let want = full_logits(&m, &prompt[..n])[n - 1].clone();
            let e = rel_err(&last, &want);
            assert!(e < 1e-5, "{name} {kv:?} prompt {n}: last-position logits vs all positions' last row: rel err {e}");
            let tok = prompt[n % prompt.len()];
            let next = Array::from_slice(&[tok], &[1, 1]).unwrap();
            let step = m.forward(&next, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
            let mut longer = prompt[..n].to_vec();
            longer.push(tok);
            let e = rel_err(&step, &full_logits(&m, &longer)[n]);
            assert!(e < 1e-5, "{name} {kv:?} prompt {n}: decode after the prefill vs recompute: rel err {e}");
        }
    }
}

/// `n` greedy tokens from `generate` (prefill in chunks of `step`), no stop tokens.
pub fn greedy_gen(m: &mlx_models::Model, prompt: &[u32], n: usize, step: usize) -> Vec<u32> {
    use mlx_models::{generate, GenerateConfig};
    let mut cache = m.new_cache();
    let cfg = GenerateConfig { max_new_tokens: n, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(vec![]), prefill_step_size: step, context: Vec::new() };
    generate(m, &mut cache, prompt, cfg).unwrap().map(|t| t.unwrap().id).collect()
}

/// The LM of fixture `name`, loaded with [`test_load_options`].
pub fn fixture_lm(name: &str) -> Model {
    mlx_models::load_model(fixture(name), &test_load_options()).unwrap().into_lm().unwrap()
}

/// A chat turn of `n` greedy tokens.
pub fn greedy_chat(n: usize) -> mlx_models::ChatConfig {
    let sampling = sampling::SamplingOverrides { temperature: Some(0.0), ..Default::default() };
    mlx_models::ChatConfig { max_new_tokens: n, sampling, ..Default::default() }
}

/// Prefilling the first 71 tokens of fixture `name`'s prompt in chunks of `sizes` (cycled), then
/// `steps` greedy tokens, gives the tokens of one whole prefill and logits within 1e-4 relative.
pub fn check_chunked_prefill(name: &str, sizes: &[usize], steps: usize) {
    let model = fixture_lm(name);
    let prompt = ids(&reference(name)["input_ids"]);
    let mut one = model.new_cache();
    let (a, la) = greedy_cached(&model, &mut one, &prompt, steps);
    let mut chunked = model.new_cache();
    let mut start = 0;
    for size in sizes.iter().cycle() {
        if start >= 71 {
            break;
        }
        let end = (start + size).min(71);
        let t = Array::from_slice(&prompt[start..end], &[1, end - start]).unwrap();
        model.forward(&t, &mut chunked, Logits::None, false).unwrap();
        start = end;
    }
    let (b, lb) = greedy_cached(&model, &mut chunked, &prompt[71..], steps);
    assert_eq!(a, b, "{name}: chunks of {sizes:?} change the greedy tokens");
    for (x, y) in la.iter().zip(&lb) {
        let e = rel_err(y, x);
        assert!(e < 1e-4, "{name}: chunks of {sizes:?} vs one prefill: logits rel err {e}");
    }
}

/// The rows of one batch (`rows`, of equal length) give the last-position logits of each row
/// alone, within 1e-4 relative.
pub fn check_batch_rows_independent(model: &Model, rows: &[&[u32]]) {
    let both: Vec<u32> = rows.concat();
    let mut cache = model.new_cache();
    let t = Array::from_slice(&both, &[rows.len(), rows[0].len()]).unwrap();
    let l = model.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
    let v = l.len() / rows.len();
    for (row, toks) in rows.iter().enumerate() {
        let alone = full_logits(model, toks);
        let e = rel_err(&l[row * v..(row + 1) * v], alone.last().unwrap());
        assert!(e < 1e-4, "batch row {row} rel err {e}");
    }
}

/// The reply of the session's last turn (`res`) equals greedy generation over the same prompt
/// tokens on a fresh cache of fixture `name` (with the template's stop tokens).
pub fn check_reply_equals_fresh_generation(name: &str, s: &mlx_models::ChatSession, res: &mlx_models::ChatResult) {
    use mlx_models::{generate, FinishReason, GenerateConfig};
    let all = s.cached_ids().to_vec();
    let n = res.num_tokens + usize::from(res.finish_reason == FinishReason::Stop);
    let prompt = &all[..all.len() - n];
    let model = fixture_lm(name);
    let mut cache = model.new_cache();
    let cfg = GenerateConfig { max_new_tokens: res.num_tokens, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(s.format().stop_token_ids()), ..Default::default() };
    let fresh: Vec<u32> = generate(&model, &mut cache, prompt, cfg).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(fresh, all[prompt.len()..prompt.len() + res.num_tokens], "{name}: the reply equals generation on a fresh cache");
}

/// The top-1/top-2 logit gap (f32) at or below which a batched run may pick the other token
/// than a lone run (the batched tests compare tokens only past such steps' absence).
pub const TIE: f32 = 1e-4;

/// Greedy decode of `prompt` alone (the model's own cache): tokens and each step's top-1/top-2
/// logit gap.
pub fn greedy_alone(model: &Model, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<f32>) {
    let mut cache = model.new_cache();
    let mut t = Array::from_slice(prompt, &[1, prompt.len()]).unwrap();
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let l = model.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap();
        let best = argmax(&l);
        let second = l.iter().enumerate().filter(|(i, _)| *i as u32 != best).map(|(_, x)| *x).fold(f32::NEG_INFINITY, f32::max);
        out.push(best);
        gaps.push(l[best as usize] - second);
        t = Array::from_slice(&[best], &[1, 1]).unwrap();
    }
    (out, gaps)
}

/// All the logits (f32, row-major) of an expanded `prompt` whose media tokens belong to `media`,
/// prefilled in one call through the model's media side.
pub fn media_prompt_logits(model: &Model, prompt: &[u32], media: &[mlx_models::media::PreparedMedia]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let out = model
        .with_runtime(|rt| {
            let m = rt.media().expect("a vision-language model");
            let input = m.embed(prompt, media, &cache)?;
            m.forward_embedded(&input, &mut cache, Logits::All, false)
        })
        .unwrap();
    f32s(&out.logits.unwrap())
}

/// `n` greedy tokens after an expanded `prompt` with `media` on a fresh cache (`stop` ends early).
pub fn media_greedy(model: &Model, prompt: &[u32], media: Vec<mlx_models::media::PreparedMedia>, n: usize, stop: Vec<u32>) -> Vec<u32> {
    let mut cache = model.new_cache();
    let cfg = mlx_models::GenerateConfig { max_new_tokens: n, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(stop), ..Default::default() };
    mlx_models::generate(model, &mut cache, prompt, cfg).unwrap().with_media(media).map(|t| t.unwrap().id).collect()
}

/// The values of `a` as f32.
pub fn f32s(a: &Array) -> Vec<f32> {
    a.astype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

/// The image file `path` preprocessed by a vision-language model.
pub fn prepare_image(model: &Model, path: PathBuf) -> mlx_models::media::PreparedMedia {
    let item = mlx_models::media::MediaItem::Image(mlx_models::media::ImageInput::path(path));
    model.with_runtime(|rt| rt.media().expect("a vision-language model").prepare(&item)).unwrap()
}
