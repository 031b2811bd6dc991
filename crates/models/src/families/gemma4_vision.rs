//! Gemma 4 vision tower and its image processor, as transformers' `modeling_gemma4.py`
//! (`Gemma4VisionModel`, `Gemma4MultimodalEmbedder`) and `image_processing_pil_gemma4.py`
//! (`Gemma4ImageProcessorPil`) define them.
//!
//! Image processing: an aspect-ratio preserving resize to the largest size whose sides are
//! multiples of `pooling_kernel_size * patch_size` within `max_soft_tokens * k²` patches (PIL's
//! antialiased bicubic on 8-bit pixels, reproduced here in its fixed-point arithmetic), a
//! rescale by 1/255 and a split into `patch_size²·3` patches in (row, column, channel) order.
//!
//! Tower: `2 (x - 0.5)` patch pixels through `input_proj` plus learned x and y position
//! embeddings; encoder layers with q/k RMSNorm, an unscaled v RMSNorm, attention scale 1 and a
//! 2-D rope (the first half of each head rotates by the patch column, the second half by its
//! row); a `k x k` average pooling of the patch grid scaled by `sqrt(hidden)`; the optional
//! standardisation `(h - std_bias) * std_scale`; then `embed_vision` (a scale-free RMSNorm and
//! a projection into the language model's width).
//!
//! Padding patches of the HF processor are never built: the tower runs on the real patches,
//! which is what the padded batch computes for them (padding keys are masked, padding rows are
//! dropped after pooling).
use crate::config::default_usize;
use crate::layers::{Activation, Linear, RmsNorm};
use crate::weights::Vb;
use crate::{ModelError, Result};
use mlx_array::{ops, Array, AttentionMask, DType};
use serde::Deserialize;
use serde_json::Value;

pub(crate) fn default_eps() -> f32 {
    1e-6
}

fn default_act() -> String {
    "gelu_pytorch_tanh".into()
}

/// `vision_config` of a Gemma 4 checkpoint (defaults as transformers' `Gemma4VisionConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4VisionConfig {
    #[serde(default = "default_usize::<768>")]
    pub hidden_size: usize,
    #[serde(default = "default_usize::<3072>")]
    pub intermediate_size: usize,
    #[serde(default = "default_usize::<16>")]
    pub num_hidden_layers: usize,
    #[serde(default = "default_usize::<12>")]
    pub num_attention_heads: usize,
    #[serde(default = "default_usize::<12>")]
    pub num_key_value_heads: usize,
    #[serde(default = "default_usize::<64>")]
    pub head_dim: usize,
    #[serde(default = "default_act")]
    pub hidden_activation: String,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    #[serde(default = "default_usize::<3>")]
    pub pooling_kernel_size: usize,
    #[serde(default = "default_usize::<16>")]
    pub patch_size: usize,
    #[serde(default = "default_usize::<10240>")]
    pub position_embedding_size: usize,
    #[serde(default)]
    pub use_clipped_linears: bool,
    #[serde(default)]
    pub standardize: bool,
    #[serde(default)]
    pub attention_bias: Option<bool>,
}

impl Gemma4VisionConfig {
    /// The axial rope's θ (`rope_parameters.rope_theta`, 100 by default).
    pub fn rope_theta(&self) -> f32 {
        self.rope_parameters.as_ref().and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).map_or(100.0, |v| v as f32)
    }

    /// Checks the settings before any tensor is read.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let (h, n, kv, d) = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim);
        if h == 0 || n == 0 || kv == 0 || self.num_hidden_layers == 0 || self.intermediate_size == 0 {
            return Err("vision_config: hidden_size, intermediate_size, num_hidden_layers and the head counts must be positive".into());
        }
        if n % kv != 0 {
            return Err(format!("vision_config: {n} attention heads over {kv} key/value heads"));
        }
        if d == 0 || d % 4 != 0 {
            return Err(format!("vision_config: head_dim {d} must be a positive multiple of 4 (two rotated axes)"));
        }
        if self.patch_size == 0 || self.pooling_kernel_size == 0 || self.position_embedding_size == 0 {
            return Err("vision_config: patch_size, pooling_kernel_size and position_embedding_size must be positive".into());
        }
        if let Some(t) = self.rope_parameters.as_ref().and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
            if t != "axial" {
                return Err(format!("vision_config: rope_type {t:?} is not supported (the vision tower's rope is axial)"));
            }
        }
        if self.attention_bias == Some(true) {
            return Err("vision_config: attention_bias is not supported (Gemma 4 vision projections have no bias)".into());
        }
        if Activation::parse(&self.hidden_activation).is_none() {
            return Err(format!("vision_config: unknown hidden_activation {:?}", self.hidden_activation));
        }
        Ok(())
    }
}

