//! Qwen3.5 vision-language checkpoints (`Qwen3_5ForConditionalGeneration`,
//! `Qwen3_5MoeForConditionalGeneration` with a `vision_config`): the vision transformer, the
//! image processor and M-RoPE over the [`super::qwen3_5`] language model (mirrors transformers'
//! `modeling_qwen3_5.py` and `Qwen2VLImageProcessorPil`).
//!
//! - **Processor**: the image is resized (Pillow bicubic, [`crate::media::resize`]) to Qwen's
//!   smart size (both sides multiples of `patch_size * merge_size`, the pixel count within
//!   `size.shortest_edge..=size.longest_edge`, the aspect kept), scaled to [0, 1], normalized
//!   with `image_mean`/`image_std`, and cut into patches of `C * temporal_patch_size * P * P`
//!   values (the frame repeated over the temporal patch) in merge-block order. Settings come
//!   from `preprocessor_config.json`, else the processor's defaults and the vision config.
//! - **Tower** (`model.visual.*`, or `visual.*`): the patch embedding (a Conv3d with stride =
//!   kernel, run as one product), plus the learned position table resampled bilinearly
//!   (align corners) to the image's patch grid; blocks of LayerNorm, bidirectional attention with
//!   2-D rotary positions (row and column halves, f32), LayerNorm, GELU-tanh MLP; then the patch
//!   merger (LayerNorm, each `merge_size²` patches concatenated, Linear, GELU, Linear) into
//!   language-model embeddings. One image per tower call (images attend only to themselves).
//! - **Merging**: each `<|image_pad|>` the chat template writes (between `<|vision_start|>` and
//!   `<|vision_end|>`) becomes one token per merged patch; their embeddings are the tower's.
//! - **M-RoPE**: text tokens sit at one position on all three axes; an image's tokens at
//!   (start, start + row, start + column) of its merged grid, the text after it at start +
//!   max(rows, columns). Rotary frequency `j` takes the height position when `j % 3 == 1` and
//!   `j < 3 * mrope_section[1]`, the width one when `j % 3 == 2` and `j < 3 * mrope_section[2]`,
//!   else the temporal one. After a prompt with images the cache keeps
//!   [`Cache::position_delta`] (transformers' `rope_deltas`): later text sits at cache position
//!   plus delta.
//!
//! Videos are not supported. A prompt piece with images is prefilled in one call.
use super::qwen3_5::{Qwen35Config, Qwen35Model};
use crate::cache::{Cache, CacheSpec};
use crate::layers::decoder::{ExpertBlock, HybridStack, RecurrentMixer};
use crate::layers::{Activation, Embedding, Linear, RopeAt};
use crate::media::{self, MediaEmbeddings, MediaItem, MediaKind, MediaModel, PreparedMedia, RgbImage};
use crate::registry::{Built, LoadContext, Preset, ProbeContext};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::{Init, Vb};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, AttentionMask, DType};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The registry's probe: a Qwen3.5 ConditionalGeneration config with a `vision_config`, whose
/// weights (when there are any) hold the tower.
pub(crate) fn probe(c: &ProbeContext) -> bool {
    c.has_media_tower != Some(false)
        && matches!(c.model_type, Some("qwen3_5" | "qwen3_5_moe"))
        && (c.architectures.contains("Qwen3_5ForConditionalGeneration") || c.architectures.contains("Qwen3_5MoeForConditionalGeneration"))
        && c.config.get("vision_config").is_some_and(Value::is_object)
}

/// `vision_config` of a Qwen3.5 checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    #[serde(default = "gelu_tanh")]
    pub hidden_act: String,
    pub intermediate_size: usize,
    pub num_heads: usize,
    #[serde(default = "three")]
    pub in_channels: usize,
    pub patch_size: usize,
    #[serde(default = "two")]
    pub temporal_patch_size: usize,
    #[serde(default = "two")]
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

fn gelu_tanh() -> String {
    "gelu_pytorch_tanh".into()
}
fn three() -> usize {
    3
}
fn two() -> usize {
    2
}

