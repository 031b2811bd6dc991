//! [`BlockDrafter`]: block drafts that read the target's residual stream, DSpark
//! (`Gemma4DSparkModel`, DeepSpec) and DFlash (`DFlashDraftModel`, z-lab/dflash).
//!
//! Both networks take the target's residual stream after the layers `target_layer_ids` (one
//! row per verified position), fuse it (`hidden_norm(fc(concat))`) into a context that each
//! draft layer projects to keys and values once per position, and run one forward over a block
//! `[anchor, mask x (n - 1)]` placed right after the context, attending over context and block
//! without a causal mask. The anchor is the newest token, which the target has not seen.
//!
//! * **DFlash**: Qwen3-style layers (pre-norm, q/k norms, `v_proj`), the target's own input
//!   embedding (times `input_embedding_scale`) and output head (times `output_multiplier`, then
//!   the config's soft-cap); the mask positions' outputs are the drafts, each the token at its
//!   own position, so `k` drafts take a block of `k + 1` (`block_size` 16: 15 drafts).
//! * **DSpark**: Gemma 4 global-attention layers (sandwich norms, layer scalar, K = V with a
//!   scale-free V norm, proportional RoPE, attention scale 1), its own embedding (times
//!   `sqrt(hidden_size)`) and soft-capped head; every block row drafts the token after it, so `k`
//!   drafts take a block of `k` (`block_size` 7: 7 drafts). Draft `i`'s logits get the Markov
//!   bias `markov_w2 · markov_w1[prev]` of the token before it (the anchor, then the drafts),
//!   and the confidence head `sigmoid(proj([hidden, markov_w1[prev]]))` gives each draft a
//!   keep-probability; with a threshold set ([`BlockDrafter::set_confidence_threshold`]) a
//!   block is cut before its first draft below it.
//!
//! The drafter follows the history from cycle to cycle: the verify step's taps of the accepted
//! positions extend the context; a history it did not follow (the prompt, a new turn) is
//! tapped by running the target over it once more.
use crate::drafter::{Draft, Drafter, Drawer, Feedback, SeededKey};
use crate::load::DraftKind;
use crate::tracked::{forward_tapped, row};
use mlx_array::{ops::concatenate, Array, AttentionMask, DType};
use mlx_models::layers::{Activation, Embedding, GatedMlp, Linear, RmsNorm, Rope, RopeScaling};
use mlx_models::weights::{Init, Vb, Weights};
use mlx_models::{Cache, Logits, Model, ModelError, Result};
use sampling::SamplingConfig;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A block draft's settings, read from its config.json.
#[derive(Debug, Clone)]
pub struct BlockConfig {
    /// [`DraftKind::DSpark`] or [`DraftKind::DFlash`].
    pub kind: DraftKind,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    /// Positions of a full block (DSpark: drafts; DFlash: the anchor and the drafts).
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Target layers whose residual stream is the context (strictly ascending).
    pub target_layer_ids: Vec<usize>,
    pub num_target_layers: Option<usize>,
    pub final_logit_softcapping: Option<f32>,
    /// DFlash: the target embedding's multiplier and the head's.
    pub input_embedding_scale: f32,
    pub output_multiplier: f32,
    /// DSpark: rank of the Markov bias (0: none) and whether a confidence head is present.
    pub markov_rank: usize,
    pub confidence_head: bool,
    activation: Activation,
    rope: RopeKind,
    max_position_embeddings: usize,
}

#[derive(Debug, Clone)]
enum RopeKind {
    /// `rope_theta` with an optional `rope_scaling` / `rope_parameters` (DFlash).
    Scaled(f32, Option<RopeScaling>),
    /// Gemma 4's proportional rope: the first `partial * head_dim` features rotate (DSpark).
    Proportional { theta: f32, partial: f32 },
}