/// transformers' `Gemma4ClippableLinear`: a bias-free projection stored under `linear`, with
/// the input and output clamped to the checkpoint's `input_min/max`, `output_min/max` scalars
/// when the config's `use_clipped_linears` is on.
pub(crate) struct ClipLinear {
    lin: Linear,
    clip: Option<[f32; 4]>,
}

impl ClipLinear {
    pub(crate) fn load(vb: &Vb, clipped: bool, in_dim: usize, out_dim: usize) -> Result<Self> {
        let lin = Linear::load(&vb.pp("linear"), in_dim, out_dim, false)?;
        let clip = if clipped {
            let s = |n: &str| -> Result<f32> {
                let a = vb.get_any(n)?;
                if a.size() != 1 {
                    return Err(ModelError::InvalidInput(format!("{n} of a clipped linear must be a scalar, got shape {:?}", a.shape())));
                }
                Ok(a.astype(DType::F32)?.reshape(&[])?.item_f32()?)
            };
            Some([s("input_min")?, s("input_max")?, s("output_min")?, s("output_max")?])
        } else {
            None
        };
        Ok(ClipLinear { lin, clip })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        match self.clip {
            None => self.lin.forward(x),
            Some([a, b, c, d]) => Ok(self.lin.forward(&x.clip(a, b)?)?.clip(c, d)?),
        }
    }
}

/// A scale-free RMSNorm and a projection into the language model (`Gemma4MultimodalEmbedder`).
pub(crate) struct MediaEmbedder {
    norm: RmsNorm,
    proj: Linear,
}

impl MediaEmbedder {
    pub(crate) fn load(vb: &Vb, media_hidden: usize, text_hidden: usize, eps: f32) -> Result<Self> {
        Ok(MediaEmbedder { norm: RmsNorm::unit(eps), proj: Linear::load(&vb.pp("embedding_projection"), media_hidden, text_hidden, false)? })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        self.proj.forward(&self.norm.forward(x)?)
    }
}