impl VisionConfig {
    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }
    fn rope_theta(&self) -> f32 {
        self.rope_parameters.as_ref().and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10000.0) as f32
    }
    fn validate(&self) -> std::result::Result<(), String> {
        let side = (self.num_position_embeddings as f64).sqrt() as usize;
        if self.num_heads == 0 || self.hidden_size % self.num_heads != 0 || self.head_dim() % 4 != 0 {
            return Err(format!("vision hidden_size {} must split into num_heads {} heads of a multiple of 4", self.hidden_size, self.num_heads));
        }
        if side * side != self.num_position_embeddings || side < 2 {
            return Err(format!("vision num_position_embeddings {} must be a square of at least 4", self.num_position_embeddings));
        }
        if self.patch_size == 0 || self.spatial_merge_size == 0 || self.temporal_patch_size == 0 || self.in_channels == 0 {
            return Err("vision patch_size, spatial_merge_size, temporal_patch_size and in_channels must be positive".into());
        }
        Activation::parse(&self.hidden_act).ok_or_else(|| format!("unknown vision hidden_act {:?}", self.hidden_act))?;
        Ok(())
    }
}

/// OpenAI CLIP's normalization, the processors' default.
pub(crate) const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
pub(crate) const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// The image processor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl ProcessorConfig {
    /// From `preprocessor_config.json` in `dir` when present (`size.shortest_edge` /
    /// `size.longest_edge`, or `min_pixels` / `max_pixels`), else transformers' defaults
    /// (56² to 28²·1280 pixels, CLIP mean and std) with the vision config's patch sizes.
    pub fn from_dir(dir: &Path, v: &VisionConfig) -> Result<Self> {
        let defaults = ProcessorConfig {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: v.patch_size,
            merge_size: v.spatial_merge_size,
            temporal_patch_size: v.temporal_patch_size,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
        };
        let p = Self::read(dir, defaults)?;
        if p.patch_size != v.patch_size || p.merge_size != v.spatial_merge_size || p.temporal_patch_size != v.temporal_patch_size {
            return Err(ModelError::MalformedConfig {
                path: dir.join("preprocessor_config.json"),
                reason: format!(
                    "patch_size {} / merge_size {} / temporal_patch_size {} differ from the vision config's {} / {} / {}",
                    p.patch_size, p.merge_size, p.temporal_patch_size, v.patch_size, v.spatial_merge_size, v.temporal_patch_size
                ),
            });
        }
        Ok(p)
    }

    /// The settings of `preprocessor_config.json` in `dir` over `p` (all of `p` when the file is
    /// absent): `size.shortest_edge` / `size.longest_edge` or `min_pixels` / `max_pixels`, the
    /// patch sizes, `image_mean` and `image_std`.
    pub(crate) fn read(dir: &Path, mut p: ProcessorConfig) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let raw = match std::fs::read_to_string(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(ModelError::io(&path, e)),
        };
        let bad = |reason: String| ModelError::MalformedConfig { path: path.clone(), reason };
        let j: Value = serde_json::from_str(&raw).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let int = |v: Option<&Value>| v.and_then(Value::as_u64).map(|x| x as usize);
        let size = j.get("size");
        if let Some(x) = int(size.and_then(|s| s.get("shortest_edge"))).or(int(j.get("min_pixels"))) {
            p.min_pixels = x;
        }
        if let Some(x) = int(size.and_then(|s| s.get("longest_edge"))).or(int(j.get("max_pixels"))) {
            p.max_pixels = x;
        }
        for (key, slot) in [("patch_size", &mut p.patch_size), ("merge_size", &mut p.merge_size), ("temporal_patch_size", &mut p.temporal_patch_size)] {
            if let Some(x) = int(j.get(key)) {
                *slot = x;
            }
        }
        let triple = |key: &str| -> std::result::Result<Option<[f32; 3]>, ModelError> {
            match j.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                    Ok(Some([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32)))
                }
                Some(other) => Err(bad(format!("{key} must be three numbers, got {other}"))),
            }
        };
        if let Some(m) = triple("image_mean")? {
            p.image_mean = m;
        }
        if let Some(s) = triple("image_std")? {
            p.image_std = s;
        }
        if p.patch_size == 0 || p.merge_size == 0 || p.temporal_patch_size == 0 {
            return Err(bad("patch_size, merge_size and temporal_patch_size must be positive".into()));
        }
        if p.min_pixels == 0 || p.min_pixels > p.max_pixels || p.image_std.contains(&0.0) {
            return Err(bad(format!("need 0 < min_pixels {} <= max_pixels {} and nonzero image_std", p.min_pixels, p.max_pixels)));
        }
        Ok(p)
    }

    /// Qwen's smart resize of a `height` x `width` image (transformers' `smart_resize`, Python's
    /// round-half-even included).
    pub fn smart_resize(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (h, w) = (height as f64, width as f64);
        if h.max(w) / h.min(w) > 200.0 {
            return Err(ModelError::InvalidInput(format!("image aspect ratio must be smaller than 200, got {}", h.max(w) / h.min(w))));
        }
        let mut hb = (h / factor).round_ties_even() * factor;
        let mut wb = (w / factor).round_ties_even() * factor;
        if hb * wb > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            hb = factor.max((h / beta / factor).floor() * factor);
            wb = factor.max((w / beta / factor).floor() * factor);
        } else if hb * wb < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            hb = (h * beta / factor).ceil() * factor;
            wb = (w * beta / factor).ceil() * factor;
        }
        Ok((hb as usize, wb as usize))
    }

    /// `pixel_values` (`[grid_h * grid_w, C * T * P * P]`, row-major) and the patch grid of one
    /// image, as the Hugging Face processor makes them.
    pub fn preprocess(&self, img: &RgbImage) -> Result<(Vec<f32>, usize, usize)> {
        let (h, w) = self.smart_resize(img.height as usize, img.width as usize)?;
        self.patches(img, h, w)
    }

    /// [`ProcessorConfig::preprocess`] at a given size: `img` resized to `h` x `w` (multiples of
    /// `patch_size * merge_size`), normalized and cut into patches in merge-block order.
    pub fn patches(&self, img: &RgbImage, h: usize, w: usize) -> Result<(Vec<f32>, usize, usize)> {
        let img = media::resize(img, w as u32, h as u32, media::Filter::Bicubic)?;
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (gh, gw) = (h / p, w / p);
        let norm: Vec<[f32; 256]> = (0..3)
            .map(|c| {
                let mut lut = [0f32; 256];
                for (v, out) in lut.iter_mut().enumerate() {
                    let x = (v as f64 * (1.0 / 255.0)) as f32;
                    *out = (x - self.image_mean[c]) / self.image_std[c];
                }
                lut
            })
            .collect();
        let row = 3 * t * p * p;
        let mut out = Vec::with_capacity(gh * gw * row);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for ih in 0..m {
                    for iw in 0..m {
                        let (y0, x0) = ((bh * m + ih) * p, (bw * m + iw) * p);
                        for (c, lut) in norm.iter().enumerate() {
                            for _ in 0..t {
                                for y in 0..p {
                                    for x in 0..p {
                                        out.push(lut[img.at(x0 + x, y0 + y, c) as usize]);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok((out, gh, gw))
    }
}

/// A preprocessed image ([`PreparedMedia::data`]) of the Qwen-style image families.
pub struct QwenImage {
    /// `[grid_h * grid_w, C * T * P * P]`: merge-block order for Qwen3.5, raster order for
    /// PaddleOCR-VL ([`super::paddleocr_vl`]).
    pub pixels: Vec<f32>,
    pub grid_h: usize,
    pub grid_w: usize,
}

/// LayerNorm with weight and bias.
pub(crate) struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    fn load(vb: &Vb, dim: usize) -> Result<Self> {
        Self::load_eps(vb, dim, 1e-6)
    }
    pub(crate) fn load_eps(vb: &Vb, dim: usize, eps: f32) -> Result<Self> {
        Ok(LayerNorm { weight: vb.get_init("weight", &[dim], Init::normal(1.0, 0.02))?, bias: vb.get_init("bias", &[dim], Init::normal(0.0, 0.02))?, eps })
    }
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        Ok(x.layer_norm(Some(&self.weight), Some(&self.bias), self.eps)?)
    }
}

/// A pre-norm ViT block: LayerNorm, bidirectional attention (fused q/k/v projection, 2-D
/// rotary positions), LayerNorm, MLP.
pub(crate) struct VisionBlock {
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    pub qkv: Linear,
    pub proj: Linear,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// `blocks` over the patch embeddings `x` (`[N, heads * hd]`, one image) with the rotary
/// cosines and sines `cos`, `sin` (`[N, hd / 2]`, f32; [`axial_rotary`]) and MLP activation `act`.
pub(crate) fn encode(blocks: &[VisionBlock], mut x: Array, cos: &Array, sin: &Array, heads: usize, hd: usize, act: Activation) -> Result<Array> {
    let n = x.dim(0)? as i32;
    let scale = (hd as f32).powf(-0.5);
    for b in blocks {
        let h = b.norm1.forward(&x)?;
        // [N, 3, H, hd] -> three [H, N, hd]
        let qkv = b.qkv.forward(&h)?.reshape(&[n, 3, heads as i32, hd as i32])?.transpose(&[1, 2, 0, 3])?;
        let parts = qkv.split(3, 0)?;
        let rot = |a: &Array| -> Result<Array> { crate::layers::rotate_half_by(&a.reshape(&[heads as i32, n, hd as i32])?.astype(DType::F32)?, cos, sin)?.astype(a.dtype()).map_err(Into::into) };
        let (q, k) = (rot(&parts[0])?.expand_dims(0)?, rot(&parts[1])?.expand_dims(0)?);
        let v = parts[2].reshape(&[1, heads as i32, n, hd as i32])?;
        let o = crate::layers::sdpa(&q, &k, &v, scale, AttentionMask::None)?.transpose(&[0, 2, 1, 3])?.reshape(&[n, (heads * hd) as i32])?;
        x = x.add(&b.proj.forward(&o)?)?;
        let h = b.norm2.forward(&x)?;
        x = x.add(&b.fc2.forward(&act.apply(&b.fc1.forward(&h)?)?)?)?;
    }
    Ok(x)
}

/// Rows of the square position table `table` (`[side², D]`) resampled bilinearly (align
/// corners) to a `gh` x `gw` grid, at the patches' (row, column) `coords`: `[coords.len(), D]`, f32.
pub(crate) fn interpolated_positions(table: &Array, side: usize, coords: &[(usize, usize)], gh: usize, gw: usize) -> Result<Array> {
    let taps = |idx: usize, size: usize| -> [(usize, f32); 2] {
        let src = idx as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
        let f = src.floor();
        [0, 1].map(|o| (((f as i64 + o).clamp(0, side as i64 - 1)) as usize, (1.0 - (src - f - o as f32).abs()).max(0.0)))
    };
    let n = coords.len();
    let (mut idx, mut wts) = (Vec::with_capacity(4 * n), Vec::with_capacity(4 * n));
    for &(r, c) in coords {
        for (hi, hw) in taps(r, gh) {
            for (wi, ww) in taps(c, gw) {
                idx.push((hi * side + wi) as u32);
                wts.push(hw * ww);
            }
        }
    }
    let d = table.dim(1)? as i32;
    let rows = table.take(&Array::from_slice(&idx, &[4 * n])?, 0)?.reshape(&[n as i32, 4, d])?;
    let w = Array::from_slice(&wts, &[n, 4, 1])?;
    Ok(rows.astype(DType::F32)?.mul(&w)?.sum(&[1], false)?)
}

/// The inverse frequencies of 2-D rotary positions over heads of `head_dim`: `head_dim / 4` of
/// them, each used for the row and the column.
pub(crate) fn axial_inv_freq(head_dim: usize, theta: f32) -> Vec<f32> {
    let spatial = head_dim / 2;
    (0..spatial / 2).map(|j| 1.0 / theta.powf((2 * j) as f32 / spatial as f32)).collect()
}

/// Cosines and sines of 2-D rotary angles at the patches' (row, column) `coords`:
/// `[coords.len(), 2 * inv_freq.len()]` each (row frequencies, then column ones).
pub(crate) fn axial_rotary(inv_freq: &[f32], coords: &[(usize, usize)]) -> Result<(Array, Array)> {
    let q = inv_freq.len();
    let mut ang = Vec::with_capacity(coords.len() * 2 * q);
    for &(r, c) in coords {
        ang.extend(inv_freq.iter().map(|f| r as f32 * f));
        ang.extend(inv_freq.iter().map(|f| c as f32 * f));
    }
    let a = Array::from_slice(&ang, &[coords.len(), 2 * q])?;
    Ok((a.cos()?, a.sin()?))
}

/// The Qwen3.5 vision transformer and patch merger.
pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Linear,
    pos_embed: Array,
    blocks: Vec<VisionBlock>,
    merger_norm: LayerNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    act: Activation,
    /// Rotary inverse frequencies (`head_dim / 4` of them).
    inv_freq: Vec<f32>,
}

impl VisionTower {
    pub fn load(vb: &Vb, cfg: VisionConfig) -> Result<Self> {
        let (d, p, t, c) = (cfg.hidden_size, cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels);
        let pe = vb.pp("patch_embed").pp("proj");
        let w = pe.get("weight", &[d, c, t, p, p])?.reshape(&[d as i32, (c * t * p * p) as i32])?;
        let patch_embed = Linear::new(w, Some(pe.get_init("bias", &[d], Init::normal(0.0, 0.02))?))?;
        let pos_embed = vb.pp("pos_embed").get("weight", &[cfg.num_position_embeddings, d])?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let b = vb.pp("blocks").pp(i);
                Ok(VisionBlock {
                    norm1: LayerNorm::load(&b.pp("norm1"), d)?,
                    norm2: LayerNorm::load(&b.pp("norm2"), d)?,
                    qkv: Linear::load(&b.pp("attn").pp("qkv"), d, 3 * d, true)?,
                    proj: Linear::load(&b.pp("attn").pp("proj"), d, d, true)?,
                    fc1: Linear::load(&b.pp("mlp").pp("linear_fc1"), d, cfg.intermediate_size, true)?,
                    fc2: Linear::load(&b.pp("mlp").pp("linear_fc2"), cfg.intermediate_size, d, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = d * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let m = vb.pp("merger");
        let act = Activation::parse(&cfg.hidden_act).ok_or_else(|| ModelError::InvalidInput(format!("unknown vision hidden_act {:?}", cfg.hidden_act)))?;
        let inv_freq = axial_inv_freq(cfg.head_dim(), cfg.rope_theta());
        Ok(VisionTower {
            merger_norm: LayerNorm::load(&m.pp("norm"), d)?,
            merger_fc1: Linear::load(&m.pp("linear_fc1"), merged, merged, true)?,
            merger_fc2: Linear::load(&m.pp("linear_fc2"), merged, cfg.out_hidden_size, true)?,
            cfg,
            patch_embed,
            pos_embed,
            blocks,
            act,
            inv_freq,
        })
    }

    /// The (row, column) of patch `i` of a `gh` x `gw` grid listed in merge-block order.
    fn patch_rc(&self, i: usize, gw: usize) -> (usize, usize) {
        let m = self.cfg.spatial_merge_size;
        let (in_col, in_row) = (i % m, (i / m) % m);
        let blocks_w = gw / m;
        let (block_col, block_row) = ((i / (m * m)) % blocks_w, i / (m * m * blocks_w));
        (block_row * m + in_row, block_col * m + in_col)
    }

    /// The (row, column) of every patch, in merge-block order.
    fn coords(&self, gh: usize, gw: usize) -> Vec<(usize, usize)> {
        (0..gh * gw).map(|i| self.patch_rc(i, gw)).collect()
    }

    /// The merged embeddings of one image: `pixels` `[grid_h * grid_w, C * T * P * P]` to
    /// `[grid_h * grid_w / merge², out_hidden_size]`.
    pub fn forward(&self, pixels: &Array, gh: usize, gw: usize) -> Result<Array> {
        let (m, d, heads, hd) = (self.cfg.spatial_merge_size, self.cfg.hidden_size, self.cfg.num_heads, self.cfg.head_dim());
        if gh % m != 0 || gw % m != 0 || pixels.dim(0)? != gh * gw {
            return Err(ModelError::InvalidInput(format!("{} patches for a {gh}x{gw} grid (multiples of {m})", pixels.dim(0)?)));
        }
        let dtype = self.pos_embed.dtype();
        let n = (gh * gw) as i32;
        let coords = self.coords(gh, gw);
        let side = (self.cfg.num_position_embeddings as f64).sqrt() as usize;
        let mut x = self.patch_embed.forward(&pixels.astype(dtype)?)?;
        x = x.add(&interpolated_positions(&self.pos_embed, side, &coords, gh, gw)?.astype(x.dtype())?)?;
        let (cos, sin) = axial_rotary(&self.inv_freq, &coords)?;
        let x = encode(&self.blocks, x, &cos, &sin, heads, hd, self.act)?;
        let y = self.merger_norm.forward(&x)?.reshape(&[n / (m * m) as i32, (d * m * m) as i32])?;
        self.merger_fc2.forward(&self.merger_fc1.forward(&y)?.gelu()?)
    }
}

/// A Qwen3.5 (dense or MoE) vision-language model.
pub struct Qwen35VlModel {
    lm: Qwen35Model,
    tower: VisionTower,
    processor: ProcessorConfig,
    mrope: Mrope,
    info: ModelInfo,
}

impl Qwen35VlModel {
    pub fn new(c: &LoadContext) -> Result<Self> {
        let vision: VisionConfig = crate::config::parse(c.dir, c.config.get("vision_config").unwrap_or(&Value::Null))?;
        vision.validate().map_err(|r| c.bad_config(r))?;
        let cfg: Qwen35Config = c.parse()?;
        let rotary = cfg.rotary_dims();
        let section: Vec<usize> = c
            .text
            .get("mrope_section")
            .or_else(|| c.text.get("rope_scaling").and_then(|r| r.get("mrope_section")))
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
            .unwrap_or_else(|| vec![11, 11, 10]);
        if section.len() != 3 {
            return Err(c.bad_config(format!("mrope_section must have 3 entries, got {section:?}")));
        }
        let freq_axis = (0..rotary / 2)
            .map(|j| match j % 3 {
                1 if j < 3 * section[1] => 1,
                2 if j < 3 * section[2] => 2,
                _ => 0,
            })
            .collect();
        let inv_freq = (0..rotary / 2).map(|j| 1.0 / cfg.rope_theta.powf((2 * j) as f32 / rotary as f32)).collect();
        if vision.out_hidden_size != cfg.hidden_size {
            return Err(c.bad_config(format!("vision out_hidden_size {} differs from the text hidden_size {}", vision.out_hidden_size, cfg.hidden_size)));
        }
        let image_token = c.config.get("image_token_id").and_then(Value::as_u64).ok_or_else(|| c.bad_config("image_token_id is missing"))? as u32;
        if image_token as usize >= cfg.vocab_size {
            return Err(c.bad_config(format!("image_token_id {image_token} is outside the vocabulary of {}", cfg.vocab_size)));
        }
        let processor = ProcessorConfig::from_dir(c.dir, &vision)?;
        let text_family = if cfg.num_experts > 0 { "qwen3_5_moe" } else { "qwen3_5" };
        let lm = Qwen35Model::new(c.weights, cfg, &c.text, c.eos.clone(), text_family)?;
        let root = c.weights.root();
        let prefix = if root.contains("visual.patch_embed.proj.weight") { "visual" } else { "model.visual" };
        let tower = VisionTower::load(&root.pp(prefix), vision)?;
        // Compute the tower's weights on the loading thread (one merge block of zero pixels), as
        // Model::materialize does for the language model.
        let (m, row) = (tower.cfg.spatial_merge_size, tower.cfg.in_channels * tower.cfg.temporal_patch_size * tower.cfg.patch_size * tower.cfg.patch_size);
        tower.forward(&Array::zeros(&[m * m, row], DType::F32)?, m, m)?.eval()?;
        let info = ModelInfo { model_type: c.family.model_type.into(), ..ModelRuntime::info(&lm).clone() };
        let mrope = Mrope { image_token, merge: processor.merge_size, inv_freq, freq_axis };
        Ok(Qwen35VlModel { lm, tower, processor, mrope, info })
    }

    /// The image processor's settings.
    pub fn processor(&self) -> &ProcessorConfig {
        &self.processor
    }
    /// The vision tower.
    pub fn tower(&self) -> &VisionTower {
        &self.tower
    }
    /// The language model.
    pub fn language_model(&self) -> &Qwen35Model {
        &self.lm
    }
}

impl ModelRuntime for Qwen35VlModel {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        self.lm.cache_spec()
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.lm.stack.forward_at(tokens, cache, logits, hidden, &text_rope(cache))
    }
    fn has_mtp_weights(&self) -> bool {
        self.lm.has_mtp_weights()
    }
    fn mtp_layers(&self) -> usize {
        self.lm.mtp_layers()
    }
    fn mtp_cache_spec(&self) -> Option<CacheSpec> {
        self.lm.mtp_cache_spec()
    }
    fn mtp_forward(&self, tokens: &Array, hidden: &Array, cache: &mut Cache, layer: usize) -> Result<(Array, Array)> {
        self.lm.mtp_forward(tokens, hidden, cache, layer)
    }
    fn media(&self) -> Option<&dyn MediaModel> {
        Some(self)
    }
}

/// `impl MediaModel for $ty` through [`Mrope`]: the type's `mrope`, `info`, `processor` (its
/// `preprocess`), `tower` (its `forward`) and decoder stack at field path `$stack`.
macro_rules! mrope_media_model {
    ($ty:ty, $($stack:ident).+) => {
        impl MediaModel for $ty {
            fn placeholder(&self, kind: MediaKind) -> Option<u32> {
                (kind == MediaKind::Image).then_some(self.mrope.image_token)
            }
            fn prepare(&self, item: &MediaItem) -> Result<PreparedMedia> {
                self.mrope.prepare(item, &self.info.model_type, |img| self.processor.preprocess(img))
            }
            fn embed(&self, ids: &[u32], media: &[PreparedMedia], cache: &Cache) -> Result<MediaEmbeddings> {
                self.mrope.embed(ids, media, cache, &self.$($stack).+.embed, |px, gh, gw| self.tower.forward(px, gh, gw))
            }
            fn forward_embedded(&self, input: &MediaEmbeddings, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
                self.mrope.forward_embedded(&self.$($stack).+, input, cache, logits, hidden)
            }
        }
    };
}
pub(crate) use mrope_media_model;

mrope_media_model!(Qwen35VlModel, lm.stack);

/// What the image families with Qwen-style M-RoPE share between [`MediaModel`] calls: the image
/// placeholder, the processor's merge size and the decoder's rotary frequencies.
pub(crate) struct Mrope {
    pub image_token: u32,
    pub merge: usize,
    pub inv_freq: Vec<f32>,
    /// Which rotary frequency reads which axis (0 temporal, 1 height, 2 width).
    pub freq_axis: Vec<u8>,
}

impl Mrope {
    /// [`MediaModel::prepare`]: decode an image and `preprocess` it into a [`QwenImage`].
    pub fn prepare(&self, item: &MediaItem, model_type: &str, preprocess: impl FnOnce(&RgbImage) -> Result<(Vec<f32>, usize, usize)>) -> Result<PreparedMedia> {
        let MediaItem::Image(image) = item else {
            return Err(ModelError::UnsupportedOption(format!("{model_type} takes images, not {:?}", item.kind())));
        };
        let (pixels, grid_h, grid_w) = preprocess(&image.decode()?)?;
        let m = self.merge;
        let bytes: Vec<u8> = pixels.iter().flat_map(|v| v.to_le_bytes()).chain((grid_h as u64).to_le_bytes()).chain((grid_w as u64).to_le_bytes()).collect();
        Ok(PreparedMedia {
            kind: MediaKind::Image,
            tokens: grid_h * grid_w / (m * m),
            fingerprint: media::fingerprint(&bytes),
            data: Arc::new(QwenImage { pixels, grid_h, grid_w }),
        })
    }

    /// [`MediaModel::embed`]: the text embeddings of `ids` with each image's `tower` output
    /// (pixels `[grid_h * grid_w, row]`, grid_h, grid_w) merged in ([`merge_mrope`]).
    pub fn embed(&self, ids: &[u32], media: &[PreparedMedia], cache: &Cache, embed: &Embedding, tower: impl Fn(&Array, usize, usize) -> Result<Array>) -> Result<MediaEmbeddings> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("an empty prompt piece".into()));
        }
        let text = embed.forward(&Array::from_slice(ids, &[1, ids.len()])?)?.reshape(&[ids.len() as i32, -1])?;
        let m = self.merge;
        let mut images = Vec::with_capacity(media.len());
        for p in media {
            let img = p.data.downcast_ref::<QwenImage>().ok_or_else(|| ModelError::InvalidInput("media item was not prepared by this model".into()))?;
            let n = img.grid_h * img.grid_w;
            if n == 0 || img.pixels.len() % n != 0 {
                return Err(ModelError::InvalidInput(format!("{} pixel values for a {}x{} patch grid", img.pixels.len(), img.grid_h, img.grid_w)));
            }
            let px = Array::from_slice(&img.pixels, &[n, img.pixels.len() / n])?;
            images.push((tower(&px, img.grid_h, img.grid_w)?.astype(text.dtype())?, img.grid_h / m, img.grid_w / m));
        }
        merge_mrope(ids, self.image_token, text, &images, cache)
    }

    /// [`MediaModel::forward_embedded`] on `stack`: the M-RoPE angles of the input's positions (or
    /// the text positions after the cache's delta), then the input's delta kept in the cache.
    pub fn forward_embedded<R: RecurrentMixer, E: ExpertBlock>(&self, stack: &HybridStack<R, E>, input: &MediaEmbeddings, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let at = match &input.positions {
            None => text_rope(cache),
            Some(p) => mrope_angles(p, &self.inv_freq, &self.freq_axis)?,
        };
        let out = stack.forward_embedded(&input.ids, &input.embeds, cache, logits, hidden, at)?;
        cache.set_position_delta(input.position_delta);
        Ok(out)
    }
}

/// The input of a prompt piece under Qwen-style M-RoPE: the text embeddings `text` (`[L, H]`) of
/// `ids`, with each run of `image_token`s replaced by the rows of the next of `images` (merged
/// features `[rows * cols, H]`, the merged grid's rows and columns). Text tokens sit at one
/// position on all three axes; an image's tokens at (start, start + row, start + column), the
/// text after it at start + max(rows, columns); positions start at the cache's position plus its
/// [`Cache::position_delta`].
pub(crate) fn merge_mrope(ids: &[u32], image_token: u32, text: Array, images: &[(Array, usize, usize)], cache: &Cache) -> Result<MediaEmbeddings> {
    let l = ids.len();
    // Rows: text embeddings, then every image's features; `pick` selects one per token.
    let start = cache.offset() as i64 + cache.position_delta();
    let (mut pos, mut pick) = ([Vec::with_capacity(l), Vec::with_capacity(l), Vec::with_capacity(l)], Vec::with_capacity(l));
    let (mut cur, mut feat_row, mut i) = (start, l, 0);
    let mut next_image = images.iter();
    while i < l {
        if ids[i] != image_token {
            for a in &mut pos {
                a.push(cur as i32);
            }
            pick.push(i as u32);
            cur += 1;
            i += 1;
            continue;
        }
        let (_, rows, cols) = next_image.next().ok_or_else(|| ModelError::InvalidInput("more image tokens than images".into()))?;
        let (rows, cols) = (*rows, *cols);
        if i + rows * cols > l || ids[i..i + rows * cols].iter().any(|&t| t != image_token) {
            return Err(ModelError::InvalidInput(format!("image {} needs {} consecutive image tokens at position {i}", pick.len(), rows * cols)));
        }
        for r in 0..rows {
            for c in 0..cols {
                pos[0].push(cur as i32);
                pos[1].push((cur + r as i64) as i32);
                pos[2].push((cur + c as i64) as i32);
                pick.push(feat_row as u32);
                feat_row += 1;
            }
        }
        cur += rows.max(cols) as i64;
        i += rows * cols;
    }
    if next_image.next().is_some() {
        return Err(ModelError::InvalidInput(format!("{} images for fewer image tokens", images.len())));
    }
    let mut rows: Vec<&Array> = vec![&text];
    rows.extend(images.iter().map(|(f, _, _)| f));
    let embeds = ops::concatenate(&rows, 0)?.take(&Array::from_slice(&pick, &[l])?, 0)?.expand_dims(0)?;
    let flat: Vec<i32> = pos.concat();
    Ok(MediaEmbeddings { ids: Array::from_slice(ids, &[1, l])?, embeds, positions: Some(Array::from_slice(&flat, &[3, l])?), position_delta: cur - (cache.offset() + l) as i64 })
}

/// The rotary angles of M-RoPE `positions` (`[3, L]`): frequency `j` (of `inv_freq`) reads the
/// axis `freq_axis[j]` (0 temporal, 1 height, 2 width).
pub(crate) fn mrope_angles(positions: &Array, inv_freq: &[f32], freq_axis: &[u8]) -> Result<RopeAt> {
    let p = positions.astype(DType::I32)?.to_vec::<i32>()?;
    let l = p.len() / 3;
    let mut ang = Vec::with_capacity(l * inv_freq.len());
    for t in 0..l {
        for (j, f) in inv_freq.iter().enumerate() {
            ang.push(p[freq_axis[j] as usize * l + t] as f32 * f);
        }
    }
    let a = Array::from_slice(&ang, &[l, inv_freq.len()])?;
    Ok(RopeAt::Angles { cos: a.cos()?, sin: a.sin()? })
}

/// Where text sits for the rotary embedding after media: at its cache position plus the cache's
/// [`Cache::position_delta`].
pub(crate) fn text_rope(cache: &Cache) -> RopeAt {
    match cache.position_delta() {
        0 => RopeAt::Cache,
        d => RopeAt::Shift(d),
    }
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(Qwen35VlModel::new(c)?)))
}

/// The tiny Qwen3.5 text shape with a one-block vision tower (patches of 16, merged 2x2, an
/// 8x8 position table).
fn tiny() -> Value {
    let mut text = (super::qwen3_5::PRESETS[0].1)();
    text["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "mrope_interleaved": true});
    serde_json::json!({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": 498, "video_token_id": 499, "vision_start_token_id": 495, "vision_end_token_id": 496,
        "tie_word_embeddings": false, "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64, "num_heads": 2,
            "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
            "num_position_embeddings": 64, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}}
    })
}

/// `tiny` (tests).
pub(crate) const PRESETS: &[Preset] = &[("tiny", tiny)];
