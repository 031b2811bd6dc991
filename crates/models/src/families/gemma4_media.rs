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
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};
use serde_json::Value;
use std::path::Path;

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
    /// `text_config.use_bidirectional_attention == "vision"`: image tokens would attend to each
    /// other both ways in sliding layers, which the decoder does not implement.
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
        if n_img > 0 && self.bidirectional_vision {
            return Err(ModelError::UnsupportedOption("use_bidirectional_attention \"vision\" (image tokens attending both ways) is not supported".into()));
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
