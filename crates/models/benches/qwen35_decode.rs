//! Decode-step latency of mid-size random Qwen3.5 models on the CPU (f32 compute, as the CPU
//! loader does): one token through 6 GatedDeltaNet + 2 full-attention layers after a 128-token
//! prefill, evaluating the logits and every cache array (what the generator does each step).
//!
//! `cargo bench -p mlx-models --bench qwen35_decode -- --warm-up-time 2 --measurement-time 10`
//! A criterion bench of one decode step; it has no peer, so it prints no ratio (see BENCHMARKS.md for the end-to-end comparison against mlx-lm).
use criterion::{criterion_group, criterion_main, Criterion};
use mlx_array::{Array, DType};
use mlx_models::{create_random_checkpoint, load_model, LoadOptions, Logits, Model};

/// hidden 1024, 8 layers (full attention every 4th), 8 q / 2 kv heads of 128, GatedDeltaNet with
/// 8 key / 16 value heads of 128, MLP 3072, vocab 8192: ~150M parameters.
fn mid_config(moe: bool) -> serde_json::Value {
    let mut v = serde_json::json!({
        "model_type": if moe { "qwen3_5_moe_text" } else { "qwen3_5_text" },
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": false, "max_position_embeddings": 4096, "eos_token_id": 488,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16
    });
    if moe {
        // 32 experts, top 4 of width 512, shared expert 1024.
        let o = v.as_object_mut().unwrap();
        o.insert("intermediate_size".into(), 0.into());
        o.insert("num_experts".into(), 32.into());
        o.insert("num_experts_per_tok".into(), 4.into());
        o.insert("moe_intermediate_size".into(), 512.into());
        o.insert("shared_expert_intermediate_size".into(), 1024.into());
    }
    v
}

fn setup(moe: bool, dir: &std::path::Path) -> (Model, mlx_models::Cache) {
    let cfg = mid_config(moe);
    create_random_checkpoint(&cfg, dir, DType::BF16, 0).unwrap();
    let model = load_model(dir, &LoadOptions::default()).unwrap().into_lm().unwrap();
    let mut cache = model.new_cache();
    let prompt: Vec<u32> = (0..128).map(|i| (i * 37 % 8000) as u32).collect();
    let out = model.forward(&Array::from_slice(&prompt, &[1, 128]).unwrap(), &mut cache, Logits::Last, false).unwrap();
    let mut all = vec![out.logits.as_ref().unwrap()];
    all.extend(cache.arrays());
    mlx_array::eval(&all).unwrap();
    (model, cache)
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("qwen35_decode_step");
    g.sample_size(20);
    for (moe, name) in [(false, "dense_1024x8_f32"), (true, "moe_1024x8_e32k4_f32")] {
        let tmp = tempfile::tempdir().unwrap();
        let (model, mut cache) = setup(moe, tmp.path());
        let tok = Array::from_slice(&[42u32], &[1, 1]).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                // The context grows by one per step (starting at 128); the recurrent layers' cost
                // does not depend on it.
                let out = model.forward(&tok, &mut cache, Logits::Last, false).unwrap();
                let mut all = vec![out.logits.as_ref().unwrap()];
                all.extend(cache.arrays());
                mlx_array::eval(&all).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
