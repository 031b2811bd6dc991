//! The `openai_privacy_filter` encoder (transformers' `OpenAIPrivacyFilterForTokenClassification`):
//! gpt-oss layers run bidirectionally over the whole sequence, then a linear score head.
//!
//! Per layer: `x += o(attn(rms(x)))`, `x += moe(rms(x))`; then a final RMSNorm and `score`.
//! - attention: q/k/v/o with biases, grouped-query heads, interleaved (MLX "traditional") rope with
//!   YaRN frequencies and attention factor, q and k each scaled by `head_dim^-1/4`, a banded mask
//!   (key `j` visible from query `i` iff `|i - j| <= sliding_window`), and one learned sink logit per
//!   head that joins the softmax and is dropped after it;
//! - MoE: router `[E, H]` with bias, softmax over the top-k logits divided by k; experts with biases,
//!   `gate_up_proj [E, H, 2I]` (gate columns first, then up), `down_proj [E, I, H]`; activation
//!   `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with `g = min(gate, 7)`; the weighted sum of the
//!   experts is multiplied by k.
//!
//! Everything runs in f32, as transformers runs the router and experts.
use super::PrivacyError;
use crate::layers::{Embedding, Linear, Rope, RopeScaling, RmsNorm};
use crate::config::{default_true, default_usize};
use crate::weights::{Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};
use serde::Deserialize;

/// gpt-oss's SwiGLU clamp limit and sigmoid scale.
const SWIGLU_LIMIT: f32 = 7.0;
const SWIGLU_ALPHA: f32 = 1.702;

/// The fields of config.json the encoder reads (transformers' `OpenAIPrivacyFilterConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct PrivacyFilterConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Per-expert intermediate size.
    pub intermediate_size: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub num_hidden_layers: usize,
    #[serde(alias = "num_experts")]
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    pub sliding_window: usize,
    #[serde(default = "default_usize::<131072>")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_true")]
    pub attention_bias: bool,
    #[serde(default = "default_true")]
    pub token_classification_bias: bool,
    /// transformers-5 style: `{"rope_type": "yarn", "rope_theta": ..., "factor": ...}`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// Older hub style, with `rope_theta` at the top level.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_theta: Option<f32>,
    /// Class index (as a string key) to label; transformers' 33 labels when absent.
    #[serde(default)]
    pub id2label: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub num_labels: Option<usize>,
}

/// 1e-5, the `rms_norm_eps` default of transformers' privacy-filter config.
fn default_eps() -> f32 {
    1e-5
}

/// transformers' default rope when config.json has none: YaRN, factor 32 over 4096 positions.
fn default_rope() -> (f32, RopeScaling) {
    let s = RopeScaling {
        rope_type: "yarn".into(),
        factor: Some(32.0),
        beta_fast: Some(32.0),
        beta_slow: Some(1.0),
        truncate: Some(false),
        original_max_position_embeddings: Some(4096),
        ..Default::default()
    };
    (150000.0, s)
}

/// The span labels of transformers' default `id2label` (`O`, then B/I/E/S of each).
pub const DEFAULT_SPAN_LABELS: [&str; 8] =
    ["account_number", "private_address", "private_date", "private_email", "private_person", "private_phone", "private_url", "secret"];

