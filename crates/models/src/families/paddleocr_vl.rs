//! PaddleOCR-VL (`paddleocr_vl`, `PaddleOCRVLForConditionalGeneration`): a SigLIP/NaViT-style
//! vision encoder, its projector and an ERNIE-4.5 language model with M-RoPE (mirrors
//! transformers' `modeling_paddleocr_vl.py` and `PaddleOCRVLImageProcessorPil`).
//!
//! - **Processor**: PaddleOCR-VL's smart resize (a side shorter than `patch_size * merge_size` is
//!   first widened to it, the other scaled by the same ratio and rounded half-to-even; then
//!   Qwen's: both sides multiples of the factor, the pixel count within
//!   `size.shortest_edge..=size.longest_edge`, default 384² to 1536²), Pillow bicubic
//!   ([`crate::media::resize`]), scaled to [0, 1], normalized with `image_mean`/`image_std` (CLIP's
//!   by default) and cut into `C * P * P` patches in raster order (`temporal_patch_size` 1).
//!   Settings come from `preprocessor_config.json`.
//! - **Encoder** (`visual.vision_model.*` on the hub, `model.visual.vision_model.*` as
//!   transformers saves it): the patch embedding (a Conv2d with stride = kernel, run as one
//!   product) plus the learned square position table resampled bilinearly (align corners) to
//!   the patch grid; `num_hidden_layers` blocks of LayerNorm, bidirectional attention (q/k/v/out
//!   projections with biases, 2-D rotary positions: row then column frequencies of
//!   `head_dim / 4`, f32), LayerNorm, GELU-tanh MLP; then `post_layernorm`. One image per call.
//! - **Projector** (`mlp_AR.*` on the hub, `model.projector.*`): LayerNorm (eps 1e-5), each 2x2
//!   block of patches concatenated, Linear, GELU (erf), Linear into the decoder's width.
//! - **Language model** (`model.*` on the hub, `model.language_model.*`): Llama-style ERNIE-4.5
//!   blocks (RMSNorm, GQA attention and a SiLU gated MLP, biases when `use_bias`), head tied to
//!   the embedding unless `tie_word_embeddings` is false.
//! - **Merging and M-RoPE**: each image placeholder the chat template writes becomes one token
//!   per merged patch, placed as Qwen2-VL places them (`super::qwen3_5_vl::merge_mrope`); the
//!   rotary frequencies are split into `mrope_section` (sums to `head_dim / 2`) consecutive
//!   chunks, chunk `i` reading axis `i % 3` (temporal, height, width). Text after the images sits
//!   at cache position plus [`Cache::position_delta`].
//!
//! Videos are not supported. A prompt piece with images is prefilled in one call.
use super::qwen3_5_vl::{self, axial_rotary, interpolated_positions, LayerNorm, Mrope, ProcessorConfig, VisionBlock};
use crate::cache::{Cache, CacheSpec, LayerKind};
use crate::config::DecoderConfig;
use crate::layers::decoder::{ExpertBlock, FeedForward, HybridBlock, HybridStack, Mixer, RecurrentMixer};
use crate::layers::{Activation, Attention, AttentionConfig, Embedding, GatedMlp, Linear, LmHead, RmsNorm, Rope};
use crate::media::{MediaEmbeddings, MediaItem, MediaKind, MediaModel, PreparedMedia, RgbImage};
use crate::registry::{Built, LoadContext, Preset};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
use crate::weights::{Init, Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::{Array, DType};
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::Path;

/// `vision_config` of a PaddleOCR-VL checkpoint ([`VisionConfig::from_config`]).
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_channels: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub hidden_act: String,
    pub layer_norm_eps: f32,
    pub spatial_merge_size: usize,
    pub rope_parameters: Option<Value>,
}

/// `given`'s keys (null ones left out) over the object `defaults`.
fn over_defaults(mut defaults: Value, given: Option<&Value>) -> Value {
    if let (Some(d), Some(Value::Object(g))) = (defaults.as_object_mut(), given) {
        d.extend(g.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())));
    }
    defaults
}

