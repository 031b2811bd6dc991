//! Random-weight Gemma 4 text checkpoints (`gemma4_text`, Gemma4ForCausalLM layout: keys under
//! `model.`), for tests, demos and benchmarks. Like [`crate::create_random_qwen3_checkpoint`]:
//! config.json, model.safetensors and the bundled 512-id Qwen3 tokenizer, each file written
//! atomically. The tensor set is exactly what [`crate::families::gemma4`] and mlx-lm's
//! `gemma4_text.py` load (strict): KV-shared layers have no `k_proj`/`v_proj`/`k_norm`,
//! `attention_k_eq_v` full layers no `v_proj`, MoE layers the fused `experts.gate_up_proj` /
//! `experts.down_proj` and `router.{proj,scale,per_expert_scale}`.
//!
//! config.json spells out every setting whose default differs between the two loaders
//! (mlx-lm defaults `num_kv_shared_layers` to 20, `hidden_size_per_layer_input` to 256,
//! `global_head_dim` to 512, `use_double_wide_mlp` to true and builds `layer_types` without forcing
//! the last layer to full attention), so both read the same network.
use crate::families::gemma4::Gemma4Config;
use crate::random_ckpt::{write_random_checkpoint, RandomTensor};
use crate::{ModelError, Result};
use mlx_array::DType;
use std::path::Path;

/// A small Gemma 4 shape (hidden 64, 6 layers: 2 sliding + 1 full, twice; window 16; PLE 16;
/// the last 2 layers KV-shared with double-wide MLPs; vocab 512) that runs in milliseconds.
pub fn tiny_gemma4_config() -> Gemma4Config {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "vocab_size": 512, "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 16,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": true, "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}
        },
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": true, "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 486, "eos_token_id": 488
    }))
    .expect("static config")
}