fn bad(dir: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::MalformedConfig {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// `k` of a draft config: DFlash reads its `dflash_config` first, then the top level.
fn field<'a>(raw: &'a Value, sub: &'a Value, dflash: bool, k: &str) -> Option<&'a Value> {
    if dflash {
        sub.get(k).or_else(|| raw.get(k))
    } else {
        raw.get(k)
    }
}

fn read_config(dir: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|_| ModelError::ConfigNotFound(dir.to_path_buf()))?;
    serde_json::from_str(&text).map_err(|e| bad(dir, e.to_string()))
}

impl BlockConfig {
    /// DSpark's block (drafts per cycle) when the config gives none.
    pub const DSPARK_BLOCK: usize = 7;
    /// DFlash's block (anchor and drafts) when the config gives none.
    pub const DFLASH_BLOCK: usize = 16;

    /// The settings of the draft checkpoint in `dir` (refused when it is neither kind, or uses
    /// a variant this crate does not run: sliding-window or causal DFlash layers, DFlash2's
    /// convolutions and candidate selector, a non-vanilla Markov head, separate DSpark values).
    pub fn load(dir: &Path) -> Result<Self> {
        let raw = read_config(dir)?;
        let kind = crate::load::kind_of(&raw);
        // DFlash keeps its own settings in `dflash_config`, falling back to the top level.
        let sub = raw.get("dflash_config").cloned().unwrap_or(Value::Null);
        let get = |k: &str| field(&raw, &sub, kind == DraftKind::DFlash, k);
        let uint = |k: &str| get(k).and_then(Value::as_u64).map(|v| v as usize);
        let float = |k: &str| get(k).and_then(Value::as_f64).map(|v| v as f32);
        let need = |k: &str| uint(k).ok_or_else(|| bad(dir, format!("{k} is missing")));
        let ids: Vec<usize> = get("target_layer_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(dir, "target_layer_ids is missing"))?
            .iter()
            .map(|v| v.as_u64().map(|v| v as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(dir, "target_layer_ids must be non-negative integers"))?;
        if ids.is_empty() || ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad(
                dir,
                format!("target_layer_ids {ids:?} must be non-empty and strictly ascending"),
            ));
        }
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let (kind_ok, kv, head_dim, block, activation, rope) = match kind {
            DraftKind::DSpark => {
                if raw.get("attention_k_eq_v").and_then(Value::as_bool) != Some(true) {
                    return Err(ModelError::UnsupportedOption(format!(
                        "{}: DSpark drafts with separate values (attention_k_eq_v false) are not supported",
                        dir.display()
                    )));
                }
                if let Some(t) = raw.get("markov_head_type").and_then(Value::as_str) {
                    if t != "vanilla" {
                        return Err(ModelError::UnsupportedOption(format!(
                            "{}: markov_head_type {t:?} is not supported (vanilla is)",
                            dir.display()
                        )));
                    }
                }
                let r = raw.pointer("/rope_parameters/full_attention");
                let rf = |k: &str| {
                    r.and_then(|r| r.get(k))
                        .and_then(Value::as_f64)
                        .map(|v| v as f32)
                };
                let rtype = r
                    .and_then(|r| r.get("rope_type"))
                    .and_then(Value::as_str)
                    .unwrap_or("proportional");
                let partial = match rtype {
                    "proportional" => rf("partial_rotary_factor").unwrap_or(0.25),
                    "default" => 1.0,
                    t => {
                        return Err(bad(
                            dir,
                            format!("rope_type {t:?} (proportional and default are supported)"),
                        ))
                    }
                };
                let act = raw
                    .get("hidden_activation")
                    .and_then(Value::as_str)
                    .unwrap_or("gelu_pytorch_tanh");
                (
                    true,
                    need("num_global_key_value_heads")?,
                    need("global_head_dim")?,
                    uint("block_size").unwrap_or(Self::DSPARK_BLOCK),
                    Activation::parse(act)
                        .ok_or_else(|| bad(dir, format!("unknown hidden_activation {act:?}")))?,
                    RopeKind::Proportional {
                        theta: rf("rope_theta").unwrap_or(1_000_000.0),
                        partial,
                    },
                )
            }
            DraftKind::DFlash => {
                let archs = raw
                    .get("architectures")
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                if archs.contains("DFlash2")
                    || uint("conv_kernel_size").unwrap_or(0) > 0
                    || uint("selector_rank").unwrap_or(0) > 0
                {
                    return Err(ModelError::UnsupportedOption(format!(
                        "{}: DFlash2 drafts (grouped convolutions, candidate selector) are not supported",
                        dir.display()
                    )));
                }
                let types = raw.get("layer_types").and_then(Value::as_array);
                if types.is_some_and(|t| t.iter().any(|t| t.as_str() != Some("full_attention"))) {
                    return Err(ModelError::UnsupportedOption(format!(
                        "{}: DFlash drafts with sliding-window layers are not supported",
                        dir.display()
                    )));
                }
                if raw.get("is_causal").and_then(Value::as_bool) == Some(true) {
                    return Err(ModelError::UnsupportedOption(format!(
                        "{}: causal DFlash blocks (is_causal) are not supported",
                        dir.display()
                    )));
                }
                let rp = raw
                    .get("rope_parameters")
                    .or_else(|| raw.get("rope_scaling"));
                let theta = raw
                    .get("rope_theta")
                    .or_else(|| rp.and_then(|r| r.get("rope_theta")))
                    .and_then(Value::as_f64)
                    .unwrap_or(10_000.0) as f32;
                let scaling = rp
                    .filter(|r| !r.is_null())
                    .map(|r| serde_json::from_value::<RopeScaling>(r.clone()))
                    .transpose()
                    .map_err(|e| bad(dir, format!("rope parameters: {e}")))?;
                let act = raw
                    .get("hidden_act")
                    .and_then(Value::as_str)
                    .unwrap_or("silu");
                (
                    true,
                    need("num_key_value_heads")?,
                    uint("head_dim").unwrap_or(hidden / heads.max(1)),
                    uint("block_size").unwrap_or(Self::DFLASH_BLOCK),
                    Activation::parse(act)
                        .ok_or_else(|| bad(dir, format!("unknown hidden_act {act:?}")))?,
                    RopeKind::Scaled(theta, scaling),
                )
            }
            _ => (
                false,
                0,
                0,
                0,
                Activation::Silu,
                RopeKind::Scaled(0.0, None),
            ),
        };
        if !kind_ok {
            return Err(ModelError::UnsupportedOption(format!(
                "{}: not a DSpark or DFlash draft",
                dir.display()
            )));
        }
        let min_block = if kind == DraftKind::DFlash { 2 } else { 1 };
        let c = BlockConfig {
            kind,
            hidden_size: hidden,
            intermediate_size: need("intermediate_size")?,
            num_hidden_layers: need("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            vocab_size: need("vocab_size")?,
            rms_norm_eps: float("rms_norm_eps").unwrap_or(1e-6),
            block_size: block,
            mask_token_id: need("mask_token_id")? as u32,
            target_layer_ids: ids,
            num_target_layers: uint("num_target_layers"),
            final_logit_softcapping: float("final_logit_softcapping").filter(|c| *c > 0.0),
            input_embedding_scale: float("input_embedding_scale").unwrap_or(1.0),
            output_multiplier: float("output_multiplier").unwrap_or(1.0),
            markov_rank: if kind == DraftKind::DSpark {
                uint("markov_rank").unwrap_or(0)
            } else {
                0
            },
            confidence_head: kind == DraftKind::DSpark
                && raw
                    .get("enable_confidence_head")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            activation,
            rope,
            max_position_embeddings: uint("max_position_embeddings").unwrap_or(1 << 20),
        };
        if c.num_hidden_layers == 0
            || c.vocab_size == 0
            || c.intermediate_size == 0
            || c.hidden_size == 0
        {
            return Err(bad(
                dir,
                "hidden_size, intermediate_size, num_hidden_layers and vocab_size must be positive",
            ));
        }
        if kv == 0 || heads % kv != 0 || head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(dir, format!("{heads} heads over {kv} key/value heads of dim {head_dim} (must divide, even dim)")));
        }
        if c.block_size < min_block {
            return Err(bad(
                dir,
                format!("block_size {} is below {min_block}", c.block_size),
            ));
        }
        if c.mask_token_id as usize >= c.vocab_size {
            return Err(bad(
                dir,
                format!(
                    "mask_token_id {} is outside the vocabulary of {}",
                    c.mask_token_id, c.vocab_size
                ),
            ));
        }
        Ok(c)
    }

    /// Drafts per cycle by default: the checkpoint's block.
    pub fn default_depth(&self) -> usize {
        match self.kind {
            DraftKind::DFlash => self.block_size - 1,
            _ => self.block_size,
        }
    }

    fn rope(&self) -> Result<Rope> {
        let d = self.head_dim;
        match &self.rope {
            RopeKind::Scaled(theta, s) => {
                Rope::scaled(d, *theta, s.as_ref(), self.max_position_embeddings)
                    .map_err(ModelError::InvalidInput)
            }
            RopeKind::Proportional { theta, partial } => {
                // the first `rot / 2` pairs rotate with wavelengths θ^(2j / d), the rest not at all
                let rot = (d as f32 * partial) as usize;
                let mut f: Vec<f32> = (0..rot / 2)
                    .map(|j| theta.powf((2 * j) as f32 / d as f32))
                    .collect();
                f.resize(d / 2, f32::INFINITY);
                let mut rope = Rope::new(d, *theta);
                rope.freqs = Some(Array::from_slice(&f, &[d / 2])?);
                Ok(rope)
            }
        }
    }
}

