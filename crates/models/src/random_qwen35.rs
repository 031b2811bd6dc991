//! Random-weight Qwen3.5 checkpoints (dense and MoE) in the text-only hub layout, for tests,
//! demos and benchmarks. Like [`crate::create_random_qwen3_checkpoint`]: config.json,
//! model.safetensors and the bundled 512-id Qwen3 tokenizer, each file written atomically.
//! The MoE checkpoint stores experts fused (`experts.gate_up_proj`/`down_proj`), as hub files do.
use crate::families::qwen3_5::Qwen35Config;
use crate::random_ckpt::write_random_checkpoint;
use crate::{ModelError, Result};
use mlx_array::DType;
use std::path::Path;


/// A small dense Qwen3.5 (hidden 64, 4 layers: 3 GatedDeltaNet + 1 full attention, vocab 512).
pub fn tiny_qwen35_config() -> Qwen35Config {
    serde_json::from_value(serde_json::json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": false, "max_position_embeddings": 4096, "eos_token_id": 488,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4
    }))
    .expect("static config")
}

/// [`tiny_qwen35_config`] with 8 experts (top 2, width 32) and a shared expert (width 48).
pub fn tiny_qwen35_moe_config() -> Qwen35Config {
    let mut c = tiny_qwen35_config();
    c.intermediate_size = 0;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 32;
    c.shared_expert_intermediate_size = 48;
    c
}

/// Create a random dense Qwen3.5 checkpoint (`model_type` `qwen3_5_text`).
pub fn create_random_qwen35_checkpoint(cfg: &Qwen35Config, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    write_checkpoint(cfg, dir, dtype, seed, false)
}

/// Create a random Qwen3.5-MoE checkpoint (`model_type` `qwen3_5_moe_text`); `cfg` must set
/// `num_experts` and friends.
pub fn create_random_qwen35_moe_checkpoint(cfg: &Qwen35Config, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    if cfg.num_experts == 0 {
        return Err(ModelError::MalformedConfig { path: dir.to_path_buf(), reason: "an MoE checkpoint needs num_experts > 0".into() });
    }
    write_checkpoint(cfg, dir, dtype, seed, true)
}

fn write_checkpoint(cfg: &Qwen35Config, dir: &Path, dtype: DType, seed: u64, moe: bool) -> Result<()> {
    cfg.validate().map_err(|reason| ModelError::MalformedConfig { path: dir.to_path_buf(), reason })?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let (h, d) = (cfg.hidden_size, cfg.head_dim());
    let g = cfg.gated_delta();
    let (nq, nkv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
    // (name, shape, loc, scale); (1 + w) norms are stored zero-centred.
    let mut shapes: Vec<(String, Vec<usize>, f32, f32)> = vec![("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], 0.0, 0.02)];
    let w = |shapes: &mut Vec<(String, Vec<usize>, f32, f32)>, n: String, s: Vec<usize>, loc: f32, sc: f32| shapes.push((n, s, loc, sc));
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        if cfg.is_full_attention(l) {
            let a = format!("{p}.self_attn");
            w(&mut shapes, format!("{a}.q_proj.weight"), vec![2 * nq, h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.k_proj.weight"), vec![nkv, h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.v_proj.weight"), vec![nkv, h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.o_proj.weight"), vec![h, nq], 0.0, 0.02);
            w(&mut shapes, format!("{a}.q_norm.weight"), vec![d], 0.0, 0.1);
            w(&mut shapes, format!("{a}.k_norm.weight"), vec![d], 0.0, 0.1);
        } else {
            let a = format!("{p}.linear_attn");
            w(&mut shapes, format!("{a}.in_proj_qkv.weight"), vec![g.conv_dim(), h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.in_proj_z.weight"), vec![g.value_dim(), h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.in_proj_a.weight"), vec![g.num_v_heads, h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.in_proj_b.weight"), vec![g.num_v_heads, h], 0.0, 0.02);
            w(&mut shapes, format!("{a}.conv1d.weight"), vec![g.conv_dim(), 1, g.conv_kernel], 0.0, 0.2);
            w(&mut shapes, format!("{a}.A_log"), vec![g.num_v_heads], 1.0, 0.5);
            w(&mut shapes, format!("{a}.dt_bias"), vec![g.num_v_heads], 1.0, 0.1);
            w(&mut shapes, format!("{a}.norm.weight"), vec![g.head_v_dim], 1.0, 0.1);
            w(&mut shapes, format!("{a}.out_proj.weight"), vec![h, g.value_dim()], 0.0, 0.02);
        }
        let m = format!("{p}.mlp");
        if moe && cfg.is_moe_layer(l) {
            let (e, i, si) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
            w(&mut shapes, format!("{m}.gate.weight"), vec![e, h], 0.0, 0.02);
            w(&mut shapes, format!("{m}.experts.gate_up_proj"), vec![e, 2 * i, h], 0.0, 0.02);
            w(&mut shapes, format!("{m}.experts.down_proj"), vec![e, h, i], 0.0, 0.02);
            if si > 0 {
                w(&mut shapes, format!("{m}.shared_expert.gate_proj.weight"), vec![si, h], 0.0, 0.02);
                w(&mut shapes, format!("{m}.shared_expert.up_proj.weight"), vec![si, h], 0.0, 0.02);
                w(&mut shapes, format!("{m}.shared_expert.down_proj.weight"), vec![h, si], 0.0, 0.02);
                w(&mut shapes, format!("{m}.shared_expert_gate.weight"), vec![1, h], 0.0, 0.02);
            }
        } else {
            let i = cfg.intermediate_size;
            w(&mut shapes, format!("{m}.gate_proj.weight"), vec![i, h], 0.0, 0.02);
            w(&mut shapes, format!("{m}.up_proj.weight"), vec![i, h], 0.0, 0.02);
            w(&mut shapes, format!("{m}.down_proj.weight"), vec![h, i], 0.0, 0.02);
        }
        w(&mut shapes, format!("{p}.input_layernorm.weight"), vec![h], 0.0, 0.1);
        w(&mut shapes, format!("{p}.post_attention_layernorm.weight"), vec![h], 0.0, 0.1);
    }
    shapes.push(("model.norm.weight".into(), vec![h], 0.0, 0.1));
    if !cfg.tie_word_embeddings {
        shapes.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], 0.0, 0.02));
    }
    let mut json = serde_json::to_value(cfg).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
    let obj = json.as_object_mut().unwrap();
    obj.insert("head_dim".into(), d.into());
    if !moe {
        for k in ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"] {
            obj.remove(k);
        }
    }
    let (mt, arch) = if moe { ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM") } else { ("qwen3_5_text", "Qwen3_5ForCausalLM") };
    write_random_checkpoint(dir, shapes, dtype, seed, json, mt, arch)
}
