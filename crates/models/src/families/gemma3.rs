//! Gemma 3 causal LM: `gemma3_text` (Gemma3ForCausalLM) and the language model of `gemma3`
//! (Gemma3ForConditionalGeneration; the vision tower is not loaded). Mirrors mlx-lm
//! `models/gemma3_text.py` and HF `models/gemma3/modeling_gemma3.py`.
//!
//! What differs from a plain decoder:
//! - RMSNorm is `x * (1 + w)`, also on the per-head q/k norms; four norms per block (around
//!   attention and around the MLP).
//! - Embeddings are scaled by `sqrt(hidden)` (rounded to bf16 as the checkpoints were trained).
//! - Attention scale is `query_pre_attn_scalar^-0.5`.
//! - `layer_types`: sliding layers attend over the last `sliding_window` positions (rotating
//!   cache) with rope θ `rope_local_base_freq`; full layers use `rope_theta` and `rope_scaling`.
//! - Optional `final_logit_softcapping`.
use crate::cache::{Cache, CacheSpec, ForwardKv, LayerKind};
use crate::config::{default_f32, default_rms_norm_eps, default_true, default_usize};
use crate::layers::decoder::{DecoderLayer, Masks, Stack};
use crate::layers::{Activation, Attention, AttentionConfig, Embedding, GatedMlp, LmHead, RmsNorm, Rope, RopeScaling};
use crate::runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime, Rows};
use crate::weights::{Vb, Weights};
use crate::{ModelError, Result};
use mlx_array::Array;
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// The `config.json` keys Gemma 3 and Gemma 4 read alike, with their shared defaults; flattened
/// into [`Gemma3Config`] and `Gemma4Config` (`cfg.hidden_size` etc. read through it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GemmaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default = "default_usize::<1>")]
    pub num_key_value_heads: usize,
    #[serde(default = "default_usize::<256>")]
    pub head_dim: usize,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f32,
    /// transformers 5: `{"full_attention": {...}, "sliding_attention": {...}}`.
    pub rope_parameters: Option<Value>,
    pub layer_types: Option<Vec<String>>,
    pub final_logit_softcapping: Option<f32>,
    #[serde(default = "d_act")]
    pub hidden_activation: String,
    #[serde(default = "default_usize::<131_072>")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<Value>,
}

fn d_act() -> String {
    "gelu_pytorch_tanh".into()
}

impl GemmaConfig {
    /// `layer_types`, or when absent every `pattern`-th layer full and the others sliding (as
    /// transformers derives them); `last_full`: the last layer is full too.
    pub fn layer_types_or_pattern(&self, pattern: usize, last_full: bool) -> Vec<String> {
        if let Some(t) = &self.layer_types {
            return t.clone();
        }
        let p = pattern.max(1);
        let n = self.num_hidden_layers;
        (0..n).map(|i| if (i + 1) % p == 0 || (last_full && i + 1 == n) { "full_attention" } else { "sliding_attention" }.to_string()).collect()
    }

    /// Checks that `types` has one entry per layer, each `sliding_attention` or `full_attention`.
    pub fn check_layer_types(&self, types: &[String]) -> std::result::Result<(), String> {
        let n = self.num_hidden_layers;
        if types.len() != n {
            return Err(format!("layer_types has {} entries for {n} layers", types.len()));
        }
        if let Some(t) = types.iter().find(|t| *t != "sliding_attention" && *t != "full_attention") {
            return Err(format!("unsupported layer type {t:?} (expected sliding_attention or full_attention)"));
        }
        Ok(())
    }

    /// The MLP activation `hidden_activation` names.
    pub fn activation(&self) -> std::result::Result<Activation, String> {
        Activation::parse(&self.hidden_activation).ok_or_else(|| format!("unsupported hidden_activation {:?}", self.hidden_activation))
    }
}

/// The decoder settings of a Gemma 3 checkpoint (`config.json`, or its `text_config`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gemma3Config {
    #[serde(flatten)]
    pub base: GemmaConfig,
    #[serde(default = "default_usize::<262_208>")]
    pub vocab_size: usize,
    #[serde(default = "default_f32::<1_000_000>")]
    pub rope_theta: f32,
    #[serde(default = "default_f32::<10_000>")]
    pub rope_local_base_freq: f32,
    /// Scaling of the full-attention layers' rope (hub style).
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_f32::<256>")]
    pub query_pre_attn_scalar: f32,
    #[serde(default = "default_usize::<4096>")]
    pub sliding_window: usize,
    #[serde(default = "default_usize::<6>")]
    pub sliding_window_pattern: usize,
    pub attn_logit_softcapping: Option<f32>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub use_bidirectional_attention: bool,
}

crate::config::impl_deref!(Gemma3Config => base: GemmaConfig);

impl Gemma3Config {
    /// Parse from the whole `config.json` (the decoder settings of a ConditionalGeneration
    /// checkpoint live in `text_config`).
    pub fn from_root(dir: &Path, root: &Value) -> Result<Self> {
        crate::config::parse_checked(dir, &crate::config::text_config(root), Gemma3Config::validate)
    }

