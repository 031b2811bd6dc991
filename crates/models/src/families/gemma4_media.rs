//! Gemma 4 conditional generation (`Gemma4ForConditionalGeneration`): the vision and audio
//! towers of a `gemma4` checkpoint, their processors, and the merge of their soft tokens into
//! the prompt's input embeddings (transformers' `Gemma4Model.forward`).
//!
//! The prompt carries one placeholder token per soft token (`<boi> image*n <eoi>`,
//! `<boa> audio*n <eoa>`). Placeholders embed as the pad token, for the main embedding and for
//! the per-layer inputs' token part alike; then the rows at image and audio placeholders are
//! replaced by the towers' projected soft tokens, images and audio clips each in prompt order.
//! The decoder runs on those embeddings ([`Gemma4Model::forward_embeddings`]).
use super::gemma4::Gemma4Model;
use super::gemma4_audio::{Gemma4AudioConfig, Gemma4AudioFeatureExtractor, Gemma4AudioTower};
use super::gemma4_vision::{Gemma4Image, Gemma4ImageProcessor, Gemma4VisionConfig, Gemma4VisionTower};
use crate::cache::{Cache, CacheSpec};
use crate::media::{expand_placeholders, fingerprint, MediaEmbeddings, MediaItem, MediaKind, MediaModel, PreparedMedia};
use crate::registry::{Built, LoadContext, Preset, ProbeContext};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The special tokens of a Gemma 4 multimodal prompt (defaults as transformers' `Gemma4Config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemma4MediaTokens {
    pub image: u32,
    pub boi: u32,
    pub eoi: u32,
    pub audio: u32,
    pub boa: u32,
    pub eoa: u32,
    pub video: u32,
    /// What placeholders embed as (`text_config.pad_token_id`).
    pub pad: u32,
}

impl Gemma4MediaTokens {
    /// From the root `config.json`.
    pub fn from_config(root: &Value) -> Self {
        let id = |k: &str, d: u32| root.get(k).and_then(Value::as_u64).map_or(d, |v| v as u32);
        let pad =
            root.get("text_config").and_then(|t| t.get("pad_token_id")).or_else(|| root.get("pad_token_id")).and_then(Value::as_u64).map_or(0, |v| v as u32);
        Gemma4MediaTokens {
            image: id("image_token_id", 258_880),
            boi: id("boi_token_id", 255_999),
            eoi: id("eoi_token_id", 258_882),
            audio: id("audio_token_id", 258_881),
            boa: id("boa_token_id", 256_000),
            eoa: root.get("eoa_token_id").or_else(|| root.get("eoa_token_index")).and_then(Value::as_u64).map_or(258_883, |v| v as u32),
            video: id("video_token_id", 258_884),
            pad,
        }
    }

    /// `<boi> image*n <eoi>`.
    pub fn image_placeholder(&self, n: usize) -> Vec<u32> {
        std::iter::once(self.boi).chain(std::iter::repeat_n(self.image, n)).chain(std::iter::once(self.eoi)).collect()
    }

    /// `<boa> audio*n <eoa>`.
    pub fn audio_placeholder(&self, n: usize) -> Vec<u32> {
        std::iter::once(self.boa).chain(std::iter::repeat_n(self.audio, n)).chain(std::iter::once(self.eoa)).collect()
    }

    fn is_placeholder(&self, t: u32) -> bool {
        t == self.image || t == self.audio || t == self.video
    }
}

/// A prompt's media, each already through its processor, in prompt order per kind.
#[derive(Debug, Clone, Default)]
pub struct Gemma4MediaInputs {
    pub images: Vec<Gemma4Image>,
    /// Log-mel features `[frames, feature_size]` of each audio clip.
    pub audio: Vec<Array>,
}

/// The merged input of the decoder: per-layer-input ids `[1, L]` (placeholders as pad) and the
/// input embeddings `[1, L, hidden]`.
pub struct Gemma4Merged {
    pub ple_tokens: Array,
    pub embeds: Array,
}