impl VisionConfig {
    /// The `vision_config` of the whole `config.json` over transformers' `PaddleOCRVisionConfig`
    /// defaults (SigLIP-so400m's shape, 14-pixel patches, a 27x27 position table).
    pub fn from_config(config: &Value) -> std::result::Result<Self, String> {
        let defaults = json!({
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
            "num_channels": 3, "image_size": 384, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6, "spatial_merge_size": 2
        });
        serde_json::from_value(over_defaults(defaults, config.get("vision_config"))).map_err(|e| format!("vision_config: {e}"))
    }

    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }
    /// Side of the square position table.
    fn side(&self) -> usize {
        self.image_size / self.patch_size.max(1)
    }
    fn rope_theta(&self) -> f32 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32
    }
    fn validate(&self) -> std::result::Result<Activation, String> {
        if self.num_attention_heads == 0 || self.hidden_size % self.num_attention_heads != 0 || self.head_dim() % 4 != 0 {
            return Err(format!(
                "vision hidden_size {} must split into num_attention_heads {} heads of a multiple of 4",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.patch_size == 0 || self.spatial_merge_size == 0 || self.num_channels == 0 || self.side() < 2 {
            return Err(format!(
                "vision patch_size {}, spatial_merge_size {} and num_channels {} must be positive, image_size {} at least two patches",
                self.patch_size, self.spatial_merge_size, self.num_channels, self.image_size
            ));
        }
        if let Some(t) = self.rope_parameters.as_ref().and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
            if t != "axial" {
                return Err(format!("vision rope_type {t:?}: only axial rope is supported"));
            }
        }
        Activation::parse(&self.hidden_act).ok_or_else(|| format!("unknown vision hidden_act {:?}", self.hidden_act))
    }
}

/// The decoder settings of a PaddleOCR-VL checkpoint (ERNIE-4.5), read from
/// [`crate::config::text_config`] over transformers' `PaddleOCRTextConfig` defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct TextConfig {
    #[serde(flatten)]
    pub decoder: DecoderConfig,
    pub intermediate_size: usize,
    pub num_key_value_heads: usize,
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    pub use_bias: bool,
}

crate::config::impl_deref!(TextConfig => decoder: DecoderConfig);

/// transformers' `PaddleOCRTextConfig` defaults (0.9B's decoder).
fn text_defaults() -> Value {
    json!({
        "vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_bias": false,
        "tie_word_embeddings": true
    })
}

/// `mrope_section` of `rope_parameters` or the hub's `rope_scaling` ([16, 24, 24] when absent).
fn mrope_section(text: &Value) -> std::result::Result<Vec<usize>, String> {
    let given = ["rope_parameters", "rope_scaling"]
        .iter()
        .find_map(|k| text.get(*k).and_then(|r| r.get("mrope_section")));
    match given {
        None | Some(Value::Null) => Ok(vec![16, 24, 24]),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some()) => {
            Ok(a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
        }
        Some(other) => Err(format!("mrope_section must be a list of integers, got {other}")),
    }
}

/// The axis each of the `head_dim / 2` rotary frequencies reads: consecutive chunks of
/// `section`, chunk `i` reading axis `i % 3`.
fn frequency_axes(section: &[usize], half: usize) -> std::result::Result<Vec<u8>, String> {
    if section.iter().sum::<usize>() != half {
        return Err(format!("mrope_section {section:?} must sum to head_dim / 2 = {half}"));
    }
    Ok(section.iter().enumerate().flat_map(|(i, &n)| std::iter::repeat_n((i % 3) as u8, n)).collect())
}

/// The decoder has attention layers and dense MLPs only: no recurrent mixer or expert block
/// ever exists.
#[derive(Clone)]
pub(crate) enum Never {}

impl crate::layers::LayerArrays for Never {
    fn visit_arrays(&mut self, _f: &mut dyn FnMut(&mut Array)) {
        match *self {}
    }
}

impl RecurrentMixer for Never {
    const SLOTS: usize = 0;
    fn forward_slots(&self, _x: &Array, _slots: &mut [Option<Array>], _i: usize, _valid: Option<&Array>) -> Result<Array> {
        match *self {}
    }
}

impl ExpertBlock for Never {
    fn forward_experts(&self, _x: &Array) -> Result<Array> {
        match *self {}
    }
}

/// The vision encoder and projector.
pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Linear,
    pos_embed: Array,
    blocks: Vec<VisionBlock>,
    post_norm: LayerNorm,
    act: Activation,
    /// Rotary inverse frequencies (`head_dim / 4` of them).
    inv_freq: Vec<f32>,
    pre_norm: LayerNorm,
    linear_1: Linear,
    linear_2: Linear,
}

