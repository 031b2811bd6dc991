//! Reading `config.json` in both the hub style and the transformers-5 style.
//!
//! transformers 5 writes `rope_parameters` instead of `rope_theta`/`rope_scaling`, `dtype` instead
//! of `torch_dtype`, and multimodal checkpoints nest the decoder's settings in `text_config`.
use crate::layers::Activation;
use crate::{ModelError, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// Read and parse `dir/config.json` as JSON (errors per the loader rules).
pub fn read_config_json(dir: &Path) -> Result<Value> {
    let p = dir.join("config.json");
    let raw = std::fs::read_to_string(&p).map_err(|_| ModelError::ConfigNotFound(dir.to_path_buf()))?;
    serde_json::from_str(&raw).map_err(|e| ModelError::MalformedConfig { path: dir.to_path_buf(), reason: format!("invalid JSON: {e}") })
}

/// The decoder's settings: `text_config` merged over the top level (top-level keys fill gaps).
pub fn text_config(root: &Value) -> Value {
    let mut out = root.clone();
    // `llm_config`: InternVL-Chat checkpoints (model_type `internvl_chat`).
    if let (Some(obj), Some(Value::Object(text))) = (out.as_object_mut(), root.get("text_config").or_else(|| root.get("llm_config"))) {
        for (k, v) in text {
            obj.insert(k.clone(), v.clone());
        }
    }
    // transformers 5: rope settings under rope_parameters.
    if let Some(Value::Object(rp)) = root.get("rope_parameters").or_else(|| out.get("rope_parameters")).cloned() {
        let obj = out.as_object_mut().unwrap();
        // A scaled rope (`rope_type` other than default) is the hub's `rope_scaling`.
        let scaled = rp.get("rope_type").and_then(Value::as_str).is_some_and(|t| t != "default");
        if scaled && obj.get("rope_scaling").is_none_or(Value::is_null) {
            obj.insert("rope_scaling".into(), Value::Object(rp.clone()));
        }
        for (k, v) in rp {
            if k == "rope_theta" || k == "partial_rotary_factor" {
                obj.entry(k).or_insert(v);
            }
        }
    }
    out
}

/// Deserialize a family config from the (text) config, naming the checkpoint in errors.
pub fn parse<T: DeserializeOwned>(dir: &Path, v: &Value) -> Result<T> {
    serde_json::from_value(v.clone()).map_err(|e| ModelError::MalformedConfig { path: dir.to_path_buf(), reason: e.to_string() })
}

/// [`parse`], then `check` (a family config's `validate`), its reason a config error too.
pub fn parse_checked<T: DeserializeOwned>(dir: &Path, v: &Value, check: impl FnOnce(&T) -> std::result::Result<(), String>) -> Result<T> {
    let cfg = parse(dir, v)?;
    check(&cfg).map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
    Ok(cfg)
}

/// `eos_token_id` may be an int or a list; generation_config.json may add more.
pub fn eos_ids(dir: &Path, cfg: &Value) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut add = |v: Option<&Value>| match v {
        Some(Value::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
        Some(Value::Array(a)) => ids.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32)),
        _ => {}
    };
    add(cfg.get("eos_token_id"));
    if let Ok(s) = std::fs::read_to_string(dir.join("generation_config.json")) {
        if let Ok(g) = serde_json::from_str::<Value>(&s) {
            add(g.get("eos_token_id"));
        }
    }
    let mut seen = std::collections::HashSet::new();
    ids.retain(|x| seen.insert(*x));
    ids
}

/// The `config.json` keys that the Qwen/Llama-style decoders (Qwen3, Llama, Qwen2, Qwen3.5) read
/// alike, flattened into each family's config (`#[serde(flatten)]`), which adds its own keys and
/// the defaults that differ between families (`rope_theta`, `max_position_embeddings`, ...).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DecoderConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// `hidden_size / num_attention_heads` when absent (see [`DecoderConfig::head_dim`]).
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    pub eos_token_id: Option<Value>,
    pub bos_token_id: Option<u32>,
}

/// `Deref` from a family config to the shared keys it flattens into `field`, so that
/// `cfg.hidden_size` reads them: `impl_deref!(Qwen3Config => decoder: DecoderConfig);`.
macro_rules! impl_deref {
    ($cfg:ty => $field:ident: $shared:ty) => {
        impl std::ops::Deref for $cfg {
            type Target = $shared;
            fn deref(&self) -> &$shared {
                &self.$field
            }
        }
    };
}
pub(crate) use impl_deref;

