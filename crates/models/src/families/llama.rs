//! Llama and Qwen2 dense causal LMs (mirror mlx-lm `models/llama.py` / `models/qwen2.py` and HF
//! `LlamaForCausalLM` / `Qwen2ForCausalLM`): the Qwen3 stack without q/k norms, with Llama's
//! optional biases, Qwen2's q/k/v bias, and scaled rope (`rope_scaling`).
use crate::families::qwen3::{DecoderOptions, Qwen3Config, Qwen3Model};
use crate::weights::Weights;
use crate::{ModelError, Result};
use crate::registry::{Built, LoadContext, Preset};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// `config.json` of a Llama or Qwen2 checkpoint: Qwen3's keys, with HF's Llama defaults where
/// they differ (`rope_theta` 1e4, `max_position_embeddings` 2048, `num_key_value_heads` =
/// `num_attention_heads`), and `mlp_bias`.
#[derive(Debug, Clone, Serialize)]
pub struct LlamaConfig {
    #[serde(flatten)]
    pub qwen3: Qwen3Config,
    pub mlp_bias: bool,
}

impl<'de> Deserialize<'de> for LlamaConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let mut v = Value::deserialize(d)?;
        let mut mlp_bias = false;
        if let Some(o) = v.as_object_mut() {
            o.entry("rope_theta").or_insert(json!(10_000.0));
            o.entry("max_position_embeddings").or_insert(json!(2048));
            if o.get("num_key_value_heads").is_none_or(Value::is_null) {
                if let Some(h) = o.get("num_attention_heads").cloned() {
                    o.insert("num_key_value_heads".into(), h);
                }
            }
            if let Some(b) = o.get("mlp_bias") {
                mlp_bias = bool::deserialize(b).map_err(serde::de::Error::custom)?;
            }
        }
        let qwen3 = Qwen3Config::deserialize(v).map_err(serde::de::Error::custom)?;
        Ok(LlamaConfig { qwen3, mlp_bias })
    }
}

crate::config::impl_deref!(LlamaConfig => qwen3: Qwen3Config);

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
    Qwen3Model::with_options(weights, cfg.qwen3, &opts, model_type, eos)
}

/// The registry's constructors.
pub(crate) fn load_llama(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(load(c.weights, c.parse()?, LlamaVariant::Llama, c.eos.clone())?)))
}
pub(crate) fn load_qwen2(c: &LoadContext) -> Result<Built> {
    Ok(Built::Lm(Box::new(load(c.weights, c.parse()?, LlamaVariant::Qwen2, c.eos.clone())?)))
}

/// A config.json of the `tiny` shape (hidden 64, 2 layers, 4 heads over 2 KV heads, vocab 512).
fn tiny(model_type: &str, architecture: &str, rms_norm_eps: f64, rope_theta: f64, tied: bool) -> Value {
    json!({
        "model_type": model_type, "architectures": [architecture],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
        "tie_word_embeddings": tied, "max_position_embeddings": 4096, "bos_token_id": 486, "eos_token_id": 488
    })
}

/// `tiny`: untied, llama3-scaled rope (SmolLM2/Llama 3 style).
pub(crate) const PRESETS: &[Preset] = &[(
    "tiny",
    || {
        let mut c = tiny("llama", "LlamaForCausalLM", 1e-5, 500000.0, false);
        c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024});
        c
    },
)];

/// `tiny`: tied (Qwen2.5-0.5B style).
pub(crate) const QWEN2_PRESETS: &[Preset] = &[("tiny", || tiny("qwen2", "Qwen2ForCausalLM", 1e-6, 1000000.0, true))];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_keys_take_hf_llama_defaults() {
        let base = json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512});
        let c: LlamaConfig = serde_json::from_value(base.clone()).unwrap();
        assert_eq!((c.rope_theta, c.max_position_embeddings, c.num_key_value_heads, c.mlp_bias), (10_000.0, 2048, 4, false));
        let mut given = base;
        given.as_object_mut().unwrap().extend([("rope_theta".into(), json!(5e5)), ("num_key_value_heads".into(), json!(2)), ("mlp_bias".into(), json!(true))]);
        let c: LlamaConfig = serde_json::from_value(given).unwrap();
        assert_eq!((c.rope_theta, c.num_key_value_heads, c.mlp_bias), (5e5, 2, true));
        assert!(serde_json::from_value::<LlamaConfig>(json!({"hidden_size": 64})).is_err());
    }
}