struct VisionAttn {
    q: ClipLinear,
    k: ClipLinear,
    v: ClipLinear,
    o: ClipLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

struct VisionLayer {
    attn: VisionAttn,
    gate: ClipLinear,
    up: ClipLinear,
    down: ClipLinear,
    act: Activation,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    post_ffn_norm: RmsNorm,
}

/// Per-patch cos/sin of the 2-D rope (`[N, 1, D]`) and the rotation `x * cos + rot(x) * sin`,
/// where each half of the head rotates its own two quarters (transformers'
/// `apply_multidimensional_rope` over `Gemma4VisionRotaryEmbedding`).
struct Rope2d {
    cos: Array,
    sin: Array,
}

impl Rope2d {
    fn new(grid: (usize, usize), head_dim: usize, theta: f32) -> Result<Self> {
        let (ph, pw) = grid;
        let q = head_dim / 4;
        let half = (head_dim / 2) as f32;
        let inv: Vec<f32> = (0..q).map(|j| 1.0 / theta.powf((2 * j) as f32 / half)).collect();
        let n = ph * pw;
        let (mut cos, mut sin) = (Vec::with_capacity(n * head_dim), Vec::with_capacity(n * head_dim));
        for idx in 0..n {
            let (x, y) = ((idx % pw) as f32, (idx / pw) as f32);
            for pos in [x, x, y, y] {
                for f in &inv {
                    let a = pos * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        Ok(Rope2d { cos: Array::from_slice(&cos, &[n, 1, head_dim])?, sin: Array::from_slice(&sin, &[n, 1, head_dim])? })
    }

    /// `x`: `[N, heads, D]`.
    fn apply(&self, x: &Array) -> Result<Array> {
        let d = x.dim(-1)?;
        let q = d / 4;
        let part = |a: usize| x.slice_axis(-1, a * q, (a + 1) * q);
        let rot = ops::concatenate(&[&part(1)?.neg()?, &part(0)?, &part(3)?.neg()?, &part(2)?], -1)?;
        let (cos, sin) = (self.cos.astype(x.dtype())?, self.sin.astype(x.dtype())?);
        Ok(x.mul(&cos)?.add(&rot.mul(&sin)?)?)
    }
}

impl VisionAttn {
    fn forward(&self, x: &Array, rope: &Rope2d) -> Result<Array> {
        let n = x.dim(1)? as i32;
        let d = self.head_dim as i32;
        let heads = |a: Array, h: usize| a.reshape(&[n, h as i32, d]);
        let q = rope.apply(&self.q_norm.forward(&heads(self.q.forward(x)?, self.heads)?)?)?;
        let k = rope.apply(&self.k_norm.forward(&heads(self.k.forward(x)?, self.kv_heads)?)?)?;
        let v = self.v_norm.forward(&heads(self.v.forward(x)?, self.kv_heads)?)?;
        let t = |a: Array| a.expand_dims(0)?.transpose(&[0, 2, 1, 3]);
        let o = t(q)?.sdpa(&t(k)?, &t(v)?, 1.0, AttentionMask::None)?;
        let o = o.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, -1])?;
        self.o.forward(&o)
    }
}

/// An image as the tower takes it: the processor's patches `[N, 3·p²]` (f32 in `[0, 1]`,
/// row-major over the `grid` of `(rows, columns)` patches) and its number of soft tokens.
#[derive(Debug, Clone)]
pub struct Gemma4Image {
    pub patches: Array,
    pub grid: (usize, usize),
    pub num_soft_tokens: usize,
}

/// The vision tower with its `embed_vision` projection.
pub struct Gemma4VisionTower {
    cfg: Gemma4VisionConfig,
    input_proj: Linear,
    pos_table: Array,
    layers: Vec<VisionLayer>,
    standardize: Option<(Array, Array)>,
    embed: MediaEmbedder,
}

impl Gemma4VisionTower {
    /// `tower`: the `vision_tower` tensors; `embed`: the `embed_vision` tensors.
    pub fn load(tower: &Vb, embed: &Vb, cfg: Gemma4VisionConfig, text_hidden: usize) -> Result<Self> {
        cfg.validate().map_err(ModelError::InvalidInput)?;
        let (h, p, d) = (cfg.hidden_size, cfg.patch_size, cfg.head_dim);
        let (nh, nkv, eps, clip) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps, cfg.use_clipped_linears);
        let act = Activation::parse(&cfg.hidden_activation).expect("validated");
        let pe = tower.pp("patch_embedder");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = tower.pp("encoder.layers").pp(i);
                let a = vb.pp("self_attn");
                let m = vb.pp("mlp");
                let norm = |n: &str| RmsNorm::load(&vb.pp(n), h, eps, 0.0);
                Ok(VisionLayer {
                    attn: VisionAttn {
                        q: ClipLinear::load(&a.pp("q_proj"), clip, h, nh * d)?,
                        k: ClipLinear::load(&a.pp("k_proj"), clip, h, nkv * d)?,
                        v: ClipLinear::load(&a.pp("v_proj"), clip, h, nkv * d)?,
                        o: ClipLinear::load(&a.pp("o_proj"), clip, nh * d, h)?,
                        q_norm: RmsNorm::load(&a.pp("q_norm"), d, eps, 0.0)?,
                        k_norm: RmsNorm::load(&a.pp("k_norm"), d, eps, 0.0)?,
                        v_norm: RmsNorm::unit(eps),
                        heads: nh,
                        kv_heads: nkv,
                        head_dim: d,
                    },
                    gate: ClipLinear::load(&m.pp("gate_proj"), clip, h, cfg.intermediate_size)?,
                    up: ClipLinear::load(&m.pp("up_proj"), clip, h, cfg.intermediate_size)?,
                    down: ClipLinear::load(&m.pp("down_proj"), clip, cfg.intermediate_size, h)?,
                    act,
                    input_norm: norm("input_layernorm")?,
                    post_attn_norm: norm("post_attention_layernorm")?,
                    pre_ffn_norm: norm("pre_feedforward_layernorm")?,
                    post_ffn_norm: norm("post_feedforward_layernorm")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let standardize = if cfg.standardize { Some((tower.get("std_bias", &[h])?, tower.get("std_scale", &[h])?)) } else { None };
        Ok(Gemma4VisionTower {
            input_proj: Linear::load(&pe.pp("input_proj"), 3 * p * p, h, false)?,
            pos_table: pe.get("position_embedding_table", &[2, cfg.position_embedding_size, h])?,
            layers,
            standardize,
            embed: MediaEmbedder::load(embed, h, text_hidden, eps)?,
            cfg,
        })
    }

    pub fn config(&self) -> &Gemma4VisionConfig {
        &self.cfg
    }

    fn check(&self, img: &Gemma4Image) -> Result<()> {
        let (ph, pw) = img.grid;
        let (p, k) = (self.cfg.patch_size, self.cfg.pooling_kernel_size);
        if img.patches.shape() != [ph * pw, 3 * p * p] {
            return Err(ModelError::InvalidInput(format!("image patches must be [{}, {}], got {:?}", ph * pw, 3 * p * p, img.patches.shape())));
        }
        if ph == 0 || pw == 0 || ph % k != 0 || pw % k != 0 {
            return Err(ModelError::InvalidInput(format!("patch grid {ph}x{pw} is not a positive multiple of the {k}x{k} pooling kernel")));
        }
        if ph.max(pw) > self.cfg.position_embedding_size {
            return Err(ModelError::InvalidInput(format!("patch grid {ph}x{pw} exceeds the {} position embeddings", self.cfg.position_embedding_size)));
        }
        if img.num_soft_tokens != (ph / k) * (pw / k) {
            return Err(ModelError::InvalidInput(format!("{} soft tokens for a {ph}x{pw} patch grid pooled {k}x{k}", img.num_soft_tokens)));
        }
        Ok(())
    }

    /// The tower's output (`Gemma4VisionModel`'s `last_hidden_state`): `[soft tokens, hidden]`,
    /// f32, pooled, scaled and standardised.
    pub fn encode(&self, img: &Gemma4Image) -> Result<Array> {
        self.check(img)?;
        let (ph, pw) = img.grid;
        let (h, k) = (self.cfg.hidden_size, self.cfg.pooling_kernel_size);
        let n = ph * pw;
        let wdt = self.pos_table.dtype();
        let px = img.patches.astype(DType::F32)?.add_scalar(-0.5)?.mul_scalar(2.0)?.astype(wdt)?;
        let xs: Vec<i32> = (0..n).map(|i| (i % pw) as i32).collect();
        let ys: Vec<i32> = (0..n).map(|i| (i / pw) as i32).collect();
        let table = |axis: usize| self.pos_table.slice_axis(0, axis, axis + 1)?.squeeze(&[0]);
        let pos = table(0)?.take(&Array::from_slice(&xs, &[n])?, 0)?.add(&table(1)?.take(&Array::from_slice(&ys, &[n])?, 0)?)?;
        let mut x = self.input_proj.forward(&px)?.add(&pos)?.expand_dims(0)?;
        let rope = Rope2d::new(img.grid, self.cfg.head_dim, self.cfg.rope_theta())?;
        for l in &self.layers {
            let a = l.attn.forward(&l.input_norm.forward(&x)?, &rope)?;
            x = x.add(&l.post_attn_norm.forward(&a)?)?;
            let f = l.pre_ffn_norm.forward(&x)?;
            let f = l.down.forward(&l.act.apply(&l.gate.forward(&f)?)?.mul(&l.up.forward(&f)?)?)?;
            x = x.add(&l.post_ffn_norm.forward(&f)?)?;
        }
        // k x k average pooling over the patch grid, in f32, scaled by sqrt(hidden).
        let (gh, gw) = ((ph / k) as i32, (pw / k) as i32);
        let pooled = x.astype(DType::F32)?.reshape(&[gh, k as i32, gw, k as i32, h as i32])?.mean(&[1, 3], false)?;
        let mut out = pooled.reshape(&[gh * gw, h as i32])?.mul_scalar((h as f32).sqrt())?;
        if let Some((bias, scale)) = &self.standardize {
            out = out.sub(&bias.astype(DType::F32)?)?.mul(&scale.astype(DType::F32)?)?;
        }
        Ok(out)
    }

    /// The image's soft tokens in the language model's space (`[soft tokens, text hidden]`).
    pub fn embed(&self, img: &Gemma4Image) -> Result<Array> {
        let h = self.encode(img)?.astype(self.pos_table.dtype())?;
        self.embed.forward(&h)
    }
}

/// `max_soft_tokens` values transformers' Gemma 4 image processor accepts.
pub const SUPPORTED_SOFT_TOKENS: [usize; 5] = [70, 140, 280, 560, 1120];

/// The Gemma 4 image processor (`Gemma4ImageProcessorPil`: PIL bicubic resize, rescale by
/// 1/255, no normalisation; the tower maps pixels to `[-1, 1]` itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemma4ImageProcessor {
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
    /// Soft tokens per image at most (280 by default; one of [`SUPPORTED_SOFT_TOKENS`]).
    pub max_soft_tokens: usize,
}

impl Gemma4ImageProcessor {
    pub fn new(patch_size: usize, pooling_kernel_size: usize, max_soft_tokens: usize) -> Result<Self> {
        if !SUPPORTED_SOFT_TOKENS.contains(&max_soft_tokens) {
            return Err(ModelError::InvalidInput(format!("max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS:?}, got {max_soft_tokens}")));
        }
        if patch_size == 0 || pooling_kernel_size == 0 {
            return Err(ModelError::InvalidInput("patch_size and pooling_kernel_size must be positive".into()));
        }
        Ok(Gemma4ImageProcessor { patch_size, pooling_kernel_size, max_soft_tokens })
    }

