//! batch_bench: aggregate decode tok/s of batched generation at several batch sizes, ours
//! ([`mlx_models::generate_batch`]) against mlx-lm's `batch_generate` (benches/mlx_lm_batch_bench.py)
//! on the same checkpoint, prompts and token counts, with the ratios; and at batch 1 our
//! `generate_batch` against our single-sequence `generate` (the batched path must not cost a
//! lone sequence anything).
//!
//! ```sh
//! cargo run --release -p mlx-models-bench --bin batch_bench -- --model DIR [--batches 1,8,32,64] [--prompt 128] [--gen 64]
//! ```
//! Greedy decoding, no stop tokens (every sequence generates `--gen` tokens). Our decode tok/s
//! is the tokens generated after each sequence's first over the time from the last first token to
//! the end (the prefill excluded), mlx-lm's its `BatchStats.generation_tps` (generated tokens over
//! the generation time, prompt processing excluded).
use clap::Parser;
use mlx_models::{generate, generate_batch, load_model, GenerateConfig, KvCacheMode, LoadOptions};
use sampling::SamplingConfig;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Batched decode throughput: generate_batch vs mlx-lm batch_generate")]
struct Args {
    /// Checkpoint directory (e.g. from `llm_bench --create-random qwen3-small`).
    #[arg(long)]
    model: PathBuf,
    /// Batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    batches: Vec<usize>,
    /// Prompt length of every sequence, tokens.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 64)]
    gen: usize,
    /// Compute dtype (f32, bf16, f16); default: the library's (f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// Python with mlx-lm (default /tmp/mlxlm/bin/python).
    #[arg(long, env = "MLX_LM_PYTHON", default_value = "/tmp/mlxlm/bin/python")]
    python: String,
    /// Skip mlx-lm.
    #[arg(long)]
    no_mlx_lm: bool,
    /// Seed of the prompt ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn prompts(b: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    (0..b).map(|r| (0..len).map(|i| ((i as u64 * 7919 + r as u64 * 104729 + seed) % vocab as u64) as u32).collect()).collect()
}

fn theirs(a: &Args, b: usize, dtype: &str) -> Res<f64> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("mlx_lm_batch_bench.py");
    let out = Command::new(&a.python)
        .arg(&script)
        .arg(&a.model)
        .args(["--batch", &b.to_string(), "--prompt", &a.prompt.to_string(), "--gen", &a.gen.to_string(), "--dtype", dtype, "--seed", &a.seed.to_string()])
        .output()?;
    if !out.status.success() {
        return Err(format!("mlx-lm failed: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.lines().last().unwrap_or(""))?;
    Ok(v["decode_tps"].as_f64().unwrap_or(f64::NAN))
}

fn main() -> Res<()> {
    let a = Args::parse();
    let dtype = match a.dtype.as_deref() {
        None => None,
        Some("f32") => Some(mlx_array::DType::F32),
        Some("bf16") => Some(mlx_array::DType::BF16),
        Some("f16") => Some(mlx_array::DType::F16),
        Some(d) => return Err(format!("--dtype {d}: want f32, bf16 or f16").into()),
    };
    let dname = a.dtype.clone().unwrap_or_else(|| "f32".into());
    let opts = LoadOptions { dtype, kv_cache: KvCacheMode::Flat, ..Default::default() };
    let model = load_model(&a.model, &opts)?.into_lm()?;
    let vocab = model.info().vocab_size;
    let cfg = GenerateConfig { max_new_tokens: a.gen, sampling: SamplingConfig::greedy(), stop_tokens: Some(vec![]), ..Default::default() };
    // warm-up
    generate_batch(&model, &prompts(1, 8, vocab, a.seed), 1, &GenerateConfig { max_new_tokens: 4, ..cfg.clone() })?;
    println!("model {} prompt {} gen {} dtype {dname}", a.model.display(), a.prompt, a.gen);
    if a.batches.contains(&1) {
        let p = &prompts(1, a.prompt, vocab, a.seed)[0];
        let mut cache = model.new_cache();
        let t0 = Instant::now();
        let mut g = generate(&model, &mut cache, p, cfg.clone())?;
        let n = g.by_ref().count();
        let single = g.performance().decode_tokens_per_sec;
        drop(g);
        let r = generate_batch(&model, &prompts(1, a.prompt, vocab, a.seed), 1, &cfg)?;
        let batched = r.sequences[0].performance.decode_tokens_per_sec;
        println!("B=1: generate {single:.1} tok/s ({n} tokens, {:.2} s), generate_batch {batched:.1} tok/s: ratio {:.3}", t0.elapsed().as_secs_f64(), batched / single);
    }
    println!("{:>4} {:>14} {:>14} {:>8}", "B", "ours tok/s", "mlx-lm tok/s", "ratio");
    for &b in &a.batches {
        let ps = prompts(b, a.prompt, vocab, a.seed);
        let r = generate_batch(&model, &ps, 1, &cfg)?;
        // tokens after each sequence's first, over the time after the prefill
        let after_first: usize = r.sequences.iter().map(|s| s.tokens.len().saturating_sub(1)).sum();
        let ours = after_first as f64 / (r.decode_ms / 1e3).max(1e-9);
        let mlx = if a.no_mlx_lm { f64::NAN } else { theirs(&a, b, &dname)? };
        println!("{b:>4} {ours:>14.1} {mlx:>14.1} {:>8.2}", ours / mlx);
    }
    Ok(())
}
