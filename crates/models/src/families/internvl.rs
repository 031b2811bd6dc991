//! InternVL vision-language checkpoints (Qianfan-OCR, InternVL-Chat, transformers'
//! `InternVLForConditionalGeneration`): the InternViT encoder, pixel shuffle and MLP projector
//! over a Qwen3, Qwen2 or Llama language model (mirrors transformers' `modeling_internvl.py` and
//! `GotOcr2ImageProcessorPil`).
//!
//! Two layouts load:
//! - **native** (model_type `internvl`): `vision_config`/`text_config`, keys `vision_tower.*`
//!   (q/k/v projections, `lambda_1/2`, `layernorm_before/after`), `multi_modal_projector.*` and
//!   `language_model.model.*` (or the same under `model.`, with `lm_head` at the root), tiling
//!   settings in `preprocessor_config.json`;
//! - **InternVL-Chat** (model_type `internvl_chat`, also `qianfan-ocr`): `vision_config`/`llm_config`,
//!   keys `vision_model.*` (a fused `attn.qkv`, `ls1/2`, `norm1/2`), `mlp1.{0,1,3}` and
//!   `language_model.model.*`, tiling settings in config.json (`force_image_size`,
//!   `dynamic_image_size`, `min/max_dynamic_patch`, `use_thumbnail`, `ps_version`,
//!   `select_layer`), ImageNet mean and std;
//! - **transformers' Qianfan-OCR** (model_type `qianfan_ocr`): a native-style config
//!   (`text_config`, Qwen3 by default; biased q/k/v by default; preprocessor_config.json) over
//!   weights in the InternVL-Chat layout, which is how transformers reads and writes them.
//!
//! The tensor layout is found from the weights (`vision_model.*` or `vision_tower.*`).
//!
//! - **Processor**: dynamic tiling. Among the grids of `min..=max` tiles, the one whose aspect
//!   ratio is closest to the image's (on a tie the later, larger grid while the image's area
//!   exceeds half the grid's) takes the image resized (Pillow bicubic,
//!   [`crate::media::resize`]) to `columns x rows` tiles of the tower's size; the tiles are cut
//!   row by row, and when there is more than one a thumbnail (the whole image resized to one
//!   tile) follows. Pixels are scaled to [0, 1] and normalized with `image_mean`/`image_std`.
//! - **Tower**: the patch embedding (a Conv2d with stride = kernel, run as one product), a class
//!   token, the learned position table (tiles must have the size it was trained for); pre-norm
//!   blocks (LayerNorm or RMSNorm, bidirectional attention with optional q/k RMSNorm over the
//!   whole width, layer scale, GELU MLP, layer scale). The features of `select_layer` /
//!   `vision_feature_layer` (-1: the last block, with the final LayerNorm when the native config
//!   asks for one) lose the class token and are pixel-shuffled by `downsample_ratio` (each
//!   2x2 block of patches concatenated, `ps_version` v2 order), then projected (LayerNorm, Linear,
//!   GELU, Linear) into language-model embeddings: `(image_size / patch_size)² *
//!   downsample_ratio²` tokens a tile.
//! - **Merging**: the chat template writes `<IMG_CONTEXT>` once per image; it becomes `<img>`,
//!   one `<IMG_CONTEXT>` per projected token of every tile, `</img>`, and the embeddings at the
//!   `<IMG_CONTEXT>` positions are the projector's. Positions are the usual 1-D ones.
//!
//! Videos are not supported. A prompt piece with images is prefilled in one call.
use super::qwen3::{DecoderOptions, Qwen3Config, Qwen3Model};
use crate::cache::{Cache, CacheSpec};
use crate::layers::{Activation, Linear};
use crate::media::{
    self, MediaEmbeddings, MediaItem, MediaKind, MediaModel, PreparedMedia, RgbImage,
};
use crate::registry::{Built, LoadContext, Preset};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::{Init, Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, AttentionMask, DType};
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

/// ImageNet's mean and standard deviation (InternVL-Chat's preprocessing).
const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// An integer or a `[height, width]` pair (transformers writes `image_size` and `patch_size`
/// either way).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
enum Size {
    One(usize),
    Two([usize; 2]),
}

impl Size {
    fn square(self, what: &str) -> std::result::Result<usize, String> {
        match self {
            Size::One(n) => Ok(n),
            Size::Two([h, w]) if h == w => Ok(h),
            Size::Two([h, w]) => Err(format!("vision {what} must be square, got {h}x{w}")),
        }
    }
}

/// `vision_config` of either layout (InternViT).
#[derive(Debug, Clone, Deserialize)]
struct RawVision {
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    image_size: Size,
    patch_size: Size,
    #[serde(default = "three")]
    num_channels: usize,
    #[serde(default = "gelu")]
    hidden_act: String,
    #[serde(default = "eps6")]
    layer_norm_eps: f64,
    #[serde(default = "layer_norm")]
    norm_type: String,
    /// Native name, then InternVL-Chat's.
    attention_bias: Option<bool>,
    qkv_bias: Option<bool>,
    use_qk_norm: Option<bool>,
    qk_normalization: Option<bool>,
    /// Native: `false` adds a final LayerNorm (`vision_tower.layernorm`).
    #[serde(default = "yes")]
    use_mean_pooling: bool,
}