/// A dense projection `prefix.weight` (`[out, in]`), drawn `N(0, 1 / in)` in a random checkpoint.
fn linear(vb: &Vb, name: &str, input: usize, output: usize, bias: bool) -> Result<Linear> {
    let v = vb.pp(name);
    let w = v.get_init(
        "weight",
        &[output, input],
        Init::normal(0.0, (input as f32).powf(-0.5)),
    )?;
    let b = if bias {
        Some(v.get_init("bias", &[output], Init::normal(0.0, 0.1))?)
    } else {
        None
    };
    Linear::new(w, b)
}

fn norm(vb: &Vb, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
    RmsNorm::load(&vb.pp(name), dim, eps, 0.0)
}

struct Layer {
    input_norm: RmsNorm,
    q: Linear,
    k: Linear,
    /// DFlash's values; DSpark's are its keys' raw projection, RMS-normed without a scale.
    v: Option<Linear>,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    /// DFlash: the norm before the MLP; DSpark: after attention.
    post_attn_norm: RmsNorm,
    /// DSpark's norms around the MLP, and its layer scalar.
    ffn_norms: Option<(RmsNorm, RmsNorm)>,
    scalar: Option<Array>,
    mlp: GatedMlp,
}

/// The DSpark or DFlash network of a [`BlockDrafter`].
pub struct BlockNet {
    cfg: BlockConfig,
    /// DSpark's own embedding and head (DFlash uses its target's).
    embed: Option<Embedding>,
    head: Option<Linear>,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
    /// DSpark: `markov_w1` `[V, r]`, `markov_w2` `[V, r]`.
    markov: Option<(Array, Array)>,
    confidence: Option<Linear>,
}

