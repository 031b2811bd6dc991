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
    if let (Some(obj), Some(Value::Object(text))) = (out.as_object_mut(), root.get("text_config")) {
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

/// The serde default `true`.
pub(crate) const fn default_true() -> bool {
    true
}

fn default_rms_norm_eps() -> f32 {
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