/// The towers of a Gemma 4 conditional-generation checkpoint.
pub struct Gemma4Media {
    tokens: Gemma4MediaTokens,
    vision: Option<(Gemma4VisionTower, Gemma4ImageProcessor)>,
    audio: Option<(Gemma4AudioTower, Gemma4AudioFeatureExtractor)>,
    /// `text_config.use_bidirectional_attention == "vision"`: each image's soft tokens attend to
    /// each other both ways in the sliding layers ([`Gemma4Media::vision_blocks`]).
    bidirectional_vision: bool,
}

impl Gemma4Media {
    /// The towers configured in `root` (`vision_config`, `audio_config`; either may be null),
    /// read from `weights` under `model.` (transformers) or at the top level (mlx-vlm).
    pub fn new(dir: &Path, weights: &Weights, root: &Value) -> Result<Self> {
        let text_hidden =
            root.get("text_config")
                .unwrap_or(root)
                .get("hidden_size")
                .and_then(Value::as_u64)
                .ok_or_else(|| ModelError::MalformedConfig { path: dir.to_path_buf(), reason: "text_config.hidden_size missing".into() })? as usize;
        let prefixed = weights.names().iter().any(|n| n.starts_with("model.vision_tower.") || n.starts_with("model.audio_tower."));
        let base = weights.root();
        let vb = if prefixed { base.pp("model") } else { base };
        let bad = |reason: String| ModelError::MalformedConfig { path: dir.to_path_buf(), reason };
        let vision = match root.get("vision_config").filter(|v| !v.is_null()) {
            Some(v) => {
                let cfg: Gemma4VisionConfig = crate::config::parse_checked(dir, v, Gemma4VisionConfig::validate)?;
                let proc = Gemma4ImageProcessor::for_checkpoint(dir, &cfg)?;
                Some((Gemma4VisionTower::load(&vb.pp("vision_tower"), &vb.pp("embed_vision"), cfg, text_hidden)?, proc))
            }
            None => None,
        };
        let audio = match root.get("audio_config").filter(|v| !v.is_null()) {
            Some(v) => {
                let cfg: Gemma4AudioConfig = crate::config::parse_checked(dir, v, Gemma4AudioConfig::validate)?;
                let fe = Gemma4AudioFeatureExtractor::for_checkpoint(dir)?;
                let bins = fe.config().feature_size;
                Some((Gemma4AudioTower::load(&vb.pp("audio_tower"), &vb.pp("embed_audio"), cfg, bins, text_hidden)?, fe))
            }
            None => None,
        };
        if vision.is_none() && audio.is_none() {
            return Err(bad("neither vision_config nor audio_config is set: a text-only checkpoint".into()));
        }
        let bidir = root.get("text_config").and_then(|t| t.get("use_bidirectional_attention")).and_then(Value::as_str);
        Ok(Gemma4Media { tokens: Gemma4MediaTokens::from_config(root), vision, audio, bidirectional_vision: bidir == Some("vision") })
    }

    /// Read `dir`'s config and weights (floats as `float_dtype` when given) and build the towers.
    pub fn load(dir: &Path, float_dtype: Option<DType>) -> Result<Self> {
        let root = crate::config::read_config_json(dir)?;
        let weights = Weights::load(dir, float_dtype)?;
        Self::new(dir, &weights, &root)
    }

    pub fn tokens(&self) -> &Gemma4MediaTokens {
        &self.tokens
    }

    pub fn vision(&self) -> Option<&Gemma4VisionTower> {
        self.vision.as_ref().map(|v| &v.0)
    }

    pub fn audio(&self) -> Option<&Gemma4AudioTower> {
        self.audio.as_ref().map(|a| &a.0)
    }

    pub fn image_processor(&self) -> Option<&Gemma4ImageProcessor> {
        self.vision.as_ref().map(|v| &v.1)
    }

    pub fn feature_extractor(&self) -> Option<&Gemma4AudioFeatureExtractor> {
        self.audio.as_ref().map(|a| &a.1)
    }

    fn no(kind: &str) -> ModelError {
        ModelError::UnsupportedOption(format!("this Gemma 4 checkpoint has no {kind} tower"))
    }