fn three() -> usize {
    3
}
fn gelu() -> String {
    "gelu".into()
}
fn eps6() -> f64 {
    1e-6
}
fn layer_norm() -> String {
    "layer_norm".into()
}
fn yes() -> bool {
    true
}

/// The InternViT encoder's settings, from either layout.
#[derive(Debug, Clone)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate_size: usize,
    /// Side of a tile, pixels.
    pub image_size: usize,
    pub patch_size: usize,
    pub channels: usize,
    pub act: Activation,
    pub eps: f32,
    pub rms_norm: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// A LayerNorm after the last block (native `use_mean_pooling: false`).
    pub final_norm: bool,
}

impl VisionConfig {
    /// `chat`: an InternVL-Chat config; `bias`: whether q/k/v are biased when the config does
    /// not say (InternViT's and Qianfan-OCR's default; transformers' InternVL has none).
    fn from_raw(r: RawVision, chat: bool, bias: bool) -> std::result::Result<Self, String> {
        let image_size = r.image_size.square("image_size")?;
        let patch_size = r.patch_size.square("patch_size")?;
        let act = Activation::parse(&r.hidden_act)
            .ok_or_else(|| format!("unknown vision hidden_act {:?}", r.hidden_act))?;
        let rms_norm = match r.norm_type.as_str() {
            "layer_norm" => false,
            "rms_norm" => true,
            other => {
                return Err(format!(
                    "unknown vision norm_type {other:?} (layer_norm or rms_norm)"
                ))
            }
        };
        if r.num_attention_heads == 0 || r.hidden_size % r.num_attention_heads != 0 {
            return Err(format!(
                "vision hidden_size {} must split into num_attention_heads {}",
                r.hidden_size, r.num_attention_heads
            ));
        }
        if patch_size == 0 || image_size % patch_size != 0 || r.num_channels == 0 {
            return Err(format!("vision image_size {image_size} must be a positive multiple of patch_size {patch_size}"));
        }
        Ok(VisionConfig {
            hidden_size: r.hidden_size,
            layers: r.num_hidden_layers,
            heads: r.num_attention_heads,
            intermediate_size: r.intermediate_size,
            image_size,
            patch_size,
            channels: r.num_channels,
            act,
            eps: r.layer_norm_eps as f32,
            rms_norm,
            qkv_bias: if chat {
                r.qkv_bias.or(r.attention_bias).unwrap_or(bias)
            } else {
                r.attention_bias.or(r.qkv_bias).unwrap_or(bias)
            },
            qk_norm: r.use_qk_norm.or(r.qk_normalization).unwrap_or(false),
            final_norm: !chat && !r.use_mean_pooling,
        })
    }

    /// Patches along a tile's side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// The image processor's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorConfig {
    /// Per-channel normalization of the [0, 1] pixel values.
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Side of a tile, pixels.
    pub tile: usize,
    /// Dynamic tiling (`min_patches..=max_patches` tiles); otherwise the image is resized to one
    /// tile.
    pub crop_to_patches: bool,
    pub min_patches: usize,
    pub max_patches: usize,
    /// A thumbnail after the tiles when there is more than one.
    pub use_thumbnail: bool,
}