/// A serde default for an integer key: `#[serde(default = "crate::config::default_usize::<4096>")]`.
pub(crate) const fn default_usize<const N: usize>() -> usize {
    N
}

/// A serde default for a float key with a whole value: `default_f32::<10_000>` is 10000.0.
pub(crate) const fn default_f32<const N: u32>() -> f32 {
    N as f32
}

/// The serde default `true`.
pub(crate) const fn default_true() -> bool {
    true
}

/// 1e-6, the `rms_norm_eps` default of the Qwen, Llama and Gemma configs.
pub(crate) fn default_rms_norm_eps() -> f32 {
    1e-6
}
fn default_hidden_act() -> String {
    "silu".into()
}

impl DecoderConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Checks the attention shape (`kv_heads` key/value heads), the sizes and `hidden_act`.
    pub fn validate(&self, kv_heads: usize) -> std::result::Result<(), String> {
        let h = self.num_attention_heads;
        if h == 0 || kv_heads == 0 || !h.is_multiple_of(kv_heads) {
            return Err(format!("num_attention_heads {h} must be a positive multiple of num_key_value_heads {kv_heads}"));
        }
        if self.hidden_size == 0 || self.num_hidden_layers == 0 || self.vocab_size == 0 || !self.head_dim().is_multiple_of(2) {
            return Err("hidden_size, num_hidden_layers and vocab_size must be positive, head_dim even".into());
        }
        self.activation().map(|_| ())
    }

    /// The MLP activation `hidden_act` names.
    pub fn activation(&self) -> std::result::Result<Activation, String> {
        Activation::parse(&self.hidden_act).ok_or_else(|| format!("unsupported hidden_act {:?}", self.hidden_act))
    }
}

#[cfg(test)]
mod tests {
    use crate::families::{gemma3::Gemma3Config, gemma4::Gemma4Config, lfm2::Lfm2Config, qwen3::Qwen3Config, qwen3_5::Qwen35Config};
    use serde_json::json;

    /// Keys left out of config.json take each family's defaults (transformers' and mlx-lm's).
    #[test]
    fn absent_keys_take_the_family_defaults() {
        let sizes = json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512});
        let q: Qwen3Config = serde_json::from_value(sizes.clone()).unwrap();
        assert_eq!((q.rms_norm_eps, q.rope_theta, q.max_position_embeddings, q.hidden_act.as_str(), q.tie_word_embeddings), (1e-6, 1e6, 40960, "silu", false));
        let mut v = sizes.clone();
        v.as_object_mut().unwrap().extend(["linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"].map(|k| (k.to_string(), json!(8))));
        let q: Qwen35Config = serde_json::from_value(v).unwrap();
        assert_eq!((q.rope_theta, q.partial_rotary_factor, q.max_position_embeddings), (1e7, 0.25, 262144));
        assert_eq!((q.full_attention_interval, q.linear_conv_kernel_dim, q.norm_topk_prob, q.decoder_sparse_step), (4, 4, true, 1));
        let g: Gemma3Config = serde_json::from_value(json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})).unwrap();
        assert_eq!((g.num_key_value_heads, g.head_dim, g.vocab_size, g.rms_norm_eps, g.max_position_embeddings), (1, 256, 262_208, 1e-6, 131_072));
        assert_eq!((g.rope_theta, g.rope_local_base_freq, g.query_pre_attn_scalar, g.sliding_window, g.sliding_window_pattern), (1e6, 1e4, 256.0, 4096, 6));
        assert_eq!((g.hidden_activation.as_str(), g.tie_word_embeddings), ("gelu_pytorch_tanh", true));
        let g: Gemma4Config = serde_json::from_value(json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})).unwrap();
        assert_eq!((g.num_key_value_heads, g.head_dim, g.vocab_size, g.sliding_window, g.sliding_window_pattern, g.tie_word_embeddings), (1, 256, 262144, 512, 5, true));
        let l: Lfm2Config = serde_json::from_value(json!({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512})).unwrap();
        assert_eq!((l.max_position_embeddings, l.norm_eps, l.conv_l_cache, l.rope_theta, l.block_multiple_of), (128_000, 1e-5, 3, 1e6, 256));
        assert_eq!((l.block_ffn_dim_multiplier, l.block_auto_adjust_ff_dim, l.routed_scaling_factor), (Some(1.0), true, 1.0));
    }
}