    /// An 8-bit RGB image (`width * height * 3` bytes) through the image processor.
    pub fn prepare_image(&self, rgb: &[u8], width: usize, height: usize) -> Result<Gemma4Image> {
        self.image_processor().ok_or_else(|| Self::no("vision"))?.preprocess(rgb, width, height)
    }

    /// Mono PCM at the extractor's sampling rate through the feature extractor.
    pub fn prepare_audio(&self, samples: &[f32]) -> Result<Array> {
        self.feature_extractor().ok_or_else(|| Self::no("audio"))?.extract(samples)
    }

    /// Soft tokens of the audio features `[frames, bins]`.
    pub fn audio_tokens(features: &Array) -> Result<usize> {
        Ok(Gemma4AudioTower::num_tokens(features.dim(0)?))
    }

    /// The ids the per-layer inputs read: media placeholders as the pad id.
    pub fn ple_ids(&self, tokens: &[u32]) -> Vec<u32> {
        let t = &self.tokens;
        tokens.iter().map(|&x| if t.is_placeholder(x) { t.pad } else { x }).collect()
    }

    /// Whether each image's soft tokens attend to each other both ways
    /// (`text_config.use_bidirectional_attention == "vision"`).
    pub fn bidirectional_vision(&self) -> bool {
        self.bidirectional_vision
    }

    /// The image blocks of `tokens` for [`Gemma4Model::forward_embeddings_blocks`] when the
    /// checkpoint lets image soft tokens attend both ways and `tokens` hold any: each run of
    /// consecutive image placeholders is one block (ids 0, 1, ... in order; `<boi>` and `<eoi>`
    /// are not part of it), every other token -1, as transformers'
    /// `get_block_sequence_ids_for_mask` numbers them. `None` otherwise (causal attention).
    pub fn vision_blocks(&self, tokens: &[u32]) -> Option<Vec<i32>> {
        let image = self.tokens.image;
        if !self.bidirectional_vision || !tokens.contains(&image) {
            return None;
        }
        let (mut next, mut prev) = (0, false);
        let blocks = tokens
            .iter()
            .map(|&t| {
                let id = match (t == image, prev) {
                    (false, _) => -1,
                    (true, true) => next - 1,
                    (true, false) => {
                        next += 1;
                        next - 1
                    }
                };
                prev = t == image;
                id
            })
            .collect();
        Some(blocks)
    }

    /// Replace the placeholders of `tokens` by the media's soft tokens (see the module docs).
    /// The count of image (audio) placeholders must equal the images' (clips') soft tokens.
    pub fn merge(&self, lm: &Gemma4Model, tokens: &[u32], media: &Gemma4MediaInputs) -> Result<Gemma4Merged> {
        let t = &self.tokens;
        let count = |id: u32| tokens.iter().filter(|&&x| x == id).count();
        let want_img: usize = media.images.iter().map(|i| i.num_soft_tokens).sum();
        let want_aud = media.audio.iter().map(Self::audio_tokens).sum::<Result<usize>>()?;
        let (n_img, n_aud) = (count(t.image), count(t.audio));
        if n_img != want_img || n_aud != want_aud {
            return Err(ModelError::InvalidInput(format!(
                "the prompt has {n_img} image and {n_aud} audio placeholders, the media give {want_img} image and {want_aud} audio soft tokens"
            )));
        }
        if count(t.video) > 0 {
            return Err(ModelError::UnsupportedOption("video placeholders are not supported".into()));
        }
        let l = tokens.len();
        let ple_tokens = Array::from_slice(&self.ple_ids(tokens), &[1, l])?;
        let x = lm.embed_scaled(&ple_tokens)?;
        if n_img + n_aud == 0 {
            return Ok(Gemma4Merged { ple_tokens, embeds: x });
        }
        let mut feats = Vec::new();
        for img in &media.images {
            feats.push(self.vision().ok_or_else(|| Self::no("vision"))?.embed(img)?.astype(x.dtype())?);
        }
        for a in &media.audio {
            feats.push(self.audio().ok_or_else(|| Self::no("audio"))?.embed(a)?.astype(x.dtype())?);
        }
        let table = ops::concatenate(&feats.iter().collect::<Vec<_>>(), 0)?;
        let (mut next_img, mut next_aud) = (0i32, n_img as i32);
        let mut idx = Vec::with_capacity(l);
        let mut is_media = Vec::with_capacity(l);
        for &tok in tokens {
            let row = if tok == t.image {
                next_img += 1;
                Some(next_img - 1)
            } else if tok == t.audio {
                next_aud += 1;
                Some(next_aud - 1)
            } else {
                None
            };
            idx.push(row.unwrap_or(0));
            is_media.push(row.is_some());
        }
        let rows = table.take(&Array::from_slice(&idx, &[l])?, 0)?.expand_dims(0)?;
        let mask = Array::from_slice(&is_media, &[1, l, 1])?;
        Ok(Gemma4Merged { ple_tokens, embeds: ops::where_(&mask, &rows, &x)? })
    }
}