/// Create a random Gemma 4 text checkpoint (`model_type` `gemma4_text`) in `dir`.
/// Projections ~ N(0, 0.02), RMSNorm scales (`x * w`) ~ 1 + N(0, 0.1), `layer_scalar` = 1,
/// router scales ~ 1 + N(0, 0.1): text is random, activations stay O(1).
pub fn create_random_gemma4_checkpoint(cfg: &Gemma4Config, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let (h, n, p, nh) = (cfg.hidden_size, cfg.num_hidden_layers, cfg.ple_dim(), cfg.num_attention_heads);
    let types = cfg.layer_types();
    let first_shared = n - cfg.num_kv_shared_layers.unwrap_or(0).min(n);
    let shared = |i: usize| first_shared > 0 && i >= first_shared;
    let mut t: Vec<RandomTensor> = Vec::new();
    let mut w = |name: String, shape: Vec<usize>| t.push((name, shape, 0.0, 0.02));
    let mut ones: Vec<(String, Vec<usize>, f32)> = Vec::new(); // (name, shape, scale) around 1
    w("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h]);
    if p > 0 {
        let pv = cfg.vocab_size_per_layer_input.unwrap_or(cfg.vocab_size);
        w("model.embed_tokens_per_layer.weight".into(), vec![pv, n * p]);
        w("model.per_layer_model_projection.weight".into(), vec![n * p, h]);
        ones.push(("model.per_layer_projection_norm.weight".into(), vec![p], 0.1));
    }
    for (i, ty) in types.iter().enumerate() {
        let l = format!("model.layers.{i}");
        let a = format!("{l}.self_attn");
        let (d, nkv) = (cfg.layer_head_dim(i), cfg.layer_kv_heads(i));
        w(format!("{a}.q_proj.weight"), vec![nh * d, h]);
        w(format!("{a}.o_proj.weight"), vec![h, nh * d]);
        ones.push((format!("{a}.q_norm.weight"), vec![d], 0.1));
        if !shared(i) {
            w(format!("{a}.k_proj.weight"), vec![nkv * d, h]);
            if !(cfg.attention_k_eq_v && ty == "full_attention") {
                w(format!("{a}.v_proj.weight"), vec![nkv * d, h]);
            }
            ones.push((format!("{a}.k_norm.weight"), vec![d], 0.1));
        }
        let inter = cfg.intermediate_size * if cfg.use_double_wide_mlp && shared(i) { 2 } else { 1 };
        w(format!("{l}.mlp.gate_proj.weight"), vec![inter, h]);
        w(format!("{l}.mlp.up_proj.weight"), vec![inter, h]);
        w(format!("{l}.mlp.down_proj.weight"), vec![h, inter]);
        for nm in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"] {
            ones.push((format!("{l}.{nm}.weight"), vec![h], 0.1));
        }
        if cfg.enable_moe_block {
            let (e, mi) = (cfg.num_experts.unwrap_or(0), cfg.moe_intermediate_size.unwrap_or(0));
            w(format!("{l}.router.proj.weight"), vec![e, h]);
            ones.push((format!("{l}.router.scale"), vec![h], 0.1));
            ones.push((format!("{l}.router.per_expert_scale"), vec![e], 0.1));
            w(format!("{l}.experts.gate_up_proj"), vec![e, 2 * mi, h]);
            w(format!("{l}.experts.down_proj"), vec![e, h, mi]);
            for nm in ["pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"] {
                ones.push((format!("{l}.{nm}.weight"), vec![h], 0.1));
            }
        }
        if p > 0 {
            w(format!("{l}.per_layer_input_gate.weight"), vec![p, h]);
            w(format!("{l}.per_layer_projection.weight"), vec![h, p]);
            ones.push((format!("{l}.post_per_layer_input_norm.weight"), vec![h], 0.1));
        }
        ones.push((format!("{l}.layer_scalar"), vec![1], 0.0));
    }
    ones.push(("model.norm.weight".into(), vec![h], 0.1));
    if !cfg.tie_word_embeddings {
        w("lm_head.weight".into(), vec![cfg.vocab_size, h]);
    }
    t.extend(ones.into_iter().map(|(nm, s, sc)| (nm, s, 1.0, sc)));

    let mut json = serde_json::to_value(cfg).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    let obj = json.as_object_mut().unwrap();
    let full_dim = (0..n).find(|&i| types[i] == "full_attention").map_or(cfg.head_dim, |i| cfg.layer_head_dim(i));
    obj.insert("layer_types".into(), serde_json::json!(types));
    obj.insert("num_kv_shared_layers".into(), (n - first_shared).into());
    obj.insert("hidden_size_per_layer_input".into(), p.into());
    obj.insert("vocab_size_per_layer_input".into(), cfg.vocab_size_per_layer_input.unwrap_or(cfg.vocab_size).into());
    obj.insert("global_head_dim".into(), full_dim.into());
    if cfg.attention_k_eq_v {
        let kv = (0..n).find(|&i| types[i] == "full_attention").map_or(cfg.num_key_value_heads, |i| cfg.layer_kv_heads(i));
        obj.insert("num_global_key_value_heads".into(), kv.into());
    }
    obj.remove("per_layer_config");
    write_random_checkpoint(dir, t, dtype, seed, json, "gemma4_text", "Gemma4ForCausalLM")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{generate, load_model, GenerateConfig, LoadOptions};

    fn check(cfg: &Gemma4Config) {
        let dir = tempfile::tempdir().unwrap();
        create_random_gemma4_checkpoint(cfg, dir.path(), DType::F32, 3).unwrap();
        let model = load_model(dir.path(), &LoadOptions { kv_cache: crate::KvCacheMode::Flat, ..Default::default() }).unwrap().into_lm().unwrap();
        assert_eq!(model.info().model_type, "gemma4");
        // a prompt past the sliding window, then a few greedy steps
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
        let mut cache = model.new_cache();
        let cfg = GenerateConfig { max_new_tokens: 4, sampling: sampling::SamplingConfig::greedy(), prefill_step_size: 2048, stop_tokens: Some(vec![]) };
        let toks: Vec<u32> = generate(&model, &mut cache, &prompt, &[], cfg).unwrap().map(|t| t.unwrap().id).collect();
        assert_eq!(toks.len(), 4);
        assert!(toks.iter().all(|&t| (t as usize) < 512));
    }

    #[test]
    fn tiny_dense_ple_kv_shared_loads_and_decodes() {
        check(&tiny_gemma4_config());
    }

    #[test]
    fn tiny_moe_k_eq_v_untied_loads_and_decodes() {
        let mut c = tiny_gemma4_config();
        c.enable_moe_block = true;
        c.num_experts = Some(4);
        c.top_k_experts = Some(2);
        c.moe_intermediate_size = Some(32);
        c.attention_k_eq_v = true;
        c.num_global_key_value_heads = Some(1);
        c.hidden_size_per_layer_input = Some(0);
        c.num_kv_shared_layers = Some(0);
        c.tie_word_embeddings = false;
        check(&c);
    }
}
