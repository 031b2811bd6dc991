//! Llama and Qwen2 dense causal LMs (mirror mlx-lm `models/llama.py` / `models/qwen2.py` and HF
//! `LlamaForCausalLM` / `Qwen2ForCausalLM`): the Qwen3 stack without q/k norms, with Llama's
//! optional biases, Qwen2's q/k/v bias, and linear or llama3 rope scaling.
use crate::families::qwen3::{DecoderOptions, Qwen3Config, Qwen3Model};
use crate::layers::Rope;
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx_array::Array;
use serde::{Deserialize, Serialize};

/// `rope_scaling` of config.json (`rope_type`, or the older `type`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f32>,
    #[serde(default)]
    pub low_freq_factor: Option<f32>,
    #[serde(default)]
    pub high_freq_factor: Option<f32>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

/// `config.json` of a Llama or Qwen2 checkpoint (the keys the model uses; defaults are HF's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}
fn default_act() -> String {
    "silu".into()
}

/// mlx-lm's `Llama3RoPE`: wavelengths `θ^(2j/d)`, stretched by `factor` below the low-frequency
/// cut, unchanged above the high-frequency one, and smoothly interpolated between.
pub fn llama3_wavelengths(dims: usize, base: f32, s: &RopeScaling) -> std::result::Result<Vec<f32>, String> {
    let factor = s.factor.ok_or("llama3 rope_scaling needs factor")?;
    let low = s.low_freq_factor.unwrap_or(1.0);
    let high = s.high_freq_factor.unwrap_or(4.0);
    let old = s.original_max_position_embeddings.unwrap_or(8192) as f32;
    if high <= low {
        return Err(format!("llama3 rope_scaling: high_freq_factor {high} must exceed low_freq_factor {low}"));
    }
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    Ok((0..dims / 2)
        .map(|j| {
            let f = base.powf((2 * j) as f32 / dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI * f;
            let f = if wavelen > low_wavelen { f * factor } else { f };
            if wavelen > high_wavelen && wavelen < low_wavelen {
                let smooth = (old / wavelen - low) / (high - low);
                f / ((1.0 - smooth) / factor + smooth)
            } else {
                f
            }
        })
        .collect())
}

impl LlamaConfig {
    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The rope the config asks for: plain, `linear` (positions divided by `factor`) or `llama3`.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        let d = self.head_dim();
        let mut rope = Rope::new(d, self.rope_theta);
        match &self.rope_scaling {
            None => {}
            Some(s) => match s.rope_type.as_str() {
                "default" => {}
                "linear" => {
                    let f = s.factor.ok_or("linear rope_scaling needs factor")?;
                    if f <= 0.0 {
                        return Err(format!("linear rope_scaling factor {f} must be positive"));
                    }
                    rope.scale = 1.0 / f;
                }
                "llama3" => {
                    let w = llama3_wavelengths(d, self.rope_theta, s)?;
                    rope.freqs = Some(Array::from_slice(&w, &[d / 2]).map_err(|e| e.to_string())?);
                }
                other => return Err(format!("rope_scaling type {other:?} is not supported (default, linear, llama3 are)")),
            },
        }
        Ok(rope)
    }

    fn as_qwen3(&self) -> Qwen3Config {
        Qwen3Config {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: Some(self.head_dim()),
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            max_position_embeddings: self.max_position_embeddings,
            hidden_act: self.hidden_act.clone(),
            eos_token_id: self.eos_token_id.clone(),
            bos_token_id: self.bos_token_id,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_wavelengths_match_mlx_lm() {
        // mlx-lm Llama3RoPE(dims=8, base=500000, factor=8, low=1, high=4, old=8192)._freqs
        let s = RopeScaling {
            rope_type: "llama3".into(),
            factor: Some(8.0),
            low_freq_factor: Some(1.0),
            high_freq_factor: Some(4.0),
            original_max_position_embeddings: Some(8192),
        };
        let w = llama3_wavelengths(8, 500000.0, &s).unwrap();
        let base: Vec<f32> = (0..4).map(|j| 500000f32.powf((2 * j) as f32 / 8.0)).collect();
        // j=0: 1 (high frequency, kept); j=1: 26.59 (kept); j=2: 707.1 (medium band: smoothed);
        // j=3: 18803 (low frequency: times 8)
        assert_eq!(w[0], base[0]);
        assert_eq!(w[1], base[1]);
        assert!(w[2] > base[2] && w[2] < base[2] * 8.0);
        assert_eq!(w[3], base[3] * 8.0);
        assert!(llama3_wavelengths(8, 1e4, &RopeScaling { factor: None, ..s.clone() }).is_err());
    }
}