/// What [`Gemma4Vlm::prepare`](MediaModel::prepare) keeps of an item.
enum Prepared {
    /// Patches `[rows * columns, width]` of a `(rows, columns)` grid.
    Image { patches: Vec<f32>, width: usize, grid: (usize, usize), soft_tokens: usize },
    /// Log-mel features `[frames, bins]`.
    Audio { features: Vec<f32>, frames: usize, bins: usize },
}

/// A Gemma 4 conditional-generation checkpoint served with its towers: the decoder
/// ([`Gemma4Model`], every text-only path unchanged) and [`Gemma4Media`] behind
/// [`ModelRuntime::media`]. The template writes `<|image|>` / `<|audio|>` once per item;
/// [`MediaModel::expand`] turns each into `<boi> image*n <eoi>` / `<boa> audio*n <eoa>`.
pub struct Gemma4Vlm {
    lm: Gemma4Model,
    media: Gemma4Media,
    /// The decoder's, with the family `gemma4_vlm`.
    info: ModelInfo,
}

impl Gemma4Vlm {
    pub fn new(lm: Gemma4Model, media: Gemma4Media) -> Self {
        let mut info = lm.info().clone();
        info.model_type = "gemma4_vlm".into();
        Gemma4Vlm { lm, media, info }
    }

    pub fn towers(&self) -> &Gemma4Media {
        &self.media
    }
}

impl ModelRuntime for Gemma4Vlm {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        self.lm.cache_spec()
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.lm.forward(tokens, cache, logits, hidden)
    }
    fn as_gemma4(&self) -> Option<&Gemma4Model> {
        Some(&self.lm)
    }
    fn media(&self) -> Option<&dyn MediaModel> {
        Some(self)
    }
}