impl BlockNet {
    /// Load the draft in `dir` (floats converted to `float_dtype` when given); every tensor of
    /// the checkpoint must be used.
    pub fn load(dir: &Path, float_dtype: Option<DType>) -> Result<Self> {
        let cfg = BlockConfig::load(dir)?;
        let weights = Weights::load(dir, float_dtype)?;
        let net = Self::build(cfg, &weights)?;
        weights.check_all_used()?;
        Ok(net)
    }

    /// The tensors a checkpoint with the config.json in `dir` holds, by name and shape, in the
    /// order the loader reads them.
    pub fn expected_tensors(dir: &Path) -> Result<Vec<mlx_models::weights::ExpectedTensor>> {
        let cfg = BlockConfig::load(dir)?;
        let weights = Weights::expecting(dir);
        Self::build(cfg, &weights)?;
        Ok(weights.expected())
    }

    fn build(cfg: BlockConfig, weights: &Weights) -> Result<Self> {
        let vb = weights.root();
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let (nh, nkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let spark = cfg.kind == DraftKind::DSpark;
        let embed = if spark {
            Some(Embedding::from_weight(vb.pp("embed_tokens").get_init(
                "weight",
                &[cfg.vocab_size, h],
                Init::normal(0.0, (h as f32).powf(-0.5)),
            )?))
        } else {
            None
        };
        let head = if spark {
            Some(linear(&vb, "lm_head", h, cfg.vocab_size, false)?)
        } else {
            None
        };
        let norm_ = norm(&vb, "norm", h, eps)?;
        let fc = linear(&vb, "fc", cfg.target_layer_ids.len() * h, h, false)?;
        let hidden_norm = norm(&vb, "hidden_norm", h, eps)?;
        let (markov, confidence) = if spark && cfg.markov_rank > 0 {
            let m = vb.pp("markov_head");
            let r = cfg.markov_rank;
            let w1 = m.pp("markov_w1").get_init(
                "weight",
                &[cfg.vocab_size, r],
                Init::normal(0.0, 1.0),
            )?;
            let w2 = m.pp("markov_w2").get_init(
                "weight",
                &[cfg.vocab_size, r],
                Init::normal(0.0, (r as f32).powf(-0.5)),
            )?;
            let conf = if cfg.confidence_head {
                Some(linear(&vb.pp("confidence_head"), "proj", h + r, 1, true)?)
            } else {
                None
            };
            (Some((w1, w2)), conf)
        } else if spark && cfg.confidence_head {
            return Err(ModelError::UnsupportedOption(
                "a DSpark confidence head needs the Markov head (markov_rank > 0)".into(),
            ));
        } else {
            (None, None)
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let lv = vb.pp("layers").pp(i);
                let a = lv.pp("self_attn");
                Ok(Layer {
                    input_norm: norm(&lv, "input_layernorm", h, eps)?,
                    q: linear(&a, "q_proj", h, nh * d, false)?,
                    k: linear(&a, "k_proj", h, nkv * d, false)?,
                    v: if spark {
                        None
                    } else {
                        Some(linear(&a, "v_proj", h, nkv * d, false)?)
                    },
                    o: linear(&a, "o_proj", nh * d, h, false)?,
                    q_norm: norm(&a, "q_norm", d, eps)?,
                    k_norm: norm(&a, "k_norm", d, eps)?,
                    v_norm: RmsNorm::unit(eps),
                    post_attn_norm: norm(&lv, "post_attention_layernorm", h, eps)?,
                    ffn_norms: if spark {
                        Some((
                            norm(&lv, "pre_feedforward_layernorm", h, eps)?,
                            norm(&lv, "post_feedforward_layernorm", h, eps)?,
                        ))
                    } else {
                        None
                    },
                    scalar: if spark {
                        Some(lv.get_init("layer_scalar", &[1], Init::normal(1.0, 0.1))?)
                    } else {
                        None
                    },
                    mlp: GatedMlp::load(&lv.pp("mlp"), h, cfg.intermediate_size, cfg.activation)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BlockNet {
            rope: cfg.rope()?,
            embed,
            head,
            fc,
            hidden_norm,
            layers,
            norm: norm_,
            markov,
            confidence,
            cfg,
        })
    }

    pub fn config(&self) -> &BlockConfig {
        &self.cfg
    }

    /// The fused context of the target's tapped residual streams (`[1, T, H]` each, in
    /// `target_layer_ids` order): `hidden_norm(fc(concat))`.
    pub fn fuse(&self, taps: &[Array]) -> Result<Array> {
        let refs: Vec<&Array> = taps.iter().collect();
        self.hidden_norm
            .forward(&self.fc.forward(&concatenate(&refs, -1)?)?)
    }

    /// Per layer, the keys (normed, roped at `pos..`) and values of `x` (`[1, T, H]`):
    /// `[1, kv_heads, T, D]` each.
    fn project_kv(&self, layer: &Layer, x: &Array, pos: usize) -> Result<(Array, Array)> {
        let (nkv, d) = (
            self.cfg.num_key_value_heads as i32,
            self.cfg.head_dim as i32,
        );
        let t = x.dim(1)? as i32;
        let raw = layer.k.forward(x)?.reshape(&[1, t, nkv, d])?;
        let k = self
            .rope
            .forward(&layer.k_norm.forward(&raw)?.transpose(&[0, 2, 1, 3])?, pos)?;
        let v = match &layer.v {
            Some(v) => v.forward(x)?.reshape(&[1, t, nkv, d])?,
            None => layer.v_norm.forward(&raw)?,
        };
        Ok((k, v.transpose(&[0, 2, 1, 3])?))
    }

    /// Context keys and values of the fused rows `ctx` (`[1, T, H]`) at positions `pos..`, one
    /// pair per layer.
    pub fn context_kv(&self, ctx: &Array, pos: usize) -> Result<Vec<(Array, Array)>> {
        self.layers
            .iter()
            .map(|l| self.project_kv(l, ctx, pos))
            .collect()
    }

    /// The final-normed hidden states of a block whose embeddings are `x` (`[1, L, H]`), at
    /// positions `pos..`, over the context keys and values `ctx` (one pair per layer; none: no
    /// context).
    pub fn block(&self, x: &Array, pos: usize, ctx: &[(Array, Array)]) -> Result<Array> {
        let (nh, d) = (
            self.cfg.num_attention_heads as i32,
            self.cfg.head_dim as i32,
        );
        let l = x.dim(1)? as i32;
        let spark = self.cfg.kind == DraftKind::DSpark;
        let scale = if spark { 1.0 } else { (d as f32).powf(-0.5) };
        let mut x = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let n = layer.input_norm.forward(&x)?;
            let q = layer.q.forward(&n)?.reshape(&[1, l, nh, d])?;
            let q = self
                .rope
                .forward(&layer.q_norm.forward(&q)?.transpose(&[0, 2, 1, 3])?, pos)?;
            let (bk, bv) = self.project_kv(layer, &n, pos)?;
            let (k, v) = match ctx.get(i) {
                Some((ck, cv)) => (concatenate(&[ck, &bk], 2)?, concatenate(&[cv, &bv], 2)?),
                None => (bk, bv),
            };
            let a = q.sdpa(&k, &v, scale, AttentionMask::None)?;
            let a = layer
                .o
                .forward(&a.transpose(&[0, 2, 1, 3])?.reshape(&[1, l, nh * d])?)?;
            x = match (&layer.ffn_norms, &layer.scalar) {
                (Some((pre, post)), Some(s)) => {
                    let h = x.add(&layer.post_attn_norm.forward(&a)?)?;
                    h.add(&post.forward(&layer.mlp.forward(&pre.forward(&h)?)?)?)?
                        .mul(s)?
                }
                _ => {
                    let h = x.add(&a)?;
                    h.add(&layer.mlp.forward(&layer.post_attn_norm.forward(&h)?)?)?
                }
            };
        }
        self.norm.forward(&x)
    }

    /// The Markov bias of the tokens `prev` (`[n]` ids): `[n, V]`, or `None` without a Markov head.
    pub fn markov_bias(&self, prev: &Array) -> Result<Option<Array>> {
        let Some((w1, w2)) = &self.markov else {
            return Ok(None);
        };
        Ok(Some(
            w1.take(prev, 0)?
                .matmul(&w2.transpose(&[1, 0])?)?
                .astype(DType::F32)?,
        ))
    }

    /// DSpark's keep-probabilities of block rows `hidden` (`[1, n, H]`) after the tokens `prev`
    /// (`[n]`): `[n]` f32, or `None` without a confidence head.
    pub fn keep_probs(&self, hidden: &Array, prev: &Array) -> Result<Option<Array>> {
        let (Some(proj), Some((w1, _))) = (&self.confidence, &self.markov) else {
            return Ok(None);
        };
        let e = w1.take(prev, 0)?.astype(hidden.dtype())?.expand_dims(0)?;
        let p = proj.forward(&concatenate(&[hidden, &e], -1)?)?.sigmoid()?;
        Ok(Some(p.reshape(&[-1])?.astype(DType::F32)?))
    }
}

/// One cycle's drafts with the network's own numbers (for checks against a reference).
pub struct BlockTrace {
    pub tokens: Vec<u32>,
    /// `[k, V]` f32 logits each draft was drawn from (DSpark's with the Markov bias).
    pub logits: Array,
    /// DSpark's keep-probabilities of the drafts (`[k]`), when the draft has a confidence head.
    pub keep: Option<Array>,
}

/// Drafts a block per cycle with a [`BlockNet`] over `target`'s residual stream.
pub struct BlockDrafter {
    key: SeededKey,
    /// Positions run through the target to catch up with a history (see
    /// [`Drafter::target_positions_run`]).
    run: usize,
    target: Model,
    net: BlockNet,
    /// The context keys and values, one pair per draft layer (`[1, kv_heads, T, D]`).
    ctx: Vec<(Array, Array)>,
    /// The history the drafter follows: positions `0..ctx_len` are in `ctx`, the tapped rows of
    /// the next ones in `pending` (one array per tap layer).
    known: Vec<u32>,
    ctx_len: usize,
    pending: Vec<Array>,
    threshold: f32,
}

impl BlockDrafter {
    /// A drafter over `target`, which must match the draft: its hidden size and vocabulary,
    /// enough layers for the taps (`num_target_layers` when the config gives it), and for DFlash
    /// a target whose embedding and head the draft can share.
    pub fn new(target: Model, net: BlockNet) -> Result<Self> {
        let c = net.config();
        let info = target.info();
        let name = c.kind.as_str();
        if c.hidden_size != info.hidden_size {
            return Err(ModelError::UnsupportedOption(format!(
                "the {name} draft was built for a target of hidden size {}; {} has {}",
                c.hidden_size,
                target.dir().display(),
                info.hidden_size
            )));
        }
        if c.vocab_size != info.vocab_size {
            return Err(ModelError::UnsupportedOption(format!(
                "the {name} draft's vocabulary ({}) is not the target's ({})",
                c.vocab_size, info.vocab_size
            )));
        }
        if c.num_target_layers.is_some_and(|n| n != info.num_layers) {
            return Err(ModelError::UnsupportedOption(format!(
                "the {name} draft taps a {}-layer target; {} has {} layers",
                c.num_target_layers.unwrap_or(0),
                target.dir().display(),
                info.num_layers
            )));
        }
        if c.target_layer_ids
            .last()
            .is_some_and(|&l| l + 1 >= info.num_layers)
        {
            return Err(ModelError::UnsupportedOption(format!(
                "the {name} draft taps layers {:?}; a {}-layer target has taps below its last layer only",
                c.target_layer_ids, info.num_layers
            )));
        }
        // the target must run with taps (and share its embedding and head with DFlash)
        let probe = Array::from_slice(&[0u32], &[1, 1])?;
        let mut cache = Cache::new(&target.with_runtime(|rt| rt.cache_spec()));
        let (out, _) = target.with_runtime(|rt| {
            rt.forward_taps(&probe, &mut cache, Logits::None, true, &c.target_layer_ids)
        })?;
        if c.kind == DraftKind::DFlash {
            target.with_runtime(|rt| rt.input_embeddings(&probe))?;
            if let Some(h) = &out.hidden {
                target.with_runtime(|rt| rt.head_logits(h))?;
            }
        }
        Ok(BlockDrafter {
            ctx: Vec::new(),
            known: Vec::new(),
            ctx_len: 0,
            pending: Vec::new(),
            threshold: 0.0,
            run: 0,
            key: SeededKey::new(7),
            target,
            net,
        })
    }

    pub fn net(&self) -> &BlockNet {
        &self.net
    }

    /// DSpark: cut each block before its first draft whose keep-probability is below
    /// `threshold` (0, the default: keep every draft). Refused without a confidence head.
    pub fn set_confidence_threshold(&mut self, threshold: f32) -> Result<()> {
        if threshold > 0.0 && self.net.confidence.is_none() {
            return Err(ModelError::UnsupportedOption(
                "this draft has no confidence head: no confidence threshold applies".into(),
            ));
        }
        if !(0.0..=1.0).contains(&threshold) {
            return Err(ModelError::InvalidInput(format!(
                "confidence threshold {threshold} is outside [0, 1]"
            )));
        }
        self.threshold = threshold;
        Ok(())
    }

    /// Bring the context to positions `0..n - 1` of `history` (its last token is the anchor).
    fn follow(&mut self, history: &[u32]) -> Result<()> {
        let n = history.len();
        if self.known != history {
            self.ctx = Vec::new();
            self.ctx_len = 0;
            self.pending = Vec::new();
            self.known = history.to_vec();
            if n > 1 {
                let mut c = Cache::new(&self.target.with_runtime(|rt| rt.cache_spec()));
                let (_, taps) = forward_tapped(
                    &self.target,
                    &mut c,
                    &row(&history[..n - 1])?,
                    Logits::None,
                    false,
                    &self.net.cfg.target_layer_ids,
                )?;
                self.pending = taps;
                self.run += n - 1;
            }
        }
        if !self.pending.is_empty() {
            let fused = self.net.fuse(&self.pending)?;
            let m = fused.dim(1)?;
            let new = self.net.context_kv(&fused, self.ctx_len)?;
            self.ctx = if self.ctx.is_empty() {
                new
            } else {
                self.ctx
                    .iter()
                    .zip(new)
                    .map(|((k, v), (nk, nv))| {
                        Ok((concatenate(&[k, &nk], 2)?, concatenate(&[v, &nv], 2)?))
                    })
                    .collect::<Result<_>>()?
            };
            self.ctx_len += m;
            self.pending = Vec::new();
        }
        if self.ctx_len + 1 != n {
            return Err(ModelError::Cache(format!(
                "{} drafter out of step: {} context positions for a history of {n}",
                self.net.cfg.kind.as_str(),
                self.ctx_len
            )));
        }
        Ok(())
    }

    /// Up to `k` drafts after `history`, drawn with `cfg`; with `trace`, also the logits and
    /// keep-probabilities.
    fn draft(
        &mut self,
        history: &[u32],
        k: usize,
        cfg: &SamplingConfig,
        trace: bool,
    ) -> Result<(Draft, Option<BlockTrace>)> {
        let n = history.len();
        if k == 0 || n == 0 {
            return Ok((Draft::empty(), None));
        }
        let vocab = self.net.cfg.vocab_size;
        if let Some(&t) = history.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "token {t} is outside the draft's vocabulary of {vocab}"
            )));
        }
        self.follow(history)?;
        let spark = self.net.cfg.kind == DraftKind::DSpark;
        let anchor = history[n - 1];
        // DSpark: k rows, each drafting the token after it; DFlash: k mask rows after the anchor
        let len = if spark { k } else { k + 1 };
        let mut ids = vec![self.net.cfg.mask_token_id; len];
        ids[0] = anchor;
        let ids = row(&ids)?;
        let x = match &self.net.embed {
            Some(e) => e
                .forward(&ids)?
                .mul_scalar((self.net.cfg.hidden_size as f32).sqrt())?,
            None => self
                .target
                .with_runtime(|rt| rt.input_embeddings(&ids))?
                .mul_scalar(self.net.cfg.input_embedding_scale)?,
        };
        let hidden = self.net.block(&x, n - 1, &self.ctx)?;
        let rows = if spark {
            hidden.clone()
        } else {
            hidden.slice_axis(1, 1, len)?
        };
        let logits = match &self.net.head {
            Some(h) => h.forward(&rows)?.astype(DType::F32)?,
            None => self
                .target
                .with_runtime(|rt| rt.head_logits(&rows))?
                .mul_scalar(self.net.cfg.output_multiplier)?,
        };
        let logits = match self.net.cfg.final_logit_softcapping {
            Some(c) => logits.softcap(c)?,
            None => logits,
        };
        let mut drawer = Drawer::new(cfg, history, k)?;
        let mut raws = Vec::with_capacity(k);
        let mut prev = Array::from_slice(&[anchor], &[1])?;
        let mut prevs = Vec::with_capacity(k);
        for i in 0..k {
            let mut l = logits.slice_axis(1, i, i + 1)?.reshape(&[1, -1])?;
            if let Some(b) = self.net.markov_bias(&prev)? {
                l = l.add(&b)?;
            }
            let t = drawer.draw(&l, &mut self.key)?;
            prevs.push(std::mem::replace(&mut prev, t.reshape(&[1])?));
            if trace {
                raws.push(l);
            }
        }
        let cat = |v: &[Array]| concatenate(&v.iter().collect::<Vec<_>>(), 0);
        let keep = if self.threshold > 0.0 || trace {
            self.net.keep_probs(&rows, &cat(&prevs)?)?
        } else {
            None
        };
        let mut draft = drawer.finish(&keep.iter().collect::<Vec<_>>())?;
        if self.threshold > 0.0 {
            if let Some(p) = &keep {
                let cut = p
                    .to_vec::<f32>()?
                    .iter()
                    .take_while(|&&p| p >= self.threshold)
                    .count();
                draft.tokens.truncate(cut);
                draft.logprobs = draft
                    .logprobs
                    .map(|l| l.slice_axis(0, 0, cut))
                    .transpose()?;
            }
        }
        let trace = if trace {
            Some(BlockTrace {
                tokens: draft.tokens.clone(),
                logits: cat(&raws)?,
                keep,
            })
        } else {
            None
        };
        Ok((draft, trace))
    }

    /// Greedy drafts after `history` with the logits and keep-probabilities behind them (`k`
    /// drafts; empty for `k == 0`).
    pub fn trace(&mut self, history: &[u32], k: usize) -> Result<Option<BlockTrace>> {
        Ok(self.draft(history, k, &SamplingConfig::greedy(), true)?.1)
    }
}