impl PrivacyFilterConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// `id2label` as `(id, label)` pairs; transformers' default 33 labels when absent.
    pub fn id2label_pairs(&self) -> std::result::Result<Vec<(usize, String)>, PrivacyError> {
        let Some(map) = &self.id2label else {
            let mut v = vec![(0, "O".to_string())];
            for name in DEFAULT_SPAN_LABELS {
                for p in ["B", "I", "E", "S"] {
                    v.push((v.len(), format!("{p}-{name}")));
                }
            }
            return Ok(v);
        };
        map.iter()
            .map(|(k, v)| {
                let id = k.parse::<usize>().map_err(|_| PrivacyError::Labels(format!("id2label key {k:?} is not a class index")))?;
                let label = v.as_str().ok_or_else(|| PrivacyError::Labels(format!("id2label[{k}] is {v}, not a string")))?;
                Ok((id, label.to_string()))
            })
            .collect()
    }

    /// The rope the config declares: base and scaling from `rope_parameters`, else `rope_scaling`
    /// and `rope_theta`, else transformers' default.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        let (def_theta, def_scaling) = default_rope();
        let (theta, scaling) = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) | (None, Some(p)) if !p.is_null() => {
                let theta = match p.get("rope_theta") {
                    Some(t) => t.as_f64().ok_or(format!("rope_theta {t} is not a number"))? as f32,
                    None => self.rope_theta.unwrap_or(def_theta),
                };
                let s: RopeScaling = serde_json::from_value(p.clone()).map_err(|e| format!("rope parameters {p}: {e}"))?;
                (theta, s)
            }
            _ => (self.rope_theta.unwrap_or(def_theta), def_scaling),
        };
        if !(theta > 0.0 && theta.is_finite()) {
            return Err(format!("rope_theta {theta} must be positive"));
        }
        let mut rope = Rope::scaled(self.head_dim(), theta, Some(&scaling), self.max_position_embeddings)?;
        rope.traditional = true; // transformers rotates interleaved pairs (x[2i], x[2i+1])
        Ok(rope)
    }

    /// Shape checks transformers' modules would fail on.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_local_experts", self.num_local_experts),
            ("head_dim", self.head_dim()),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return Err(format!("{k} must be positive"));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(format!("num_attention_heads {} is not a multiple of num_key_value_heads {}", self.num_attention_heads, self.num_key_value_heads));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_local_experts {
            return Err(format!("num_experts_per_tok {} must be in 1..={}", self.num_experts_per_tok, self.num_local_experts));
        }
        if self.head_dim() % 2 != 0 {
            return Err(format!("head_dim {} must be even for rotary embeddings", self.head_dim()));
        }
        if !(self.rms_norm_eps >= 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(format!("rms_norm_eps {} must be a non-negative number", self.rms_norm_eps));
        }
        Ok(())
    }
}

struct SinkAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// One logit per query head, `[1, H, 1, 1]`.
    sinks: Array,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