impl MediaModel for Gemma4Vlm {
    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        match kind {
            MediaKind::Image => self.media.vision().map(|_| self.media.tokens.image),
            MediaKind::Audio => self.media.audio().map(|_| self.media.tokens.audio),
        }
    }

    fn prepare(&self, item: &MediaItem) -> Result<PreparedMedia> {
        let (kind, tokens, fp, data) = match item {
            MediaItem::Image(img) => {
                let rgb = img.decode()?;
                let g = self.media.prepare_image(&rgb.data, rgb.width as usize, rgb.height as usize)?;
                let mut key = rgb.data.clone();
                key.extend(rgb.width.to_le_bytes());
                key.extend(rgb.height.to_le_bytes());
                let prepared = Prepared::Image { patches: g.patches.to_vec::<f32>()?, width: g.patches.dim(1)?, grid: g.grid, soft_tokens: g.num_soft_tokens };
                (MediaKind::Image, g.num_soft_tokens, fingerprint(&key), prepared)
            }
            MediaItem::Audio(a) => {
                let s = a.samples()?;
                let f = self.media.prepare_audio(&s)?;
                let bytes: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
                let prepared = Prepared::Audio { features: f.to_vec::<f32>()?, frames: f.dim(0)?, bins: f.dim(1)? };
                (MediaKind::Audio, Gemma4Media::audio_tokens(&f)?, fingerprint(&bytes), prepared)
            }
        };
        // the soft tokens and their begin / end markers
        Ok(PreparedMedia { kind, tokens: tokens + 2, fingerprint: fp, data: Arc::new(data) })
    }

    fn expand(&self, ids: &[u32], media: &[PreparedMedia]) -> Result<Vec<u32>> {
        let t = self.media.tokens;
        expand_placeholders(
            ids,
            media,
            |k| self.placeholder(k),
            |m| match m.kind {
                MediaKind::Image => t.image_placeholder(m.tokens - 2),
                MediaKind::Audio => t.audio_placeholder(m.tokens - 2),
            },
        )
    }

    fn embed(&self, ids: &[u32], media: &[PreparedMedia], _cache: &Cache) -> Result<MediaEmbeddings> {
        let mut inputs = Gemma4MediaInputs::default();
        for m in media {
            match m.data.downcast_ref::<Prepared>() {
                Some(Prepared::Image { patches, width, grid, soft_tokens }) => inputs.images.push(Gemma4Image {
                    patches: Array::from_slice(patches, &[patches.len() / width, *width])?,
                    grid: *grid,
                    num_soft_tokens: *soft_tokens,
                }),
                Some(Prepared::Audio { features, frames, bins }) => inputs.audio.push(Array::from_slice(features, &[*frames, *bins])?),
                None => return Err(ModelError::InvalidInput("a media item prepared by another model".into())),
            }
        }
        let merged = self.media.merge(&self.lm, ids, &inputs)?;
        Ok(MediaEmbeddings { ids: Array::from_slice(ids, &[1, ids.len()])?, embeds: merged.embeds, positions: None, position_delta: 0 })
    }

    fn forward_embedded(&self, input: &MediaEmbeddings, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        if input.positions.is_some() {
            return Err(ModelError::InvalidInput("Gemma 4 takes no explicit positions".into()));
        }
        let ids: Vec<u32> = input.ids.astype(DType::U32)?.to_vec()?;
        let ple = Array::from_slice(&self.media.ple_ids(&ids), &[1, ids.len()])?;
        let blocks = self.media.vision_blocks(&ids);
        self.lm.forward_embeddings_blocks(&ple, &input.embeds, blocks.as_deref(), cache, logits, hidden)
    }
}

/// Gemma 4 conditional-generation checkpoints with a vision or audio tower (the registry's
/// `gemma4_vlm` row; the unified architecture keeps its own row).
pub(crate) fn probe(c: &ProbeContext) -> bool {
    c.has_media_tower != Some(false)
        && c.architectures.contains("Gemma4ForConditionalGeneration")
        && ["vision_config", "audio_config"].iter().any(|k| c.config.get(*k).is_some_and(|v| !v.is_null()))
}

/// The registry's constructor: the decoder and the towers from one set of weights.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    let cfg = super::gemma4::Gemma4Config::from_root(c.dir, c.config)?;
    let lm = Gemma4Model::new(c.weights, cfg, c.eos.clone())?;
    let media = Gemma4Media::new(c.dir, c.weights, c.config)?;
    Ok(Built::Lm(Box::new(Gemma4Vlm::new(lm, media))))
}

/// `tiny`: the Gemma 4 `tiny` decoder under `text_config`, a one-layer vision tower (patch 4,
/// pooling 2) and a one-layer audio encoder (unclipped linears).
pub(crate) const PRESETS: &[Preset] = &[("tiny", || {
    let text = (super::gemma4::PRESETS[0].1)();
    serde_json::json!({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "vocab_size": text["vocab_size"], "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
        "tie_word_embeddings": true, "text_config": text,
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                          "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 32},
        "audio_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "subsampling_conv_channels": [128, 8],
                         "attention_chunk_size": 4, "attention_context_left": 5, "use_clipped_linears": false, "output_proj_dims": 48},
        "image_token_id": 10, "boi_token_id": 8, "eoi_token_id": 9, "audio_token_id": 13, "boa_token_id": 11, "eoa_token_index": 12, "video_token_id": 14
    })
})];
