//! Tensor-parallel generation over MLX's ring backend: this binary starts copies of itself as
//! the ranks of a group on 127.0.0.1, each loading its shard of a tiny fixture, and checks that
//! T=0 generation gives the tokens of the single-process run and of the transformers reference
//! (`greedy_ids`, recorded with a top-1/top-2 logit gap of at least 0.0087 at every step, far
//! above the ranks' f32 reduction-order differences), that every rank follows rank 0's tokens,
//! and that each rank holds about 1/N of the single process's bytes after load (MLX's active
//! memory: the weights, and with a paged cache the pool's first blocks; with a flat cache it is
//! exactly the weights' bytes).
//!
//! `harness = false`: `main` is the test. With `TP_TEST_SPEC` set it is a rank.
mod common;
use common::*;
use mlx_array::distributed::{run_local_ring, Backend, Group};
use mlx_array::{memory, Array, DType};
use mlx_models::{generate, load_model, GenerateConfig, KvCacheMode, LoadOptions};
use sampling::SamplingConfig;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

const STEPS: usize = 16;

fn main() {
    if let Ok(spec) = std::env::var("TP_TEST_SPEC") {
        rank_main(serde_json::from_str(&spec).unwrap());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // Every KV head repeated: the same function, with KV heads for 4 ranks.
    let qwen3_kv4 = tmp.path().join("qwen3_kv4");
    let qwen3_cfg = config(&fixture("qwen3"));
    let (kv, d) = (qwen3_cfg["num_key_value_heads"].as_u64().unwrap() as usize, qwen3_cfg["head_dim"].as_u64().unwrap() as usize);
    repeat_kv_heads(&fixture("qwen3"), &qwen3_kv4, |_| Some((kv, d)), |c| c["num_key_value_heads"] = json!(2 * kv));
    // Gemma 4 MoE's full-attention layers have one (global) KV head: repeated for 2 ranks.
    let gemma4_moe_kv2 = tmp.path().join("gemma4_moe_kv2");
    let gemma4_moe_mxfp4_kv2 = tmp.path().join("gemma4_moe_mxfp4_kv2");
    for (src, dst) in [("gemma4_text_moe", &gemma4_moe_kv2), ("gemma4_text_moe_mxfp4", &gemma4_moe_mxfp4_kv2)] {
        let c = config(&fixture(src));
        let c = c.get("text_config").cloned().unwrap_or(c);
        let (kv, d) = (c["num_global_key_value_heads"].as_u64().unwrap() as usize, c["global_head_dim"].as_u64().unwrap() as usize);
        let full = |i: usize| c["layer_types"][i] == "full_attention";
        repeat_kv_heads(&fixture(src), dst, |i| full(i).then_some((kv, d)), |c| {
            let t = if c.get("text_config").is_some() { &mut c["text_config"] } else { c };
            t["num_global_key_value_heads"] = json!(2 * kv);
        });
    }
    let cases: &[(&str, &Path, usize, &str)] = &[
        ("qwen3", &fixture("qwen3"), 2, "auto"),
        ("qwen3 (flat cache)", &fixture("qwen3"), 2, "flat"),
        ("qwen3 untied head", &fixture("qwen3_untied"), 2, "auto"),
        ("llama", &fixture("llama"), 2, "auto"),
        ("qwen2 (q/k/v bias)", &fixture("qwen2"), 2, "auto"),
        ("gemma3 (sliding window, logit softcap)", &fixture("gemma3_text"), 2, "auto"),
        ("lfm2 (short convolutions)", &fixture("lfm2"), 2, "auto"),
        ("lfm2_moe (experts split)", &fixture("lfm2_moe"), 2, "auto"),
        ("qwen3_5 (gated delta net, gated attention)", &fixture("qwen3_5"), 2, "auto"),
        ("qwen3_5_moe (experts and shared expert split)", &fixture("qwen3_5_moe"), 2, "auto"),
        ("gemma4 (per-layer inputs, KV-shared layers)", &fixture("gemma4_text"), 2, "auto"),
        ("qwen3, KV heads repeated", &qwen3_kv4, 4, "auto"),
        ("gemma4 MoE (experts split, global KV heads repeated)", &gemma4_moe_kv2, 2, "auto"),
        // quantized layers: packed rows or whole groups of packed columns on each rank
        ("qwen3 8-bit, groups of 32 (untied quantized head)", &fixture("qwen3_untied_q8g32"), 2, "auto"),
        ("gemma4 4-bit, groups of 32 (quantized per-layer embedding)", &fixture("gemma4_text_q4g32"), 2, "auto"),
        ("lfm2_moe 4-bit, groups of 32 (stacked experts split, 8-bit router)", &fixture("lfm2_moe_q4"), 2, "auto"),
        ("gemma4 MoE mxfp4 (stacked switch_glu experts split)", &gemma4_moe_mxfp4_kv2, 2, "auto"),
    ];
    for &(name, dir, n, kv) in cases {
        let t = Instant::now();
        check_tokens_and_bytes(name, dir, n, kv);
        println!("test tensor_parallel::{} over {n} ranks ... ok ({:.1} s)", name.replace(' ', "_"), t.elapsed().as_secs_f64());
    }
    // Refusals, on every rank: 2 KV heads over 4 ranks, and a family without sharded layers.
    let outs = run_ranks(4, &json!({"dir": fixture("qwen3"), "kv": "auto"}));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(!ok && out.contains("2 KV heads, not a multiple of 4"), "rank {r}: {out}");
    }
    // One global KV head on Gemma 4's k_eq_v layers; an embedding model.
    let outs = run_ranks(2, &json!({"dir": fixture("gemma4_text_moe"), "kv": "auto"}));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(!ok && out.contains("1 KV heads, not a multiple of 2"), "rank {r}: {out}");
    }
    // Llama 4-bit in groups of 64: o_proj's 64 inputs would split into 32 per rank.
    let outs = run_ranks(2, &json!({"dir": fixture("llama_q4"), "kv": "auto"}));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(!ok && out.contains("o_proj splits its 64 input features into 32 per rank, which cuts its affine groups of 64"), "rank {r}: {out}");
    }
    let outs = run_ranks(2, &json!({"dir": fixture("qwen3_embed"), "kv": "auto"}));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(!ok && out.contains("tensor parallelism (2 ranks) is not supported for model_type \"harrier\""), "rank {r}: {out}");
    }
    println!("test tensor_parallel::refusals ... ok");
}