impl VisionTower {
    /// `vb`: the encoder (`visual.vision_model`), `proj`: the projector (`mlp_AR`), into a decoder
    /// of width `out`.
    pub fn load(vb: &Vb, proj: &Vb, cfg: VisionConfig, out: usize) -> Result<Self> {
        let act = cfg.validate().map_err(|reason| ModelError::MalformedConfig {
            path: vb.weights().path().to_path_buf(),
            reason,
        })?;
        let (d, p, c) = (cfg.hidden_size, cfg.patch_size, cfg.num_channels);
        let e = vb.pp("embeddings");
        let pe = e.pp("patch_embedding");
        // The Conv2d's [D, C, P, P] as a [D, C * P * P] product over flattened patches.
        let w = pe.get("weight", &[d, c, p, p])?;
        let patch_embed = Linear::new(
            w.reshape(&[d as i32, (c * p * p) as i32])?,
            Some(pe.get_init("bias", &[d], Init::normal(0.0, 0.02))?),
        )?;
        let side = cfg.side();
        let pos_embed = e.pp("position_embedding").get("weight", &[side * side, d])?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let b = vb.pp("encoder").pp("layers").pp(i);
                let a = b.pp("self_attn");
                let part = |n: &str, name: &str, shape: &[usize]| a.pp(n).get_init(name, shape, Init::normal(0.0, 0.02));
                let (mut ws, mut bs) = (Vec::with_capacity(3), Vec::with_capacity(3));
                for n in ["q_proj", "k_proj", "v_proj"] {
                    ws.push(part(n, "weight", &[d, d])?);
                    bs.push(part(n, "bias", &[d])?);
                }
                let qkv = Linear::new(
                    mlx_array::ops::concatenate(&[&ws[0], &ws[1], &ws[2]], 0)?,
                    Some(mlx_array::ops::concatenate(&[&bs[0], &bs[1], &bs[2]], 0)?),
                )?;
                Ok(VisionBlock {
                    norm1: LayerNorm::load_eps(&b.pp("layer_norm1"), d, cfg.layer_norm_eps)?,
                    norm2: LayerNorm::load_eps(&b.pp("layer_norm2"), d, cfg.layer_norm_eps)?,
                    qkv,
                    proj: Linear::load(&a.pp("out_proj"), d, d, true)?,
                    fc1: Linear::load(&b.pp("mlp").pp("fc1"), d, cfg.intermediate_size, true)?,
                    fc2: Linear::load(&b.pp("mlp").pp("fc2"), cfg.intermediate_size, d, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = d * cfg.spatial_merge_size * cfg.spatial_merge_size;
        Ok(VisionTower {
            inv_freq: qwen3_5_vl::axial_inv_freq(cfg.head_dim(), cfg.rope_theta()),
            post_norm: LayerNorm::load_eps(&vb.pp("post_layernorm"), d, cfg.layer_norm_eps)?,
            pre_norm: LayerNorm::load_eps(&proj.pp("pre_norm"), d, 1e-5)?,
            linear_1: Linear::load(&proj.pp("linear_1"), merged, merged, true)?,
            linear_2: Linear::load(&proj.pp("linear_2"), merged, out, true)?,
            patch_embed,
            pos_embed,
            blocks,
            act,
            cfg,
        })
    }

    /// The encoder's output for one image (after `post_layernorm`): `pixels`
    /// `[grid_h * grid_w, C * P * P]` in raster order to `[grid_h * grid_w, hidden_size]`.
    pub fn encode(&self, pixels: &Array, gh: usize, gw: usize) -> Result<Array> {
        let m = self.cfg.spatial_merge_size;
        if gh % m != 0 || gw % m != 0 || pixels.dim(0)? != gh * gw {
            return Err(ModelError::InvalidInput(format!(
                "{} patches for a {gh}x{gw} grid (multiples of {m})",
                pixels.dim(0)?
            )));
        }
        let coords: Vec<(usize, usize)> = (0..gh * gw).map(|i| (i / gw, i % gw)).collect();
        let mut x = self.patch_embed.forward(&pixels.astype(self.pos_embed.dtype())?)?;
        x = x.add(&interpolated_positions(&self.pos_embed, self.cfg.side(), &coords, gh, gw)?.astype(x.dtype())?)?;
        let (cos, sin) = axial_rotary(&self.inv_freq, &coords)?;
        let x = qwen3_5_vl::encode(&self.blocks, x, &cos, &sin, self.cfg.num_attention_heads, self.cfg.head_dim(), self.act)?;
        self.post_norm.forward(&x)
    }

    /// The projector over [`VisionTower::encode`]'s output: `[grid_h * grid_w / merge², out]`,
    /// one row per merge block in raster order of the blocks.
    pub fn project(&self, x: &Array, gh: usize, gw: usize) -> Result<Array> {
        let (m, d) = (self.cfg.spatial_merge_size as i32, self.cfg.hidden_size as i32);
        let (hb, wb) = (gh as i32 / m, gw as i32 / m);
        let y = self
            .pre_norm
            .forward(x)?
            .reshape(&[hb, m, wb, m, d])?
            .transpose(&[0, 2, 1, 3, 4])?
            .reshape(&[hb * wb, m * m * d])?;
        self.linear_2.forward(&self.linear_1.forward(&y)?.gelu()?)
    }

    /// The merged embeddings of one image ([`VisionTower::encode`], then
    /// [`VisionTower::project`]).
    pub fn forward(&self, pixels: &Array, gh: usize, gw: usize) -> Result<Array> {
        self.project(&self.encode(pixels, gh, gw)?, gh, gw)
    }
}

/// The image processor: [`ProcessorConfig`]'s settings with PaddleOCR-VL's resize and patch order.
#[derive(Debug, Clone, PartialEq)]
pub struct Processor(pub ProcessorConfig);

impl Processor {
    /// From `preprocessor_config.json` in `dir` over transformers' defaults (384² to 1536²
    /// pixels, CLIP mean and std, the vision config's patch and merge sizes).
    pub fn from_dir(dir: &Path, v: &VisionConfig) -> Result<Self> {
        let defaults = ProcessorConfig {
            min_pixels: 384 * 384,
            max_pixels: 1536 * 1536,
            patch_size: v.patch_size,
            merge_size: v.spatial_merge_size,
            temporal_patch_size: 1,
            image_mean: qwen3_5_vl::CLIP_MEAN,
            image_std: qwen3_5_vl::CLIP_STD,
        };
        let p = ProcessorConfig::read(dir, defaults)?;
        if p.patch_size != v.patch_size || p.merge_size != v.spatial_merge_size || p.temporal_patch_size != 1 {
            return Err(ModelError::MalformedConfig {
                path: dir.join("preprocessor_config.json"),
                reason: format!(
                    "patch_size {} / merge_size {} / temporal_patch_size {} must be the vision config's {} / {} / 1",
                    p.patch_size, p.merge_size, p.temporal_patch_size, v.patch_size, v.spatial_merge_size
                ),
            });
        }
        Ok(Processor(p))
    }

    /// PaddleOCR-VL's smart resize of a `height` x `width` image.
    pub fn smart_resize(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let factor = self.0.patch_size * self.0.merge_size;
        let (mut h, mut w) = (height, width);
        if h == 0 || w == 0 {
            return Err(ModelError::InvalidInput(format!("empty image {width}x{height}")));
        }
        if h < factor {
            w = ((w * factor) as f64 / h as f64).round_ties_even() as usize;
            h = factor;
        }
        if w < factor {
            h = ((h * factor) as f64 / w as f64).round_ties_even() as usize;
            w = factor;
        }
        self.0.smart_resize(h, w)
    }

    /// `pixel_values` (`[grid_h * grid_w, C * P * P]`, patches in raster order) and the patch
    /// grid of one image, as the Hugging Face processor makes them.
    pub fn preprocess(&self, img: &RgbImage) -> Result<(Vec<f32>, usize, usize)> {
        let (h, w) = self.smart_resize(img.height as usize, img.width as usize)?;
        let (blocked, gh, gw) = self.0.patches(img, h, w)?;
        let m = self.0.merge_size;
        let row = blocked.len() / (gh * gw);
        let mut out = Vec::with_capacity(blocked.len());
        for r in 0..gh {
            for c in 0..gw {
                let b = ((r / m) * (gw / m) + c / m) * m * m + (r % m) * m + c % m;
                out.extend_from_slice(&blocked[b * row..(b + 1) * row]);
            }
        }
        Ok((out, gh, gw))
    }
}

/// A PaddleOCR-VL model.
pub struct PaddleOcrVlModel {
    stack: HybridStack<Never, Never>,
    tower: VisionTower,
    processor: Processor,
    /// The image placeholder and the decoder's M-RoPE frequencies; prepared images are
    /// [`super::qwen3_5_vl::QwenImage`]s with their patches in raster order.
    mrope: Mrope,
    kv_heads: usize,
    head_dim: usize,
    info: ModelInfo,
}

/// Whether the checkpoint's head is tied to its embedding (transformers' default: tied).
fn tied(text: &Value) -> bool {
    text.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true)
}

impl PaddleOcrVlModel {
    pub fn new(c: &LoadContext) -> Result<Self> {
        let vision = VisionConfig::from_config(c.config).map_err(|r| c.bad_config(r))?;
        let text = over_defaults(text_defaults(), Some(&c.text));
        let cfg: TextConfig = crate::config::parse(c.dir, &text)?;
        cfg.decoder.validate(cfg.num_key_value_heads).map_err(|r| c.bad_config(r))?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let freq_axis = mrope_section(&text).and_then(|s| frequency_axes(&s, hd / 2)).map_err(|r| c.bad_config(r))?;
        let inv_freq = (0..hd / 2).map(|j| 1.0 / cfg.rope_theta.powf((2 * j) as f32 / hd as f32)).collect();
        let image_token = c.config.get("image_token_id").and_then(Value::as_u64).unwrap_or(100295) as u32;
        if image_token as usize >= cfg.vocab_size {
            return Err(c.bad_config(format!("image_token_id {image_token} is outside the vocabulary of {}", cfg.vocab_size)));
        }
        let processor = Processor::from_dir(c.dir, &vision)?;
        let stack = load_decoder(c.weights, &cfg, tied(&text))?;
        let root = c.weights.root();
        // transformers' layout nests all three under `model.`; the hub's (and a random
        // checkpoint's) has the decoder at `model.`, the encoder at `visual.`, the projector at
        // `mlp_AR.`.
        let (enc, proj) = if c.weights.decoder_prefix() == "model.language_model" {
            ("model.visual.vision_model", "model.projector")
        } else {
            ("visual.vision_model", "mlp_AR")
        };
        let tower = VisionTower::load(&root.pp(enc), &root.pp(proj), vision, h)?;
        // Compute the tower's weights on the loading thread (one merge block of zero pixels), as
        // Model::materialize does for the language model.
        let (m, row) = (
            tower.cfg.spatial_merge_size,
            tower.cfg.num_channels * tower.cfg.patch_size * tower.cfg.patch_size,
        );
        tower.forward(&Array::zeros(&[m * m, row], DType::F32)?, m, m)?.eval()?;
        let kv_heads = crate::layers::parallel::per_rank(&root, "KV heads", cfg.num_key_value_heads)?;
        let info = ModelInfo::decoder(
            c.family.model_type,
            cfg.vocab_size,
            h,
            cfg.num_hidden_layers,
            cfg.max_position_embeddings,
            c.eos.clone(),
            cfg.bos_token_id,
        );
        let mrope = Mrope {
            image_token,
            merge: processor.0.merge_size,
            inv_freq,
            freq_axis,
        };
        Ok(PaddleOcrVlModel {
            stack,
            tower,
            processor,
            mrope,
            kv_heads,
            head_dim: hd,
            info,
        })
    }

    /// The image processor.
    pub fn processor(&self) -> &Processor {
        &self.processor
    }
    /// The vision encoder and projector.
    pub fn tower(&self) -> &VisionTower {
        &self.tower
    }
}

/// The ERNIE-4.5 decoder under the checkpoint's decoder prefix, and its head.
fn load_decoder(weights: &Weights, cfg: &TextConfig, tied: bool) -> Result<HybridStack<Never, Never>> {
    let root = weights.root();
    let prefix = weights.decoder_prefix();
    let vb = root.pp(prefix);
    let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim(), cfg.rms_norm_eps);
    let act = cfg.activation().map_err(|reason| ModelError::MalformedConfig {
        path: weights.path().to_path_buf(),
        reason,
    })?;
    let acfg = AttentionConfig {
        bias: cfg.use_bias,
        o_bias: cfg.use_bias,
        ..AttentionConfig::new(h, cfg.num_attention_heads, cfg.num_key_value_heads, hd)
    };
    let rope = Rope::new(hd, cfg.rope_theta);
    let layers = (0..cfg.num_hidden_layers)
        .map(|i| {
            let lv = vb.pp("layers").pp(i);
            Ok(HybridBlock {
                mixer_norm: RmsNorm::load(&lv.pp("input_layernorm"), h, eps, 0.0)?,
                mixer: Mixer::Attention(Attention::load(&lv.pp("self_attn"), acfg.clone(), rope.clone(), ["q_norm", "k_norm"])?),
                ffn_norm: RmsNorm::load(&lv.pp("post_attention_layernorm"), h, eps, 0.0)?,
                ffn: FeedForward::Dense(GatedMlp::load_biased(
                    &lv.pp("mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                    h,
                    cfg.intermediate_size,
                    act,
                    cfg.use_bias,
                )?),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let embed = Embedding::load(&vb.pp("embed_tokens"), cfg.vocab_size, h)?;
    let lm_head = LmHead::load(&root, prefix, &embed, tied, h, cfg.vocab_size)?;
    let norm = RmsNorm::load(&vb.pp("norm"), h, eps, 0.0)?;
    Ok(HybridStack { embed, layers, norm, lm_head })
}

impl ModelRuntime for PaddleOcrVlModel {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        self.stack.cache_spec(
            LayerKind::Attention {
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
            },
            0,
        )
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        self.stack.forward_at(tokens, cache, logits, hidden, &qwen3_5_vl::text_rope(cache))
    }
    fn media(&self) -> Option<&dyn MediaModel> {
        Some(self)
    }
}

qwen3_5_vl::mrope_media_model!(PaddleOcrVlModel, stack);

/// The registry's sanitize hook: the hub's unused tensors (`packing_position_embedding`, the
/// SigLIP pooling head `vision_model.head`), precomputed rotary tables, and `lm_head` when the
/// head is tied (transformers' default).
pub(crate) fn sanitize(w: &mut Weights, config: &Value) {
    let tied = tied(&crate::config::text_config(config));
    w.set_aside(|n| {
        n.ends_with(".rotary_emb.inv_freq") || n.contains("packing_position_embedding") || n.contains("vision_model.head.") || (tied && n == "lm_head.weight")
    });
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(PaddleOcrVlModel::new(c)?)))
}

/// The fixture's shape in the hub's flat layout: a 2-layer decoder of 64 and a 2-layer encoder
/// of 32 (8-pixel patches, an 8x8 position table).
fn tiny() -> Value {
    json!({
        "model_type": "paddleocr_vl", "architectures": ["PaddleOCRVLForConditionalGeneration"],
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "use_bias": false, "bos_token_id": 487, "eos_token_id": 488, "rope_theta": 500000.0,
        "rope_scaling": {"type": "default", "mrope_section": [2, 3, 3]}, "tie_word_embeddings": true,
        "image_token_id": 498, "video_token_id": 499, "vision_start_token_id": 495, "vision_end_token_id": 496,
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_channels": 3, "image_size": 64, "patch_size": 8, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
            "spatial_merge_size": 2}
    })
}

/// `tiny` (tests).
pub(crate) const PRESETS: &[Preset] = &[("tiny", tiny)];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mrope_sections_map_frequencies_to_axes_in_chunks() {
        assert_eq!(frequency_axes(&[2, 3, 3], 8).unwrap(), vec![0, 0, 1, 1, 1, 2, 2, 2]);
        assert!(frequency_axes(&[16, 24, 24], 8).unwrap_err().contains("sum to head_dim / 2 = 8"));
        let hub = json!({"rope_scaling": {"type": "default", "mrope_section": [1, 2, 1]}});
        assert_eq!(mrope_section(&hub).unwrap(), vec![1, 2, 1]);
        assert_eq!(mrope_section(&json!({})).unwrap(), vec![16, 24, 24]);
        assert!(mrope_section(&json!({"rope_parameters": {"mrope_section": "x"}})).is_err());
    }

    #[test]
    fn smart_resize_widens_a_thin_side_first() {
        let v = VisionConfig::from_config(&json!({"vision_config": {"patch_size": 8}})).unwrap();
        assert_eq!((v.hidden_size, v.image_size, v.patch_size), (1152, 384, 8));
        let p = Processor(ProcessorConfig {
            min_pixels: 1024,
            max_pixels: 6400,
            patch_size: 8,
            merge_size: 2,
            temporal_patch_size: 1,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        });
        // 12 wide < 16: width 16, height round(70 * 16 / 12) = 93, then multiples of 16.
        assert_eq!(p.smart_resize(70, 12).unwrap(), (96, 16));
        assert_eq!(p.smart_resize(61, 100).unwrap(), (64, 96));
        assert!(p.smart_resize(0, 5).is_err());
        assert!(Processor::from_dir(Path::new("/nonexistent"), &v).is_ok());
    }
}