    /// `sliding_attention` / `full_attention` per layer; from `sliding_window_pattern` (every
    /// `pattern`-th layer full) when absent, as transformers derives them.
    pub fn layer_types(&self) -> Vec<String> {
        self.base.layer_types_or_pattern(self.sliding_window_pattern, false)
    }

    /// The rope of one layer type: per-type `rope_parameters` when present, else
    /// `rope_local_base_freq` (sliding) or `rope_theta` with `rope_scaling` (full).
    pub fn rope(&self, sliding: bool) -> std::result::Result<Rope, String> {
        let key = if sliding { "sliding_attention" } else { "full_attention" };
        if let Some(p) = self.rope_parameters.as_ref().and_then(|r| r.get(key)) {
            let mut s: RopeScaling = serde_json::from_value(p.clone()).map_err(|e| format!("rope_parameters.{key}: {e}"))?;
            let theta = p.get("rope_theta").and_then(Value::as_f64).map_or(if sliding { self.rope_local_base_freq } else { self.rope_theta }, |t| t as f32);
            if s.rope_type.is_empty() {
                s.rope_type = "default".into();
            }
            return Rope::scaled(self.head_dim, theta, Some(&s), self.max_position_embeddings);
        }
        if sliding {
            Ok(Rope::new(self.head_dim, self.rope_local_base_freq))
        } else {
            Rope::scaled(self.head_dim, self.rope_theta, self.rope_scaling.as_ref(), self.max_position_embeddings)
        }
    }

    /// Checks the config before any tensor is read.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let (n, h, kv) = (self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads);
        if self.hidden_size == 0 || n == 0 || self.vocab_size == 0 || h == 0 || kv == 0 || !h.is_multiple_of(kv) {
            return Err(format!("hidden_size, num_hidden_layers, vocab_size must be positive and {h} heads a multiple of {kv} kv heads"));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.sliding_window == 0 || self.query_pre_attn_scalar <= 0.0 {
            return Err("head_dim must be even and positive, sliding_window and query_pre_attn_scalar positive".into());
        }
        self.check_layer_types(&self.layer_types())?;
        if self.attn_logit_softcapping.is_some() {
            return Err("attn_logit_softcapping is not supported (Gemma 3 checkpoints ship it null)".into());
        }
        if self.use_bidirectional_attention {
            return Err("use_bidirectional_attention (EmbeddingGemma) is not supported by the causal LM".into());
        }
        self.activation()?;
        self.rope(true)?;
        self.rope(false)?;
        Ok(())
    }
}

#[derive(Clone)]
struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    mlp: GatedMlp,
    post_ffn_norm: RmsNorm,
    sliding: bool,
}

crate::layers::layer_arrays!(Block { input_norm, attn, post_attn_norm, pre_ffn_norm, mlp, post_ffn_norm });

impl Block {
    /// `rope`: the rope of this layer's type.
    fn load(vb: &Vb, cfg: &Gemma3Config, sliding: bool, rope: Rope) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let norm = |n: &str| RmsNorm::load(&vb.pp(n), h, eps, 1.0);
        let acfg = AttentionConfig {
            bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: Some(eps),
            norm_offset: 1.0,
            scale: Some(cfg.query_pre_attn_scalar.powf(-0.5)),
            ..AttentionConfig::new(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        };
        let act = Activation::parse(&cfg.hidden_activation).expect("validated");
        Ok(Block {
            input_norm: norm("input_layernorm")?,
            attn: Attention::load(&vb.pp("self_attn"), acfg, rope, ["q_norm", "k_norm"])?,
            post_attn_norm: norm("post_attention_layernorm")?,
            pre_ffn_norm: norm("pre_feedforward_layernorm")?,
            mlp: GatedMlp::load(&vb.pp("mlp"), h, cfg.intermediate_size, act)?,
            post_ffn_norm: norm("post_feedforward_layernorm")?,
            sliding,
        })
    }
}

impl DecoderLayer for Block {
    type Ctx = Masks;
    fn mixer(&self, x: &Array, kv: &mut ForwardKv, i: usize, masks: &Masks, last_only: bool) -> Result<Array> {
        let mask = if self.sliding { masks.sliding } else { masks.full };
        let (xn, mut kv) = (self.input_norm.forward(x)?, kv.layer(i)?);
        let a = if last_only { self.attn.forward_kv_last(&xn, &mut kv, mask)? } else { self.attn.forward_kv(&xn, &mut kv, mask)? };
        self.post_attn_norm.forward(&a)
    }
    fn ffn(&self, h: &Array) -> Result<Array> {
        self.post_ffn_norm.forward(&self.mlp.forward(&self.pre_ffn_norm.forward(h)?)?)
    }
    fn checkpointed(&self, x: &Array, masks: &Masks) -> Option<Result<Array>> {
        Some(crate::layers::decoder::checkpoint_block(self, x, masks))
    }
}

