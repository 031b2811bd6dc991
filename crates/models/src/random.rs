//! Random-weight checkpoints in the hub layout, for tests, demos and benchmarks (no real
//! weights can be downloaded on every machine), for any registered family.
//!
//! The tensor list is not written by hand: the family's constructor is run over
//! [`Weights::expecting`] on the config alone, which records every tensor it reads (name, shape
//! and how to draw it). The same list is the family's expected checkpoint keys
//! ([`expected_tensors`]).
use crate::registry::{self, Built, Family};
use crate::weights::{ExpectedTensor, Weights};
use crate::{ModelError, Result};
use mlx_array::random::{normal_with, Key};
use mlx_array::{Array, DType};
use serde_json::Value;
use std::path::Path;

/// The Qwen3 tokenizer shrunk to 512 ids (real pre-tokenizer, specials and chat template),
/// bundled so random checkpoints can chat.
const TOKENIZER_JSON: &str = include_str!("../assets/qwen3-tokenizer/tokenizer.json");
const TOKENIZER_CONFIG: &str = include_str!("../assets/qwen3-tokenizer/tokenizer_config.json");

/// The config.json of a family's preset (`tiny`, `small`, or a named size such as `0.6b`).
pub fn preset_config(model_type: &str, preset: &str) -> Result<Value> {
    let family = registry::family(model_type).ok_or_else(|| ModelError::InvalidInput(format!("unknown model family {model_type:?}")))?;
    family.preset(preset).ok_or_else(|| {
        let known: Vec<&str> = family.presets.iter().map(|(n, _)| *n).collect();
        ModelError::InvalidInput(format!("{model_type} has no preset {preset:?} (known: {})", known.join(", ")))
    })
}

/// Every tensor a checkpoint with this config.json must hold, in the order the model reads
/// them (the seeds' `getExpectedWeightKeys`). The config is validated as loading would.
pub fn expected_tensors(config: &Value) -> Result<Vec<ExpectedTensor>> {
    let dir = Path::new("<config>");
    let family = registry::detect_from_value(dir, config)?;
    expected_for(family, dir, config)
}

fn expected_for(family: &'static Family, dir: &Path, config: &Value) -> Result<Vec<ExpectedTensor>> {
    let weights = Weights::expecting(dir);
    match crate::model::construct(dir, config, &weights, family)? {
        Built::Lm(m) => drop(m),
        Built::Embedding(m) => drop(m),
    }
    Ok(weights.expected())
}

/// Create a random checkpoint for `config` (a hub-style config.json naming its `model_type`) in
/// `dir`: model.safetensors in `dtype`, config.json (with `torch_dtype`) and the bundled
/// 512-id Qwen3 tokenizer. Weights ~ N(0, 0.02), norm scales ~ 1, recurrent parameters as
/// their layers ask: text is random. Every file is written atomically.
pub fn create_random_checkpoint(config: &Value, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    let family = registry::detect_from_value(dir, config)?;
    let tensors = expected_for(family, dir, config)?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let keys = Key::new(seed)?.split_n(tensors.len())?;
    let mut arrays: Vec<(String, Array)> = Vec::with_capacity(tensors.len());
    for (t, key) in tensors.into_iter().zip(&keys) {
        arrays.push((t.name, normal_with(&t.shape, t.init.mean, t.init.std, DType::F32, key)?.astype(dtype)?));
    }
    let refs: Vec<(&str, &Array)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx_array::io::save_safetensors(dir.join("model.safetensors"), &refs, None)?;
    let mut config = config.clone();
    let obj = config.as_object_mut().ok_or_else(|| ModelError::InvalidInput("checkpoint config must be a JSON object".into()))?;
    obj.insert("torch_dtype".into(), dtype.torch_name().into());
    obj.retain(|_, v| !v.is_null());
    mlx_array::io::write_atomic(dir.join("config.json"), serde_json::to_string_pretty(&config).expect("JSON value").as_bytes())?;
    mlx_array::io::write_atomic(dir.join("tokenizer.json"), TOKENIZER_JSON.as_bytes())?;
    mlx_array::io::write_atomic(dir.join("tokenizer_config.json"), TOKENIZER_CONFIG.as_bytes())?;
    Ok(())
}

/// [`create_random_checkpoint`] of a family's preset.
pub fn create_random_preset(model_type: &str, preset: &str, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    create_random_checkpoint(&preset_config(model_type, preset)?, dir, dtype, seed)
}
