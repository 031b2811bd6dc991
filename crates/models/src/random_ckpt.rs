//! Random-weight checkpoints in the hub layout, for tests, demos and benchmarks
//! (no real weights can be downloaded on every machine).
use crate::families::qwen3::Qwen3Config;
use crate::{ModelError, Result};
use mlx_array::random::{normal_with, Key};
use mlx_array::{Array, DType};
use std::path::Path;

/// The Qwen3 tokenizer shrunk to 512 ids (real pre-tokenizer, specials and chat template),
/// bundled so random checkpoints can chat.
const TOKENIZER_JSON: &str = include_str!("../assets/qwen3-tokenizer/tokenizer.json");
const TOKENIZER_CONFIG: &str = include_str!("../assets/qwen3-tokenizer/tokenizer_config.json");

/// Write `bytes` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| ModelError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

/// A small Qwen3 shape (hidden 64, 2 layers, vocab 512) that runs anywhere in milliseconds.
pub fn tiny_qwen3_config() -> Qwen3Config {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": true,
        "max_position_embeddings": 4096, "bos_token_id": 486, "eos_token_id": 488
    }))
    .expect("static config")
}

/// Create a random Qwen3 checkpoint in `dir` (config.json, model.safetensors in `dtype`, and the
/// bundled 512-id Qwen3 tokenizer). Weights ~ N(0, 0.02), norms ~ 1 + N(0, 0.1): text is random.
/// Each file is written atomically; existing files are replaced only once complete.
pub fn create_random_qwen3_checkpoint(cfg: &Qwen3Config, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let (h, d, i) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
    let (nq, nkv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    let mut shapes: Vec<(String, Vec<usize>, f32, f32)> = vec![("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], 0.0, 0.02)];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![nq, h]),
            ("self_attn.k_proj.weight", vec![nkv, h]),
            ("self_attn.v_proj.weight", vec![nkv, h]),
            ("self_attn.o_proj.weight", vec![h, nq]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ] {
            shapes.push((format!("{p}.{n}"), s, 0.0, 0.02));
        }
        for (n, s) in [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h), ("self_attn.q_norm.weight", d), ("self_attn.k_norm.weight", d)] {
            shapes.push((format!("{p}.{n}"), vec![s], 1.0, 0.1));
        }
    }
    shapes.push(("model.norm.weight".into(), vec![h], 1.0, 0.1));
    if !cfg.tie_word_embeddings {
        shapes.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], 0.0, 0.02));
    }
    let mut json = serde_json::to_value(cfg).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    json.as_object_mut().unwrap().insert("head_dim".into(), d.into());
    write_random_checkpoint(dir, shapes, dtype, seed, json, "qwen3", "Qwen3ForCausalLM")
}

/// One tensor of a random checkpoint: name, shape, mean and standard deviation.
pub(crate) type RandomTensor = (String, Vec<usize>, f32, f32);

/// Draw `tensors` from one seed, save them as `model.safetensors` in `dtype`, then write
/// `config` as config.json (with `model_type`, `architectures` and `torch_dtype` set and nulls
/// dropped) and the bundled tokenizer. Every file is written atomically.
pub(crate) fn write_random_checkpoint(
    dir: &Path,
    tensors: Vec<RandomTensor>,
    dtype: DType,
    seed: u64,
    mut config: serde_json::Value,
    model_type: &str,
    architecture: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let keys = Key::new(seed)?.split_n(tensors.len())?;
    let mut arrays: Vec<(String, Array)> = Vec::with_capacity(tensors.len());
    for ((name, shape, loc, scale), key) in tensors.into_iter().zip(&keys) {
        arrays.push((name, normal_with(&shape, loc, scale, DType::F32, key)?.astype(dtype)?));
    }
    let refs: Vec<(&str, &Array)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx_array::io::save_safetensors(dir.join("model.safetensors"), &refs, None)?;

    let obj = config.as_object_mut().ok_or_else(|| ModelError::InvalidInput("checkpoint config must be a JSON object".into()))?;
    obj.insert("model_type".into(), model_type.into());
    obj.insert("architectures".into(), serde_json::json!([architecture]));
    obj.insert("torch_dtype".into(), dtype_name(dtype).into());
    obj.retain(|_, v| !v.is_null());
    write_atomic(&dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap().as_bytes())?;
    write_atomic(&dir.join("tokenizer.json"), TOKENIZER_JSON.as_bytes())?;
    write_atomic(&dir.join("tokenizer_config.json"), TOKENIZER_CONFIG.as_bytes())?;
    Ok(())
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}