impl ProcessorConfig {
    /// Native checkpoints: `preprocessor_config.json` (`size`, `crop_to_patches`,
    /// `min_patches`, `max_patches`, `image_mean`, `image_std`) over transformers' InternVL
    /// defaults (tiling on, 1 to 12 tiles). InternVL-Chat: config.json's `force_image_size`,
    /// `dynamic_image_size`, `min_dynamic_patch`, `max_dynamic_patch` and `use_thumbnail`, with
    /// ImageNet's mean and std. The tile must be the tower's `image_size`.
    fn load(dir: &Path, root: &Value, v: &VisionConfig, chat: bool) -> Result<Self> {
        let int = |x: Option<&Value>| x.and_then(Value::as_u64).map(|x| x as usize);
        let boolean = |x: Option<&Value>| x.and_then(Value::as_bool);
        let mut p = ProcessorConfig {
            tile: v.image_size,
            crop_to_patches: true,
            min_patches: 1,
            max_patches: 12,
            use_thumbnail: true,
            image_mean: IMAGENET_MEAN,
            image_std: IMAGENET_STD,
        };
        let path = dir.join(if chat {
            "config.json"
        } else {
            "preprocessor_config.json"
        });
        let bad = |reason: String| ModelError::MalformedConfig {
            path: path.clone(),
            reason,
        };
        if chat {
            p.tile = int(root.get("force_image_size")).unwrap_or(v.image_size);
            p.crop_to_patches = boolean(root.get("dynamic_image_size")).unwrap_or(true);
            p.min_patches = int(root.get("min_dynamic_patch")).unwrap_or(1);
            p.max_patches = int(root.get("max_dynamic_patch")).unwrap_or(12);
            p.use_thumbnail = boolean(root.get("use_thumbnail")).unwrap_or(true);
        } else {
            match std::fs::read_to_string(&path) {
                Ok(raw) => {
                    let j: Value = serde_json::from_str(&raw)
                        .map_err(|e| bad(format!("invalid JSON: {e}")))?;
                    if let Some(s) = j.get("size") {
                        let (h, w) = (int(s.get("height")), int(s.get("width")));
                        match (h, w) {
                            (Some(h), Some(w)) if h == w => p.tile = h,
                            _ => {
                                return Err(bad(format!(
                                    "size must be a square {{\"height\", \"width\"}}, got {s}"
                                )))
                            }
                        }
                    }
                    p.crop_to_patches =
                        boolean(j.get("crop_to_patches")).unwrap_or(p.crop_to_patches);
                    p.min_patches = int(j.get("min_patches")).unwrap_or(p.min_patches);
                    p.max_patches = int(j.get("max_patches")).unwrap_or(p.max_patches);
                    for (key, slot) in [
                        ("image_mean", &mut p.image_mean),
                        ("image_std", &mut p.image_std),
                    ] {
                        match j.get(key) {
                            None | Some(Value::Null) => {}
                            Some(Value::Array(a))
                                if a.len() == 3 && a.iter().all(Value::is_number) =>
                            {
                                *slot = [0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32)
                            }
                            Some(other) => {
                                return Err(bad(format!(
                                    "{key} must be three numbers, got {other}"
                                )))
                            }
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ModelError::io(&path, e)),
            }
        }
        if p.tile != v.image_size {
            return Err(bad(format!(
                "tiles of {} pixels differ from the vision tower's image_size {}",
                p.tile, v.image_size
            )));
        }
        if p.min_patches == 0 || p.min_patches > p.max_patches || p.image_std.contains(&0.0) {
            return Err(bad(format!(
                "need 0 < min_patches {} <= max_patches {} and nonzero image_std",
                p.min_patches, p.max_patches
            )));
        }
        Ok(p)
    }

    /// The tile grid (columns, rows) of a `width` x `height` image (transformers'
    /// `get_optimal_tiled_canvas`).
    pub fn grid(&self, width: usize, height: usize) -> (usize, usize) {
        let mut grids = Vec::new();
        for c in 1..=self.max_patches {
            for r in 1..=self.max_patches {
                if (self.min_patches..=self.max_patches).contains(&(c * r)) {
                    grids.push((c, r));
                }
            }
        }
        grids.sort_by_key(|&(c, r)| c * r);
        let aspect = width as f64 / height as f64;
        let area = (width * height) as f64;
        let (mut best, mut best_diff) = ((1, 1), f64::INFINITY);
        for (c, r) in grids {
            let diff = (aspect - c as f64 / r as f64).abs();
            if diff < best_diff {
                best_diff = diff;
                best = (c, r);
            } else if diff == best_diff && area > 0.5 * (self.tile * self.tile * c * r) as f64 {
                best = (c, r);
            }
        }
        best
    }

    /// The tiles of an image, in order (the thumbnail last).
    pub fn tiles(&self, img: &RgbImage) -> Result<Vec<RgbImage>> {
        let t = self.tile as u32;
        if !self.crop_to_patches || self.max_patches <= 1 {
            return Ok(vec![media::resize(img, t, t, media::Filter::Bicubic)?]);
        }
        let (cols, rows) = self.grid(img.width as usize, img.height as usize);
        let big = media::resize(
            img,
            t * cols as u32,
            t * rows as u32,
            media::Filter::Bicubic,
        )?;
        let ts = self.tile;
        let mut out = Vec::with_capacity(cols * rows + 1);
        for i in 0..cols * rows {
            let (x0, y0) = ((i % cols) * ts, (i / cols) * ts);
            let mut data = Vec::with_capacity(ts * ts * 3);
            for y in y0..y0 + ts {
                let row = (y * big.width as usize + x0) * 3;
                data.extend_from_slice(&big.data[row..row + ts * 3]);
            }
            out.push(RgbImage::new(t, t, data)?);
        }
        if self.use_thumbnail && out.len() != 1 {
            out.push(media::resize(img, t, t, media::Filter::Bicubic)?);
        }
        Ok(out)
    }

    /// `pixel_values` (`[tiles, 3, tile, tile]`, row-major) and the tile count of one image, as
    /// the Hugging Face processor makes them.
    pub fn preprocess(&self, img: &RgbImage) -> Result<(Vec<f32>, usize)> {
        let tiles = self.tiles(img)?;
        let n = self.tile * self.tile;
        let mut out = Vec::with_capacity(tiles.len() * 3 * n);
        for t in &tiles {
            for c in 0..3 {
                // Rescaled in f64 and rounded to f32, then normalized in f32, as the processor does.
                let (mean, std) = (self.image_mean[c], self.image_std[c]);
                out.extend(
                    t.data
                        .iter()
                        .skip(c)
                        .step_by(3)
                        .map(|&v| ((v as f64 * (1.0 / 255.0)) as f32 - mean) / std),
                );
            }
        }
        Ok((out, tiles.len()))
    }
}

/// A preprocessed image ([`PreparedMedia::data`]).
pub struct InternImage {
    /// `[tiles, 3, tile, tile]`.
    pub pixels: Vec<f32>,
    pub tiles: usize,
}

/// LayerNorm (weight and bias) or RMSNorm (weight).
struct Norm {
    weight: Array,
    bias: Option<Array>,
    eps: f32,
}

impl Norm {
    fn load(vb: &Vb, dim: usize, rms: bool, eps: f32) -> Result<Self> {
        let weight = vb.get_init("weight", &[dim], Init::normal(1.0, 0.02))?;
        let bias = if rms {
            None
        } else {
            Some(vb.get_init("bias", &[dim], Init::normal(0.0, 0.02))?)
        };
        Ok(Norm { weight, bias, eps })
    }
    fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match &self.bias {
            Some(b) => x.layer_norm(Some(&self.weight), Some(b), self.eps)?,
            None => x.rms_norm(Some(&self.weight), self.eps)?,
        })
    }
}