fn greedy() -> GenerateConfig {
    GenerateConfig { max_new_tokens: STEPS, sampling: SamplingConfig::greedy(), stop_tokens: Some(vec![]), prefill_step_size: 32, ..Default::default() }
}

fn kv_mode(kv: &str) -> KvCacheMode {
    match kv {
        "flat" => KvCacheMode::Flat,
        _ => KvCacheMode::Auto,
    }
}

/// The fixture's prompt and transformers' greedy continuation.
fn prompt_and_reference(dir: &Path) -> (Vec<u32>, Vec<u32>) {
    let r = mlx_array::io::load_safetensors(dir.join("reference.safetensors"), Some(DType::F32)).unwrap();
    let prompt = ids(&r["input_ids"]);
    let want = ids(&r["greedy_ids"])[prompt.len()..prompt.len() + STEPS].to_vec();
    (prompt, want)
}

fn check_tokens_and_bytes(name: &str, dir: &Path, n: usize, kv: &str) {
    let (prompt, want) = prompt_and_reference(dir);
    // The single process.
    let before = memory::active().unwrap();
    let model = load_model(dir, &LoadOptions { kv_cache: kv_mode(kv), ..Default::default() }).unwrap().into_lm().unwrap();
    let single_bytes = memory::active().unwrap() - before;
    let mut cache = model.new_cache();
    let single: Vec<u32> = generate(&model, &mut cache, &prompt, greedy()).unwrap().map(|t| t.unwrap().id).collect();
    drop((cache, model));
    assert_eq!(single, want, "{name}: single process against transformers");
    // N ranks.
    let outs = run_ranks(n, &json!({"dir": dir, "kv": kv}));
    for (r, (ok, out)) in outs.iter().enumerate() {
        assert!(ok, "{name}: rank {r} of {n} failed:\n{out}");
        let line: Value = serde_json::from_str(out.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("{name}: rank {r} printed no result:\n{out}"))).unwrap();
        let toks: Vec<u32> = serde_json::from_value(line["tokens"].clone()).unwrap();
        assert_eq!(toks, single, "{name}: rank {r} of {n} against the single process");
        let bytes = line["weight_bytes"].as_u64().unwrap() as f64;
        let share = bytes / single_bytes as f64;
        // Norm weights are the only tensors every rank holds whole (under 1% of these models).
        assert!(share < 1.0 / n as f64 * 1.05 && share > 1.0 / n as f64 * 0.95, "{name}: rank {r} holds {bytes} bytes, {share:.3} of the single process's {single_bytes}");
        if r == 0 {
            println!("  {name}: rank 0 of {n} holds {bytes} of {single_bytes} bytes after load ({share:.3})");
        }
    }
}