    /// The processor of a checkpoint: `patch_size`, `pooling_kernel_size` and `max_soft_tokens`
    /// of the `image_processor` in `processor_config.json` (or of `preprocessor_config.json`),
    /// each defaulting to the tower's sizes and 280.
    pub fn for_checkpoint(dir: &std::path::Path, vision: &Gemma4VisionConfig) -> Result<Self> {
        for name in ["processor_config.json", "preprocessor_config.json"] {
            let p = dir.join(name);
            let Ok(text) = std::fs::read_to_string(&p) else { continue };
            let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::MalformedConfig { path: p.clone(), reason: e.to_string() })?;
            let ip = v.get("image_processor").unwrap_or(&v);
            let get = |k: &str, d: usize| ip.get(k).and_then(Value::as_u64).map_or(d, |x| x as usize);
            if ip.get("max_soft_tokens").is_some() || ip.get("patch_size").is_some() {
                return Self::new(get("patch_size", vision.patch_size), get("pooling_kernel_size", vision.pooling_kernel_size), get("max_soft_tokens", 280));
            }
        }
        Self::new(vision.patch_size, vision.pooling_kernel_size, 280)
    }

    /// Resized `(height, width)` of an image (`get_aspect_ratio_preserving_size`).
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        if height == 0 || width == 0 {
            return Err(ModelError::InvalidInput(format!("image of {width}x{height} pixels")));
        }
        let (p, k) = (self.patch_size, self.pooling_kernel_size);
        let max_patches = self.max_soft_tokens * k * k;
        let target_px = (max_patches * p * p) as f64;
        let factor = (target_px / (height * width) as f64).sqrt();
        let side = k * p;
        let mut th = ((factor * height as f64) / side as f64).floor() as usize * side;
        let mut tw = ((factor * width as f64) / side as f64).floor() as usize * side;
        if th == 0 && tw == 0 {
            return Err(ModelError::InvalidInput(format!("a {width}x{height} image resizes to 0x0 (sides must be multiples of {side})")));
        }
        let max_side = (max_patches / (k * k)) * side;
        if th == 0 {
            th = side;
            tw = ((width as f64 / height as f64).floor() as usize * side).min(max_side);
        } else if tw == 0 {
            tw = side;
            th = ((height as f64 / width as f64).floor() as usize * side).min(max_side);
        }
        if (th * tw) as f64 > target_px {
            return Err(ModelError::InvalidInput(format!("resizing {height}x{width} to {th}x{tw} exceeds {max_patches} patches of {p} pixels")));
        }
        Ok((th, tw))
    }

