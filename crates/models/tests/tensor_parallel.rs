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
    repeat_kv_heads(&fixture("qwen3"), &qwen3_kv4, 2);
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

/// A copy of the checkpoint in `src` with every KV head repeated `times` times (k_proj and
/// v_proj rows, and their biases): grouped-query attention computes the same function.
fn repeat_kv_heads(src: &Path, dst: &Path, times: usize) {
    std::fs::create_dir_all(dst).unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let kv = cfg["num_key_value_heads"].as_u64().unwrap() as usize;
    let d = cfg["head_dim"].as_u64().unwrap() as usize;
    cfg["num_key_value_heads"] = json!(kv * times);
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("reference.safetensors"), dst.join("reference.safetensors")).unwrap();
    let tensors = mlx_array::io::load_safetensors(src.join("model.safetensors"), None).unwrap();
    let mut out: Vec<(String, Array)> = Vec::new();
    for (name, a) in tensors {
        let a = if name.ends_with("k_proj.weight") || name.ends_with("v_proj.weight") || name.ends_with("k_proj.bias") || name.ends_with("v_proj.bias") {
            let s = a.shape();
            let rest: Vec<usize> = s[1..].to_vec();
            let mut per_head = vec![kv, 1, d];
            per_head.extend(&rest);
            let mut wide = vec![kv, times, d];
            wide.extend(&rest);
            let mut flat = vec![(kv * times * d) as i32];
            flat.extend(rest.iter().map(|&x| x as i32));
            let ph: Vec<i32> = per_head.iter().map(|&x| x as i32).collect();
            a.reshape(&ph).unwrap().broadcast_to(&wide).unwrap().reshape(&flat).unwrap()
        } else {
            a
        };
        out.push((name, a));
    }
    let refs: Vec<(&str, &Array)> = out.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx_array::io::save_safetensors(dst.join("model.safetensors"), &refs, None).unwrap();
}