impl Drafter for BlockDrafter {
    fn propose(&mut self, history: &[u32], k: usize, cfg: &SamplingConfig) -> Result<Draft> {
        Ok(self.draft(history, k, cfg, false)?.0)
    }

    fn feedback(&mut self, f: &Feedback<'_>) -> Result<()> {
        if self.known != f.history || f.taps.len() != self.net.cfg.target_layer_ids.len() {
            // a step the drafter did not follow: start over at the next proposal
            self.known = Vec::new();
            return Ok(());
        }
        // the taps at `last` and the accepted drafts join the context (after rows not used yet)
        let mut rows = Vec::with_capacity(f.taps.len());
        for (i, t) in f.taps.iter().enumerate() {
            let new = t.slice_axis(1, 0, f.accepted + 1)?;
            rows.push(match self.pending.get(i) {
                Some(p) => concatenate(&[p, &new], 1)?,
                None => new,
            });
        }
        self.pending = rows;
        self.known = f.next_history();
        Ok(())
    }

    fn target_taps(&self) -> &[usize] {
        &self.net.cfg.target_layer_ids
    }

    fn target_positions_run(&self) -> usize {
        self.run
    }

    fn vocab_size(&self) -> usize {
        self.net.cfg.vocab_size
    }

    fn default_depth(&self) -> usize {
        self.net.cfg.default_depth()
    }

    fn max_depth(&self) -> Option<usize> {
        Some(self.net.cfg.default_depth())
    }
}

/// Write a random checkpoint (`model.safetensors` in `dtype`) for the DSpark or DFlash
/// config.json in `dir`, drawing each tensor the loader reads as its layout says
/// ([`BlockNet::expected_tensors`]). The file is written atomically.
pub fn create_random_block_draft(dir: &Path, seed: u64, dtype: DType) -> Result<PathBuf> {
    let tensors = BlockNet::expected_tensors(dir)?;
    let keys = mlx_array::random::Key::new(seed)?.split_n(tensors.len())?;
    let mut arrays = Vec::with_capacity(tensors.len());
    for (t, key) in tensors.iter().zip(&keys) {
        arrays.push(
            mlx_array::random::normal_with(&t.shape, t.init.mean, t.init.std, DType::F32, key)?
                .astype(dtype)?,
        );
    }
    let refs: Vec<(&str, &Array)> = tensors
        .iter()
        .map(|t| t.name.as_str())
        .zip(&arrays)
        .collect();
    let path = dir.join("model.safetensors");
    mlx_array::io::save_safetensors(&path, &refs, None)?;
    Ok(path)
}