/// Run `n` ranks of this binary on `spec`; each rank's success and its stdout + stderr.
fn run_ranks(n: usize, spec: &Value) -> Vec<(bool, String)> {
    let exe = std::env::current_exe().unwrap();
    run_local_ring(n, &exe, Duration::from_secs(120), |c| {
        c.env("TP_TEST_SPEC", spec.to_string());
    })
    .unwrap_or_else(|e| panic!("{n} ranks on {spec}: {e}"))
    .into_iter()
    .map(|o| (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))))
    .collect()
}

fn rank_main(spec: Value) {
    let dir = Path::new(spec["dir"].as_str().unwrap());
    let g = Group::init(Backend::Ring).unwrap();
    let before = memory::active().unwrap();
    let opts = LoadOptions { kv_cache: kv_mode(spec["kv"].as_str().unwrap()), tensor_parallel: Some(g.clone()), ..Default::default() };
    let model = match load_model(dir, &opts) {
        Ok(m) => m.into_lm().unwrap(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(3);
        }
    };
    let weight_bytes = memory::active().unwrap() - before;
    let (prompt, _) = prompt_and_reference(dir);
    let mut cache = model.new_cache();
    let tokens: Vec<u32> = generate(&model, &mut cache, &prompt, greedy()).unwrap().map(|t| t.unwrap().id).collect();
    println!("{}", json!({"rank": g.rank(), "tokens": tokens, "weight_bytes": weight_bytes}));
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

/// A copy of the checkpoint in `src` with every KV head of the attention layers `heads` picks
/// (layer index -> its KV heads and head dim; `None`: unchanged) repeated `times` times: the
/// rows of k_proj and v_proj (weight and bias, or a quantized layer's packed weight, scales
/// and biases). Grouped-query attention computes the same function; `edit` sets the new head
/// counts in config.json.
fn repeat_kv_heads(src: &Path, dst: &Path, heads: impl Fn(usize) -> Option<(usize, usize)>, edit: impl FnOnce(&mut Value)) {
    const TIMES: usize = 2;
    std::fs::create_dir_all(dst).unwrap();
    let mut cfg = config(src);
    edit(&mut cfg);
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("reference.safetensors"), dst.join("reference.safetensors")).unwrap();
    let tensors = mlx_array::io::load_safetensors(src.join("model.safetensors"), None).unwrap();
    let mut out: Vec<(String, Array)> = Vec::new();
    for (name, a) in tensors {
        let layer = name.split(".layers.").nth(1).and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        let kv_proj = [".k_proj.", ".v_proj."].iter().any(|p| name.contains(p));
        let a = match layer.filter(|_| kv_proj).and_then(&heads) {
            Some((kv, d)) => {
                let s = a.shape();
                assert_eq!(s[0], kv * d, "{name} {s:?}: {kv} KV heads of {d}");
                let rest: Vec<i32> = s[1..].iter().map(|&x| x as i32).collect();
                let dims = |lead: &[i32]| lead.iter().chain(&rest).copied().collect::<Vec<i32>>();
                let wide: Vec<usize> = dims(&[kv as i32, TIMES as i32, d as i32]).iter().map(|&x| x as usize).collect();
                a.reshape(&dims(&[kv as i32, 1, d as i32])).unwrap().broadcast_to(&wide).unwrap().reshape(&dims(&[(kv * TIMES * d) as i32])).unwrap()
            }
            None => a,
        };
        out.push((name, a));
    }
    let refs: Vec<(&str, &Array)> = out.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx_array::io::save_safetensors(dst.join("model.safetensors"), &refs, None).unwrap();
}
