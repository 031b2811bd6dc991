//! Llama and Qwen2 dense causal LMs (mirror mlx-lm `models/llama.py` / `models/qwen2.py` and HF
//! `LlamaForCausalLM` / `Qwen2ForCausalLM`): the Qwen3 stack without q/k norms, with Llama's
//! optional biases, Qwen2's q/k/v bias, and scaled rope (`rope_scaling`).
use crate::config::DecoderConfig;
use crate::families::qwen3::{DecoderOptions, Qwen3Config, Qwen3Model};
use crate::layers::{Rope, RopeScaling};
use crate::weights::Weights;
use crate::{ModelError, Result};
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::ops::Deref;

/// `config.json` of a Llama or Qwen2 checkpoint (the keys the model uses; defaults are HF's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(flatten)]
    pub decoder: DecoderConfig,
    pub intermediate_size: usize,
    /// `num_attention_heads` when absent.
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
}

fn default_theta() -> f32 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

impl Deref for LlamaConfig {
    type Target = DecoderConfig;
    fn deref(&self) -> &DecoderConfig {
        &self.decoder
    }
}

impl LlamaConfig {
    /// The rope the config asks for (`rope_scaling`: linear, dynamic, yarn, llama3).
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        Rope::scaled(self.head_dim(), self.rope_theta, self.rope_scaling.as_ref(), self.max_position_embeddings)
    }

    fn as_qwen3(&self) -> Qwen3Config {
        Qwen3Config {
            decoder: DecoderConfig { head_dim: Some(self.head_dim()), ..self.decoder.clone() },
            intermediate_size: self.intermediate_size,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            rope_theta: self.rope_theta,
            max_position_embeddings: self.max_position_embeddings,
            rope_scaling: self.rope_scaling.clone(),
        }
    }
}

/// Which of the two layouts a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaVariant {
    /// `attention_bias` on q/k/v/o, `mlp_bias` on the MLP.
    Llama,
    /// Bias on q/k/v always, none on o or the MLP.
    Qwen2,
}

/// Build a Llama or Qwen2 LM.
pub fn load(weights: &Weights, cfg: LlamaConfig, variant: LlamaVariant, eos: Vec<u32>) -> Result<Qwen3Model> {
    let bad = |reason: String| ModelError::MalformedConfig { path: weights.path().to_path_buf(), reason };
    let rope = cfg.rope().map_err(bad)?;
    let (qkv_bias, o_bias, mlp_bias, model_type) = match variant {
        LlamaVariant::Llama => (cfg.attention_bias, cfg.attention_bias, cfg.mlp_bias, "llama"),
        LlamaVariant::Qwen2 => (true, false, false, "qwen2"),
    };
    let opts = DecoderOptions { qk_norm: false, qkv_bias, o_bias, mlp_bias, rope };
    Qwen3Model::with_options(weights, cfg.as_qwen3(), &opts, model_type, eos)
}

/// The registry's constructors.
pub(crate) fn load_llama(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(load(c.weights, c.parse()?, LlamaVariant::Llama, c.eos.clone())?)))
}
pub(crate) fn load_qwen2(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(load(c.weights, c.parse()?, LlamaVariant::Qwen2, c.eos.clone())?)))
}

/// `tiny`: hidden 64, 2 layers, vocab 512, untied, llama3-scaled rope (SmolLM2/Llama 3 style).
pub(crate) const PRESETS: &[Preset] = &[(
    "tiny",
    || {
        json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
            "tie_word_embeddings": false, "max_position_embeddings": 4096, "bos_token_id": 486, "eos_token_id": 488
        })
    },
)];

/// `tiny`: hidden 64, 2 layers, vocab 512, tied (Qwen2.5-0.5B style).
pub(crate) const QWEN2_PRESETS: &[Preset] = &[(
    "tiny",
    || {
        json!({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": true, "max_position_embeddings": 4096, "bos_token_id": 486, "eos_token_id": 488
        })
    },
)];