struct VisionBlock {
    norm1: Norm,
    norm2: Norm,
    /// q, k and v in one `[3 * D, D]` projection.
    qkv: Linear,
    q_norm: Option<Norm>,
    k_norm: Option<Norm>,
    proj: Linear,
    ls1: Array,
    ls2: Array,
    fc1: Linear,
    fc2: Linear,
}

/// The InternViT encoder, pixel shuffle and projector.
pub struct VisionTower {
    cfg: VisionConfig,
    patch: Linear,
    cls: Array,
    pos: Array,
    blocks: Vec<VisionBlock>,
    final_norm: Option<Norm>,
    /// Blocks run before the features are read.
    feature_blocks: usize,
    /// Whether the final norm applies to the features (the last block's output was asked for).
    feature_norm: bool,
    /// `1 / downsample_ratio`.
    shuffle: usize,
    /// Pixel shuffle v1 (InternVL-Chat's `ps_version` v1) leaves out the last transpose.
    shuffle_v1: bool,
    proj_norm: Norm,
    proj_fc1: Linear,
    proj_fc2: Linear,
    proj_act: Activation,
}

impl VisionTower {
    /// The tower under `vb` and the projector under `proj`, in the InternVL-Chat layout (`chat`)
    /// or the native one.
    fn load(
        vb: &Vb,
        proj: &Vb,
        cfg: VisionConfig,
        settings: TowerSettings,
        chat: bool,
    ) -> Result<Self> {
        let (d, p, c) = (cfg.hidden_size, cfg.patch_size, cfg.channels);
        let n = cfg.grid() * cfg.grid();
        let e = vb.pp("embeddings");
        let (pe, cls_name, pos_name) = if chat {
            (
                e.pp("patch_embedding"),
                "class_embedding",
                "position_embedding",
            )
        } else {
            (
                e.pp("patch_embeddings").pp("projection"),
                "cls_token",
                "position_embeddings",
            )
        };
        let w = pe
            .get("weight", &[d, c, p, p])?
            .reshape(&[d as i32, (c * p * p) as i32])?;
        let patch = Linear::new(w, Some(pe.get_init("bias", &[d], Init::normal(0.0, 0.02))?))?;
        let cls = e.get(cls_name, &[1, 1, d])?;
        let pos = e.get(pos_name, &[1, n + 1, d])?;
        let qk_eps = if chat { cfg.eps } else { 1e-6 };
        let blocks = (0..cfg.layers)
            .map(|i| {
                let b = vb
                    .pp("encoder")
                    .pp(if chat { "layers" } else { "layer" })
                    .pp(i);
                let attn = b.pp(if chat { "attn" } else { "attention" });
                let qkv = if chat {
                    Linear::load(&attn.pp("qkv"), d, 3 * d, cfg.qkv_bias)?
                } else {
                    let (mut ws, mut bs) = (Vec::new(), Vec::new());
                    for name in ["q_proj", "k_proj", "v_proj"] {
                        let v = attn.pp(name);
                        ws.push(v.get("weight", &[d, d])?);
                        if cfg.qkv_bias {
                            bs.push(v.get_init("bias", &[d], Init::normal(0.0, 0.02))?);
                        }
                    }
                    let bias = if cfg.qkv_bias {
                        Some(ops::concatenate(&bs.iter().collect::<Vec<_>>(), 0)?)
                    } else {
                        None
                    };
                    Linear::new(ops::concatenate(&ws.iter().collect::<Vec<_>>(), 0)?, bias)?
                };
                let qk = |name: &str| -> Result<Option<Norm>> {
                    if cfg.qk_norm {
                        Norm::load(&attn.pp(name), d, true, qk_eps).map(Some)
                    } else {
                        Ok(None)
                    }
                };
                let (n1, n2, l1, l2) = if chat {
                    ("norm1", "norm2", "ls1", "ls2")
                } else {
                    (
                        "layernorm_before",
                        "layernorm_after",
                        "lambda_1",
                        "lambda_2",
                    )
                };
                Ok(VisionBlock {
                    norm1: Norm::load(&b.pp(n1), d, cfg.rms_norm, cfg.eps)?,
                    norm2: Norm::load(&b.pp(n2), d, cfg.rms_norm, cfg.eps)?,
                    qkv,
                    q_norm: qk("q_norm")?,
                    k_norm: qk("k_norm")?,
                    proj: Linear::load(
                        &attn.pp(if chat { "proj" } else { "projection_layer" }),
                        d,
                        d,
                        true,
                    )?,
                    ls1: b.get_init(l1, &[d], Init::normal(1.0, 0.02))?,
                    ls2: b.get_init(l2, &[d], Init::normal(1.0, 0.02))?,
                    fc1: Linear::load(&b.pp("mlp").pp("fc1"), d, cfg.intermediate_size, true)?,
                    fc2: Linear::load(&b.pp("mlp").pp("fc2"), cfg.intermediate_size, d, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = if cfg.final_norm {
            Some(Norm::load(&vb.pp("layernorm"), d, false, cfg.eps)?)
        } else {
            None
        };
        let s = settings.shuffle;
        let merged = d * s * s;
        let (ln, fc1, fc2) = if chat {
            ("0", "1", "3")
        } else {
            ("layer_norm", "linear_1", "linear_2")
        };
        Ok(VisionTower {
            patch,
            cls,
            pos,
            blocks,
            final_norm,
            feature_blocks: settings.feature_blocks,
            feature_norm: settings.feature_norm,
            shuffle: s,
            shuffle_v1: settings.shuffle_v1,
            proj_norm: Norm::load(&proj.pp(ln), merged, false, 1e-5)?,
            proj_fc1: Linear::load(&proj.pp(fc1), merged, settings.text_hidden, true)?,
            proj_fc2: Linear::load(
                &proj.pp(fc2),
                settings.text_hidden,
                settings.text_hidden,
                true,
            )?,
            proj_act: settings.proj_act,
            cfg,
        })
    }

    /// Projected tokens a tile becomes.
    pub fn tokens_per_tile(&self) -> usize {
        let g = self.cfg.grid() / self.shuffle;
        g * g
    }

    /// The vision tower's settings.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The language-model embeddings of `pixels` (`[tiles, 3, tile, tile]`):
    /// `[tiles * tokens_per_tile, text hidden]`, tile by tile.
    pub fn forward(&self, pixels: &Array) -> Result<Array> {
        let (d, p, c, g, heads) = (
            self.cfg.hidden_size as i32,
            self.cfg.patch_size as i32,
            self.cfg.channels as i32,
            self.cfg.grid() as i32,
            self.cfg.heads as i32,
        );
        let side = self.cfg.image_size;
        let dims = pixels.dims();
        if dims.len() != 4 || dims[1] != c || dims[2] as usize != side || dims[3] as usize != side {
            return Err(ModelError::InvalidInput(format!(
                "pixel values of shape {dims:?} for tiles of [{c}, {side}, {side}]"
            )));
        }
        let t = dims[0];
        let dtype = self.pos.dtype();
        let x = pixels
            .reshape(&[t, c, g, p, g, p])?
            .transpose(&[0, 2, 4, 1, 3, 5])?
            .reshape(&[t, g * g, c * p * p])?
            .astype(dtype)?;
        let x = self.patch.forward(&x)?;
        let cls = self
            .cls
            .astype(x.dtype())?
            .broadcast_to(&[t as usize, 1, d as usize])?;
        let mut x = ops::concatenate(&[&cls, &x], 1)?.add(&self.pos.astype(x.dtype())?)?;
        let l = g * g + 1;
        let hd = d / heads;
        let scale = (hd as f32).powf(-0.5);
        for b in &self.blocks[..self.feature_blocks] {
            let h = b.norm1.forward(&x)?;
            let parts = b.qkv.forward(&h)?.split(3, 2)?;
            let (mut q, mut k) = (parts[0].clone(), parts[1].clone());
            if let (Some(qn), Some(kn)) = (&b.q_norm, &b.k_norm) {
                q = qn.forward(&q)?;
                k = kn.forward(&k)?;
            }
            let heads_of = |a: &Array| -> Result<Array> {
                Ok(a.reshape(&[t, l, heads, hd])?.transpose(&[0, 2, 1, 3])?)
            };
            let o = crate::layers::sdpa(
                &heads_of(&q)?,
                &heads_of(&k)?,
                &heads_of(&parts[2])?,
                scale,
                AttentionMask::None,
            )?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[t, l, d])?;
            x = x.add(&b.proj.forward(&o)?.mul(&b.ls1)?)?;
            let h = b.norm2.forward(&x)?;
            x = x.add(
                &b.fc2
                    .forward(&self.cfg.act.apply(&b.fc1.forward(&h)?)?)?
                    .mul(&b.ls2)?,
            )?;
        }
        if let (Some(n), true) = (&self.final_norm, self.feature_norm) {
            x = n.forward(&x)?;
        }
        // Drop the class token; pixel shuffle each s x s block of patches into one token.
        let s = self.shuffle as i32;
        let f = x
            .slice_axis(1, 1, l as usize)?
            .reshape(&[t, g, g / s, d * s])?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[t, g / s, g / s, d * s * s])?;
        let f = if self.shuffle_v1 {
            f
        } else {
            f.transpose(&[0, 2, 1, 3])?
        };
        let f = f.reshape(&[t * (g / s) * (g / s), d * s * s])?;
        let h = self
            .proj_act
            .apply(&self.proj_fc1.forward(&self.proj_norm.forward(&f)?)?)?;
        self.proj_fc2.forward(&h)
    }
}

/// How the tower's features are read and projected (from the top-level config).
struct TowerSettings {
    feature_blocks: usize,
    feature_norm: bool,
    shuffle: usize,
    shuffle_v1: bool,
    proj_act: Activation,
    text_hidden: usize,
}

impl TowerSettings {
    fn new(c: &LoadContext, v: &VisionConfig, chat: bool, text_hidden: usize) -> Result<Self> {
        let root = c.config;
        let layer = match root.get(if chat {
            "select_layer"
        } else {
            "vision_feature_layer"
        }) {
            None | Some(Value::Null) => -1,
            Some(v) => v.as_i64().ok_or_else(|| {
                c.bad_config(format!(
                    "the vision feature layer must be one integer, got {v}"
                ))
            })?,
        };
        let n = v.layers as i64;
        let blocks = if layer < 0 { n + 1 + layer } else { layer };
        if !(0..=n).contains(&blocks) {
            return Err(c.bad_config(format!(
                "vision feature layer {layer} is outside the {n} blocks"
            )));
        }
        if let Some(s) = root
            .get("vision_feature_select_strategy")
            .and_then(Value::as_str)
            .filter(|s| *s != "default")
        {
            return Err(ModelError::UnsupportedOption(format!("vision_feature_select_strategy {s:?} (only \"default\", which drops the class token)")));
        }
        let ratio = root
            .get("downsample_ratio")
            .and_then(Value::as_f64)
            .unwrap_or(0.5);
        let shuffle = (1.0 / ratio).round() as usize;
        if ratio <= 0.0
            || shuffle == 0
            || ((shuffle as f64) * ratio - 1.0).abs() > 1e-6
            || v.grid() % shuffle != 0
        {
            return Err(c.bad_config(format!("downsample_ratio {ratio} must be 1/k for a k dividing the {} patches of a tile side", v.grid())));
        }
        let shuffle_v1 = match root.get("ps_version").and_then(Value::as_str) {
            None | Some("v2") => false,
            Some("v1") => true,
            Some(other) => {
                return Err(c.bad_config(format!("unknown ps_version {other:?} (v1 or v2)")))
            }
        };
        let act_name = if chat {
            "gelu"
        } else {
            root.get("projector_hidden_act")
                .and_then(Value::as_str)
                .unwrap_or("gelu")
        };
        let proj_act = Activation::parse(act_name)
            .ok_or_else(|| c.bad_config(format!("unknown projector_hidden_act {act_name:?}")))?;
        Ok(TowerSettings {
            feature_blocks: blocks as usize,
            feature_norm: layer == -1,
            shuffle,
            shuffle_v1,
            proj_act,
            text_hidden,
        })
    }
}

/// The ids of `<IMG_CONTEXT>`, `<img>` and `</img>`: config.json's `img_context_token_id`
/// (native: `image_token_id`), `img_start_token_id` and `img_end_token_id`, else the
/// tokenizer's added tokens of those names.
fn image_token_ids(c: &LoadContext, vocab: usize) -> Result<[u32; 3]> {
    let added: Vec<(String, u32)> = match std::fs::read_to_string(c.dir.join("tokenizer.json")) {
        Ok(raw) => {
            let j: Value = serde_json::from_str(&raw).map_err(|e| ModelError::MalformedConfig {
                path: c.dir.join("tokenizer.json"),
                reason: format!("invalid JSON: {e}"),
            })?;
            j.get("added_tokens")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|t| {
                            Some((
                                t.get("content")?.as_str()?.to_string(),
                                t.get("id")?.as_u64()? as u32,
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default()
        }
        Err(_) => Vec::new(),
    };
    let keys = [
        ("img_context_token_id", "image_token_id", "<IMG_CONTEXT>"),
        ("img_start_token_id", "img_start_token_id", "<img>"),
        ("img_end_token_id", "img_end_token_id", "</img>"),
    ];
    let mut out = [0u32; 3];
    for (slot, (key, alt, token)) in out.iter_mut().zip(keys) {
        let id = c
            .config
            .get(key)
            .or_else(|| c.config.get(alt))
            .and_then(Value::as_u64)
            .map(|x| x as u32)
            .or_else(|| added.iter().find(|(t, _)| t == token).map(|(_, id)| *id))
            .ok_or_else(|| c.bad_config(format!("no id for {token}: neither config.json's {key} nor an added token of tokenizer.json")))?;
        if id as usize >= vocab {
            return Err(c.bad_config(format!(
                "{token} id {id} is outside the vocabulary of {vocab}"
            )));
        }
        *slot = id;
    }
    Ok(out)
}

/// The language model of `text` (its `model_type`: qwen3, qwen2 or llama; transformers'
/// default for InternVL is qwen2) under `prefix`.
fn language_model(c: &LoadContext, weights: &Weights, prefix: &str) -> Result<Qwen3Model> {
    let bad = |reason: String| ModelError::MalformedConfig {
        path: c.dir.to_path_buf(),
        reason,
    };
    let kind = c
        .text
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("qwen2");
    let (cfg, opts, name): (Qwen3Config, DecoderOptions, &str) = match kind {
        "qwen3" | "qianfan_ocr" => {
            let cfg: Qwen3Config = c.parse()?;
            let opts = DecoderOptions::qwen3(&cfg).map_err(bad)?;
            (cfg, opts, "qwen3")
        }
        "qwen2" | "llama" | "internvl" | "internvl_chat" | "qianfan-ocr" => {
            let cfg: super::llama::LlamaConfig = c.parse()?;
            let rope = cfg.rope().map_err(bad)?;
            let opts = if kind == "llama" {
                DecoderOptions {
                    qk_norm: false,
                    qkv_bias: cfg.attention_bias,
                    o_bias: cfg.attention_bias,
                    mlp_bias: cfg.mlp_bias,
                    rope,
                }
            } else {
                DecoderOptions {
                    qk_norm: false,
                    qkv_bias: true,
                    o_bias: false,
                    mlp_bias: false,
                    rope,
                }
            };
            (
                cfg.qwen3,
                opts,
                if kind == "llama" { "llama" } else { "qwen2" },
            )
        }
        other => {
            return Err(bad(format!(
            "InternVL language model of model_type {other:?} (qwen3, qwen2 or llama are supported)"
        )))
        }
    };
    Qwen3Model::with_options_at(weights, cfg, &opts, name, c.eos.clone(), prefix)
}

/// An InternVL vision-language model.
pub struct InternVlModel {
    lm: Qwen3Model,
    tower: VisionTower,
    processor: ProcessorConfig,
    /// `<IMG_CONTEXT>`, `<img>`, `</img>`.
    context: u32,
    start: u32,
    end: u32,
    info: ModelInfo,
}

impl InternVlModel {
    pub fn new(c: &LoadContext) -> Result<Self> {
        let model_type = c
            .config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        // The config's form (InternVL-Chat's `llm_config` and tiling keys, or transformers'
        // `text_config` and preprocessor_config.json) and the tensors' layout are independent:
        // transformers' `qianfan_ocr` reads hub checkpoints in the InternVL-Chat layout.
        let chat = c.config.get("llm_config").is_some_and(Value::is_object)
            || matches!(model_type, "internvl_chat" | "qianfan-ocr");
        let raw: RawVision =
            crate::config::parse(c.dir, c.config.get("vision_config").unwrap_or(&Value::Null))?;
        let vision = VisionConfig::from_raw(raw, chat, model_type != "internvl")
            .map_err(|r| c.bad_config(r))?;
        let root = c.weights.root();
        let chat_keys = if root.contains("vision_model.embeddings.patch_embedding.weight") {
            true
        } else if root.contains("vision_tower.embeddings.cls_token")
            || root.contains("model.vision_tower.embeddings.cls_token")
        {
            false
        } else {
            model_type != "internvl"
        };
        let (tower_at, proj_at, lm_at) = if chat_keys {
            ("vision_model", "mlp1", "language_model.model")
        } else {
            let m = if root.contains("model.vision_tower.embeddings.cls_token") {
                "model."
            } else {
                ""
            };
            let lm = if root.contains("model.language_model.embed_tokens.weight") {
                "model.language_model"
            } else {
                "language_model.model"
            };
            (
                if m.is_empty() {
                    "vision_tower"
                } else {
                    "model.vision_tower"
                },
                if m.is_empty() {
                    "multi_modal_projector"
                } else {
                    "model.multi_modal_projector"
                },
                lm,
            )
        };
        let lm = language_model(c, c.weights, lm_at)?;
        let text_hidden = lm.info().hidden_size;
        let vocab = lm.info().vocab_size;
        let [context, start, end] = image_token_ids(c, vocab)?;
        let settings = TowerSettings::new(c, &vision, chat, text_hidden)?;
        if let Some(n) = c.config.get("image_seq_length").and_then(Value::as_u64) {
            let g = vision.grid() / settings.shuffle;
            if n as usize != g * g {
                return Err(c.bad_config(format!(
                    "image_seq_length {n} differs from the {} tokens a tile makes",
                    g * g
                )));
            }
        }
        let info = ModelInfo {
            model_type: c.family.model_type.into(),
            ..ModelRuntime::info(&lm).clone()
        };
        let processor = ProcessorConfig::load(c.dir, c.config, &vision, chat)?;
        let tower = VisionTower::load(
            &root.pp(tower_at),
            &root.pp(proj_at),
            vision,
            settings,
            chat_keys,
        )?;
        // One tile of zeros through the tower computes its weights while loading (the language
        // model's are computed by Model::materialize).
        let side = tower.cfg.image_size;
        tower
            .forward(&Array::zeros(
                &[1, tower.cfg.channels, side, side],
                DType::F32,
            )?)?
            .eval()?;
        Ok(InternVlModel {
            lm,
            tower,
            processor,
            context,
            start,
            end,
            info,
        })
    }

    /// The ids of `<IMG_CONTEXT>`, `<img>` and `</img>`.
    pub fn image_tokens(&self) -> [u32; 3] {
        [self.context, self.start, self.end]
    }
    /// The tiling and normalization settings.
    pub fn processor(&self) -> &ProcessorConfig {
        &self.processor
    }
    /// InternViT with the pixel shuffle and projector.
    pub fn tower(&self) -> &VisionTower {
        &self.tower
    }
}

/// The language model's side delegates to the decoder; [`ModelRuntime::media`] is the towers'.
impl ModelRuntime for InternVlModel {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn media(&self) -> Option<&dyn MediaModel> {
        Some(self)
    }
    fn cache_spec(&self) -> CacheSpec {
        self.lm.cache_spec()
    }
    fn forward(
        &self,
        tokens: &Array,
        cache: &mut Cache,
        logits: Logits,
        hidden: bool,
    ) -> Result<ForwardOutput> {
        self.lm.forward(tokens, cache, logits, hidden)
    }
    fn forward_taps(
        &self,
        tokens: &Array,
        cache: &mut Cache,
        logits: Logits,
        hidden: bool,
        taps: &[usize],
    ) -> Result<(ForwardOutput, Vec<Array>)> {
        self.lm.forward_taps(tokens, cache, logits, hidden, taps)
    }
    fn input_embeddings(&self, tokens: &Array) -> Result<Array> {
        self.lm.input_embeddings(tokens)
    }
    fn head_logits(&self, hidden: &Array) -> Result<Array> {
        self.lm.head_logits(hidden)
    }
}

impl MediaModel for InternVlModel {
    fn placeholder(&self, kind: MediaKind) -> Option<u32> {
        (kind == MediaKind::Image).then_some(self.context)
    }

    /// The tiles' pixel values; the item's tokens are `<img>`, the tiles' context tokens and
    /// `</img>`.
    fn prepare(&self, item: &MediaItem) -> Result<PreparedMedia> {
        let (pixels, tiles) = match item {
            MediaItem::Image(image) => self.processor.preprocess(&image.decode()?)?,
            other => {
                return Err(ModelError::UnsupportedOption(format!(
                    "{} takes images, not {:?}",
                    self.info.model_type,
                    other.kind()
                )))
            }
        };
        let fingerprint = media::fingerprint(
            &pixels
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let tokens = tiles * self.tower.tokens_per_tile() + 2;
        Ok(PreparedMedia {
            kind: MediaKind::Image,
            tokens,
            fingerprint,
            data: Arc::new(InternImage { pixels, tiles }),
        })
    }

    /// Each placeholder becomes `<img>`, its `<IMG_CONTEXT>` tokens, `</img>`.
    fn expand(&self, ids: &[u32], media: &[PreparedMedia]) -> Result<Vec<u32>> {
        media::expand_placeholders(
            ids,
            media,
            |k| self.placeholder(k),
            |m| {
                let mut v = Vec::with_capacity(m.tokens);
                v.push(self.start);
                v.extend(std::iter::repeat_n(
                    self.context,
                    m.tokens.saturating_sub(2),
                ));
                v.push(self.end);
                v
            },
        )
    }

    fn embed(
        &self,
        ids: &[u32],
        media: &[PreparedMedia],
        _cache: &Cache,
    ) -> Result<MediaEmbeddings> {
        let l = ids.len();
        if l == 0 {
            return Err(ModelError::InvalidInput("an empty prompt piece".into()));
        }
        let ids_a = Array::from_slice(ids, &[1, l])?;
        let text = self.lm.input_embeddings(&ids_a)?.reshape(&[l as i32, -1])?;
        let s = self.tower.cfg.image_size;
        let mut feats = Vec::with_capacity(media.len());
        for p in media {
            let img = p.data.downcast_ref::<InternImage>().ok_or_else(|| {
                ModelError::InvalidInput("media item was not prepared by this model".into())
            })?;
            let px = Array::from_slice(&img.pixels, &[img.tiles, 3, s, s])?;
            feats.push(self.tower.forward(&px)?.astype(text.dtype())?);
        }
        let want: usize = media.iter().map(|p| p.tokens.saturating_sub(2)).sum();
        let have = ids.iter().filter(|&&t| t == self.context).count();
        if have != want {
            return Err(ModelError::InvalidInput(format!(
                "{have} <IMG_CONTEXT> tokens for the {want} image tokens of {} images",
                media.len()
            )));
        }
        // Rows: text embeddings, then every image's features; `pick` selects one per token.
        let mut row = l as u32;
        let pick: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                if t == self.context {
                    row += 1;
                    row - 1
                } else {
                    i as u32
                }
            })
            .collect();
        let mut rows: Vec<&Array> = vec![&text];
        rows.extend(feats.iter());
        let embeds = ops::concatenate(&rows, 0)?
            .take(&Array::from_slice(&pick, &[l])?, 0)?
            .expand_dims(0)?;
        Ok(MediaEmbeddings {
            ids: ids_a,
            embeds,
            positions: None,
            position_delta: 0,
        })
    }

    fn forward_embedded(
        &self,
        input: &MediaEmbeddings,
        cache: &mut Cache,
        logits: Logits,
        hidden: bool,
    ) -> Result<ForwardOutput> {
        if input.positions.is_some() {
            return Err(ModelError::InvalidInput(
                "InternVL takes no explicit positions".into(),
            ));
        }
        self.lm
            .forward_embedded(&input.ids, &input.embeds, cache, logits, hidden)
    }
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(InternVlModel::new(c)?)))
}

/// The tiny Qwen3 text shape under a 2-block InternViT of 32 (8-pixel patches of 32-pixel tiles),
/// in the InternVL-Chat layout Qianfan-OCR ships; the image token ids in config.json.
fn tiny() -> Value {
    let mut llm = (super::qwen3::PRESETS[0].1)();
    llm["num_hidden_layers"] = json!(2);
    json!({
        "model_type": "internvl_chat", "architectures": ["InternVLChatModel"],
        "img_context_token_id": 498, "img_start_token_id": 495, "img_end_token_id": 496,
        "select_layer": -1, "ps_version": "v2", "downsample_ratio": 0.5, "dynamic_image_size": true,
        "use_thumbnail": true, "min_dynamic_patch": 1, "max_dynamic_patch": 6, "force_image_size": 32,
        "llm_config": llm,
        "vision_config": {"model_type": "intern_vit_6b", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "image_size": 32, "patch_size": 8, "num_channels": 3, "qkv_bias": true,
            "qk_normalization": false, "norm_type": "layer_norm", "layer_norm_eps": 1e-6, "hidden_act": "gelu"}
    })
}

/// `tiny` (tests).
pub(crate) const PRESETS: &[Preset] = &[("tiny", tiny)];