    /// Soft tokens the image of `height x width` pixels becomes.
    pub fn num_soft_tokens(&self, height: usize, width: usize) -> Result<usize> {
        let (th, tw) = self.target_size(height, width)?;
        let s = self.patch_size * self.pooling_kernel_size;
        Ok((th / s) * (tw / s))
    }

    /// Resize, rescale and patchify an 8-bit RGB image (`rgb`: `height * width * 3` bytes,
    /// row-major, interleaved channels).
    pub fn preprocess(&self, rgb: &[u8], width: usize, height: usize) -> Result<Gemma4Image> {
        if rgb.len() != width * height * 3 {
            return Err(ModelError::InvalidInput(format!("RGB buffer of {} bytes for a {width}x{height} image (want {})", rgb.len(), width * height * 3)));
        }
        let (th, tw) = self.target_size(height, width)?;
        let img = crate::media::RgbImage::new(width as u32, height as u32, rgb.to_vec())?;
        let img = crate::media::resize(&img, tw as u32, th as u32, crate::media::Filter::Bicubic)?.data;
        let p = self.patch_size;
        let (ph, pw) = (th / p, tw / p);
        let mut out = Vec::with_capacity(th * tw * 3);
        for py in 0..ph {
            for px in 0..pw {
                for r in 0..p {
                    let row = (py * p + r) * tw + px * p;
                    for v in &img[row * 3..(row + p) * 3] {
                        out.push((*v as f64 * (1.0 / 255.0)) as f32);
                    }
                }
            }
        }
        let k = self.pooling_kernel_size;
        Ok(Gemma4Image { patches: Array::from_slice(&out, &[ph * pw, 3 * p * p])?, grid: (ph, pw), num_soft_tokens: (ph / k) * (pw / k) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_size_follows_the_patch_budget() {
        let p = Gemma4ImageProcessor::new(16, 3, 70).unwrap();
        // 70 soft tokens * 9 patches of 16 px: a square image becomes 384 x 384 (8 x 8 cells of 48).
        assert_eq!(p.target_size(1000, 1000).unwrap(), (384, 384));
        assert_eq!(p.num_soft_tokens(1000, 1000).unwrap(), 64);
        // very wide: the short side is one cell, the long side capped
        assert_eq!(p.target_size(10, 5000).unwrap(), (48, 70 * 48));
        assert!(Gemma4ImageProcessor::new(16, 3, 100).is_err());
        assert!(p.target_size(0, 10).is_err());
    }
}