/// Gemma 3 causal LM.
pub struct Gemma3Model {
    cfg: Gemma3Config,
    info: ModelInfo,
    embed: Embedding,
    /// `sqrt(hidden)` in bf16, as mlx-lm and the bf16 checkpoints compute it.
    embed_scale: f32,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: LmHead,
    /// KV heads of this rank's cache (all of them unless the load is tensor parallel).
    kv_heads: usize,
}

impl Gemma3Model {
    pub fn new(weights: &Weights, cfg: Gemma3Config, eos: Vec<u32>) -> Result<Self> {
        cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason })?;
        let root = weights.root();
        let prefix = weights.decoder_prefix();
        let vb = root.pp(prefix);
        let h = cfg.hidden_size;
        let embed = Embedding::load(&vb.pp("embed_tokens"), cfg.vocab_size, h)?;
        let types = cfg.layer_types();
        let bad = |reason| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason };
        let (sliding_rope, full_rope) = (cfg.rope(true).map_err(bad)?, cfg.rope(false).map_err(bad)?);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let sliding = types[i] == "sliding_attention";
                Block::load(&vb.pp("layers").pp(i), &cfg, sliding, if sliding { sliding_rope.clone() } else { full_rope.clone() })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = LmHead::load(&root, prefix, &embed, cfg.tie_word_embeddings, h, cfg.vocab_size)?.with_softcap(cfg.final_logit_softcapping);
        let info = ModelInfo::decoder("gemma3", cfg.vocab_size, h, cfg.num_hidden_layers, cfg.max_position_embeddings, eos, cfg.bos_token_id);
        let embed_scale = mlx_array::bf16::from_f32((h as f32).sqrt()).to_f32();
        let kv_heads = crate::layers::parallel::per_rank(&vb, "KV heads", cfg.num_key_value_heads)?;
        Ok(Gemma3Model { norm: RmsNorm::load(&vb.pp("norm"), h, cfg.rms_norm_eps, 1.0)?, cfg, info, embed, embed_scale, layers, lm_head, kv_heads })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }
}

impl ModelRuntime for Gemma3Model {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn cache_spec(&self) -> CacheSpec {
        let (kv_heads, head_dim) = (self.kv_heads, self.cfg.head_dim);
        let layers = self
            .layers
            .iter()
            .map(|b| if b.sliding { LayerKind::SlidingAttention { kv_heads, head_dim, window: self.cfg.sliding_window } } else { LayerKind::Attention { kv_heads, head_dim } })
            .collect();
        CacheSpec { layers }
    }
    fn forward(&self, tokens: &Array, cache: &mut Cache, logits: Logits, hidden: bool) -> Result<ForwardOutput> {
        let stack = Stack { layers: &self.layers, prefix_skip: true, norm: &self.norm };
        let embed = |t: &Array| Ok(self.embed.forward(t)?.mul_scalar(self.embed_scale)?);
        let (h, _) = stack.forward(tokens, cache, Rows::of(logits, hidden), embed, |l| Masks::new(l, Some(self.cfg.sliding_window)))?;
        self.lm_head.output(h, logits, hidden)
    }
}

/// The registry's constructor.
pub(crate) fn load(c: &LoadContext) -> Result<Built> {
    let cfg = Gemma3Config::from_root(c.dir, c.config)?;
    Ok(Built::Lm(Box::new(Gemma3Model::new(c.weights, cfg, c.eos.clone())?)))
}

/// `tiny`: hidden 64, 6 layers (5 sliding over 16 positions, 1 full), vocab 512, soft-capped.
pub(crate) const PRESETS: &[Preset] = &[(
    "tiny",
    || {
        serde_json::json!({
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16,
            "sliding_window": 16, "sliding_window_pattern": 6, "final_logit_softcapping": 30.0,
            "tie_word_embeddings": true, "max_position_embeddings": 4096, "bos_token_id": 486, "eos_token_id": 488
        })
    },
)];

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: Value) -> Gemma3Config {
        let mut v = serde_json::json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn layer_types_follow_the_sliding_window_pattern() {
        let t = cfg(serde_json::json!({})).layer_types();
        assert_eq!(t.iter().filter(|x| *x == "full_attention").count(), 1);
        assert_eq!(t[5], "full_attention");
        assert_eq!(t[6], "sliding_attention");
        assert!(cfg(serde_json::json!({"layer_types": ["full_attention"]})).validate().unwrap_err().contains("layer_types"));
    }

    #[test]
    fn per_type_rope_parameters_and_errors() {
        let c = cfg(serde_json::json!({"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}));
        assert_eq!(c.rope(false).unwrap().scale, 0.125);
        assert_eq!(c.rope(true).unwrap().base, 1e4);
        let bad = cfg(serde_json::json!({"rope_parameters": {"full_attention": {"rope_type": "su", "factor": 2.0}}}));
        assert!(bad.validate().unwrap_err().contains("\"su\""));
        assert!(cfg(serde_json::json!({"attn_logit_softcapping": 50.0})).validate().is_err());
        let hub = cfg(serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_local_base_freq": 5000.0}));
        assert_eq!((hub.rope(false).unwrap().scale, hub.rope(true).unwrap().base), (0.25, 5000.0));
    }
}