impl SinkAttention {
    fn load(vb: &Vb, c: &PrivacyFilterConfig) -> Result<Self> {
        let (h, d, nh, nkv) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.num_key_value_heads);
        let b = c.attention_bias;
        Ok(SinkAttention {
            q: Linear::load(&vb.pp("q_proj"), h, nh * d, b)?,
            k: Linear::load(&vb.pp("k_proj"), h, nkv * d, b)?,
            v: Linear::load(&vb.pp("v_proj"), h, nkv * d, b)?,
            o: Linear::load(&vb.pp("o_proj"), nh * d, h, b)?,
            sinks: vb.get("sinks", &[nh])?.astype(DType::F32)?.reshape(&[1, nh as i32, 1, 1])?,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
        })
    }

    /// `[1, T, n*d]` → `[1, n, T, d]`.
    fn heads(&self, x: &Array, n: usize) -> Result<Array> {
        let t = x.dims()[1];
        Ok(x.reshape(&[1, t, n as i32, self.head_dim as i32])?.transpose(&[0, 2, 1, 3])?)
    }

    /// `x: [1, T, H]`. Queries run in blocks of [`query_block`] rows, each against only the keys
    /// its band reaches, so memory grows with `T * (block + 2 * window)` rather than `T^2`.
    fn forward(&self, x: &Array, rope: &Rope, window: usize) -> Result<Array> {
        let t = x.dims()[1] as usize;
        let scale = (self.head_dim as f32).powf(-0.25);
        let q = rope.forward(&self.heads(&self.q.forward(x)?, self.n_heads)?, 0)?.mul_scalar(scale)?;
        let k = rope.forward(&self.heads(&self.k.forward(x)?, self.n_kv)?, 0)?.mul_scalar(scale)?;
        let v = self.heads(&self.v.forward(x)?, self.n_kv)?;
        let rep = self.n_heads / self.n_kv;
        let repeat = |a: Array| -> Result<Array> {
            if rep == 1 {
                return Ok(a);
            }
            let d = self.head_dim;
            Ok(a.expand_dims(2)?.broadcast_to(&[1, self.n_kv, rep, t, d])?.reshape(&[1, self.n_heads as i32, t as i32, d as i32])?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let block = query_block(window);
        let mut outs = Vec::with_capacity(t.div_ceil(block));
        for qs in (0..t).step_by(block) {
            let qe = qs.saturating_add(block).min(t);
            let (ks, ke) = (qs.saturating_sub(window), qe.saturating_add(window).min(t));
            let kc = k.slice_axis(2, ks, ke)?;
            let mut scores = q.slice_axis(2, qs, qe)?.matmul(&kc.swap_axes(2, 3)?)?; // [1, nh, qe-qs, ke-ks]
            if let Some(m) = band_mask(qs, qe, ks, ke, window)? {
                scores = ops::where_(&m, &scores, &Array::scalar(f32::NEG_INFINITY))?;
            }
            let sinks = self.sinks.broadcast_to(&[1, self.n_heads, qe - qs, 1])?;
            let probs = ops::concatenate(&[&scores, &sinks], 3)?.softmax(3, true)?.slice_axis(3, 0, ke - ks)?;
            outs.push(probs.matmul(&v.slice_axis(2, ks, ke)?)?);
        }
        let refs: Vec<&Array> = outs.iter().collect();
        let out = ops::concatenate(&refs, 2)?.transpose(&[0, 2, 1, 3])?.reshape(&[1, t as i32, (self.n_heads * self.head_dim) as i32])?;
        self.o.forward(&out)
    }
}

/// Query rows per attention block: at least 64, and at least twice the window.
pub fn query_block(window: usize) -> usize {
    window.saturating_mul(2).max(64)
}

/// Visibility of keys `ks..ke` from queries `qs..qe` (`|i - j| <= window`) as a boolean
/// `[qe-qs, ke-ks]`; `None` when every key is visible.
fn band_mask(qs: usize, qe: usize, ks: usize, ke: usize, window: usize) -> Result<Option<Array>> {
    // the farthest pairs are (qs, ke-1) and (qe-1, ks)
    if (ke - 1).abs_diff(qs) <= window && (qe - 1).abs_diff(ks) <= window {
        return Ok(None);
    }
    let rows = Array::arange(qs as i64, qe as i64, DType::I32)?.reshape(&[(qe - qs) as i32, 1])?;
    let cols = Array::arange(ks as i64, ke as i64, DType::I32)?.reshape(&[1, (ke - ks) as i32])?;
    let w = i32::try_from(window).unwrap_or(i32::MAX);
    Ok(Some(rows.sub(&cols)?.abs()?.le(&Array::scalar(w))?))
}

struct ClampedMoe {
    router: Linear,
    /// `[E, H, 2I]`, used as `x @ w`.
    gate_up: Array,
    gate_up_bias: Array,
    /// `[E, I, H]`.
    down: Array,
    down_bias: Array,
    inter: usize,
    top_k: usize,
}

impl ClampedMoe {
    fn load(vb: &Vb, c: &PrivacyFilterConfig) -> Result<Self> {
        let (e, h, i) = (c.num_local_experts, c.hidden_size, c.intermediate_size);
        let ex = vb.pp("experts");
        Ok(ClampedMoe {
            router: Linear::load(&vb.pp("router"), h, e, true)?,
            gate_up: ex.get("gate_up_proj", &[e, h, 2 * i])?,
            gate_up_bias: ex.get("gate_up_proj_bias", &[e, 2 * i])?,
            down: ex.get("down_proj", &[e, i, h])?,
            down_bias: ex.get("down_proj_bias", &[e, h])?,
            inter: i,
            top_k: c.num_experts_per_tok,
        })
    }

    /// `x: [T, H]` → `[T, H]`.
    fn forward(&self, x: &Array) -> Result<Array> {
        let (t, h) = (x.dims()[0], x.dims()[1]);
        let k = self.top_k as i32;
        let logits = self.router.forward(x)?; // [T, E]
        let idx = logits.topk_indices(self.top_k, -1)?; // [T, k]
        let w = logits.take_along_axis(&idx, -1)?.softmax(-1, true)?.mul_scalar(1.0 / self.top_k as f32)?;
        let gu = ops::gather_mm(&x.reshape(&[t, 1, 1, h])?, &self.gate_up, None, Some(&idx), false)?;
        let gu = gu.reshape(&[t, k, 2 * self.inter as i32])?.add(&self.gate_up_bias.take(&idx, 0)?)?;
        let parts = gu.split_at(&[self.inter], -1)?;
        let gate = parts[0].minimum(&Array::scalar(SWIGLU_LIMIT))?;
        let up = parts[1].clip(-SWIGLU_LIMIT, SWIGLU_LIMIT)?;
        let glu = gate.mul(&gate.mul_scalar(SWIGLU_ALPHA)?.sigmoid()?)?;
        let act = up.add_scalar(1.0)?.mul(&glu)?;
        let y = ops::gather_mm(&act.reshape(&[t, k, 1, self.inter as i32])?, &self.down, None, Some(&idx), false)?;
        let y = y.reshape(&[t, k, h])?.add(&self.down_bias.take(&idx, 0)?)?;
        Ok(y.mul(&w.expand_dims(-1)?)?.sum(&[1], false)?.mul_scalar(self.top_k as f32)?)
    }
}

struct EncoderLayer {
    input_norm: RmsNorm,
    attn: SinkAttention,
    post_norm: RmsNorm,
    moe: ClampedMoe,
}

/// The token classifier: embeddings, encoder layers, final norm, score head.
pub struct PrivacyEncoder {
    embed: Embedding,
    layers: Vec<EncoderLayer>,
    norm: RmsNorm,
    score: Linear,
    rope: Rope,
    sliding_window: usize,
    vocab: usize,
    num_labels: usize,
}

impl PrivacyEncoder {
    /// Build from `weights` (transformers' names: `model.*`, `score.*`), every tensor in f32.
    /// Tensors no module reads are an error.
    pub fn load(weights: &Weights, c: &PrivacyFilterConfig, num_labels: usize) -> Result<Self> {
        let bad = |reason: String| ModelError::MalformedConfig { path: weights.path().join("config.json"), reason };
        c.validate().map_err(bad)?;
        let rope = c.rope().map_err(bad)?;
        let root = weights.root();
        let m = root.pp("model");
        let eps = c.rms_norm_eps;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let l = m.pp("layers").pp(i);
                Ok(EncoderLayer {
                    input_norm: RmsNorm::load(&l.pp("input_layernorm"), c.hidden_size, eps, 0.0)?,
                    attn: SinkAttention::load(&l.pp("self_attn"), c)?,
                    post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), c.hidden_size, eps, 0.0)?,
                    moe: ClampedMoe::load(&l.pp("mlp"), c)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let enc = PrivacyEncoder {
            embed: Embedding::load(&m.pp("embed_tokens"), c.vocab_size, c.hidden_size)?,
            layers,
            norm: RmsNorm::load(&m.pp("norm"), c.hidden_size, eps, 0.0)?,
            score: Linear::load(&root.pp("score"), c.hidden_size, num_labels, c.token_classification_bias)?,
            rope,
            sliding_window: c.sliding_window,
            vocab: c.vocab_size,
            num_labels,
        };
        weights.check_all_used()?;
        Ok(enc)
    }

    pub fn num_labels(&self) -> usize {
        self.num_labels
    }

    /// Logits `[1, T, num_labels]` (f32) of one sequence of token ids.
    pub fn forward(&self, ids: &[u32]) -> Result<Array> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("privacy filter: no tokens to classify".into()));
        }
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(ModelError::InvalidInput(format!("token id {bad} is outside the vocabulary of {}", self.vocab)));
        }
        let t = ids.len();
        let mut x = self.embed.forward(&Array::from_slice(ids, &[1, t])?)?.astype(DType::F32)?;
        for l in &self.layers {
            x = x.add(&l.attn.forward(&l.input_norm.forward(&x)?, &self.rope, self.sliding_window)?)?;
            let h = l.post_norm.forward(&x)?.reshape(&[t as i32, -1])?;
            x = x.add(&l.moe.forward(&h)?.reshape(&[1, t as i32, -1])?)?;
        }
        self.score.forward(&self.norm.forward(&x)?)
    }
}
