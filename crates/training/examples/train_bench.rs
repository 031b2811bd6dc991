//! Training throughput and peak memory of one configuration, as one JSON line on stdout (for
//! benches/train_bench.py, which runs mlx-lm's trainer on the same model, batch and sequence
//! length and prints the ratios).
//!
//! ```text
//! cargo run --release -p mlx-training --example train_bench -- --model DIR --batch-size 4 \
//!     --seq-len 128 --steps 10 --warmup 3 [--lora-rank 8] [--full-logits] [--head-chunk N] [--grad-checkpoint]
//!     [--cpu-fusion on|off]
//! ```
//!
//! Batches are `batch-size` sequences of `seq-len` tokens drawn from a fixed generator, the loss
//! on every position (as mlx-lm's trainer on unmasked text); AdamW (lr 1e-5, weight decay 0.01),
//! no gradient clipping (mlx-lm's trainer has none). Tokens/s counts the positions with a next
//! token (mlx-lm's `ntoks`) over the steps after the warm-up; peak memory is MLX's peak since
//! the process started (the model's weights included), as mlx-lm reports it. Tokens per CPU
//! second divide the same tokens by the CPU time (all threads) the measured steps used: on a
//! loaded machine it moves less than the wall-clock rate.
use clap::Parser;
use mlx_array::DType;
use mlx_models::{KvCacheMode, LoadOptions, ParameterTree};
use mlx_training::lora::{self, LoraConfig};
use mlx_training::{ClipConfig, Example, Schedule, SftConfig, SftTrainer};
use std::path::PathBuf;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Measured updates (after the warm-up).
    #[arg(long, default_value_t = 10)]
    steps: u64,
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// Train LoRA adapters (mlx-lm's defaults otherwise: scale 20, last 16 layers, every linear).
    #[arg(long)]
    lora_rank: Option<usize>,
    /// The model's full logits instead of the chunked head.
    #[arg(long)]
    full_logits: bool,
    /// Loss positions per head chunk (default: all of a batch's, so the head runs in one piece
    /// inside the autodiff pass, as mlx-lm's does).
    #[arg(long)]
    head_chunk: Option<usize>,
    /// Gradient checkpointing per decoder layer.
    #[arg(long)]
    grad_checkpoint: bool,
    /// Compute dtype (f32 or bf16).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Whether the CPU backend compiles fused elementwise kernels (the AdamW update, SwiGLU;
    /// `mlx_array::ops::CpuFusion`, needs `g++` on the PATH), as mlx-lm's compiled step does.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    cpu_fusion: String,
}

fn main() {
    if let Err(e) = run(&Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// CPU time (user + system, every thread) this process has used: `/proc/self/stat`'s utime and
/// stime, in clock ticks of 1/100 s (Linux's USER_HZ).
fn cpu_seconds() -> Result<f64, Box<dyn std::error::Error>> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // the fields after the command name (which ends with the last ')'): utime and stime are
    // the 12th and 13th of them
    let rest = stat.rsplit_once(')').ok_or("/proc/self/stat: no command name")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64, Box<dyn std::error::Error>> { Ok(f.get(i).ok_or("/proc/self/stat: too few fields")?.parse::<f64>()?) };
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

fn run(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        d => return Err(format!("--dtype {d}: f32 or bf16").into()),
    };
    if a.seq_len < 2 || a.batch_size == 0 || a.steps == 0 {
        return Err("--seq-len must be >= 2, --batch-size and --steps >= 1".into());
    }
    mlx_array::ops::set_cpu_fusion(if a.cpu_fusion == "on" { mlx_array::ops::CpuFusion::On } else { mlx_array::ops::CpuFusion::Off });
    let opts = LoadOptions { dtype: Some(dtype), kv_cache: KvCacheMode::Flat, ..Default::default() };
    let mut tree = ParameterTree::load(&a.model, &opts)?;
    let vocab = tree.iter().find(|(n, _)| n.ends_with("embed_tokens.weight")).map(|(_, p)| p.array.shape()[0]).ok_or("no embed_tokens.weight")?;
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let n = a.batch_size * (a.steps + a.warmup) as usize;
    let examples: Vec<Example> = (0..n)
        .map(|_| {
            let ids: Vec<u32> = (0..a.seq_len)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s % vocab as u64) as u32
                })
                .collect();
            Example::prompt_completion(&ids[..1], &ids[1..])
        })
        .collect();
    let lora_cfg = a.lora_rank.map(|rank| LoraConfig { rank, ..Default::default() });
    if let Some(c) = &lora_cfg {
        lora::apply_lora(&mut tree, c)?;
    }
    let trainable = tree.trainable_count();
    let cfg = SftConfig {
        batch_size: a.batch_size,
        max_steps: Some(a.steps + a.warmup),
        shuffle: false,
        clip: ClipConfig { max_norm: None, max_value: None },
        schedule: Schedule { lr: 1e-5, ..Default::default() },
        chunked_head: !a.full_logits,
        head_chunk: a.head_chunk.unwrap_or(a.batch_size * a.seq_len),
        gradient_checkpointing: a.grad_checkpoint,
        lora: lora_cfg,
        ..Default::default()
    };
    let mut t = SftTrainer::new(tree, &opts, examples, cfg)?;
    let (mut tokens, mut secs, mut loss) = (0usize, 0f64, 0f32);
    let mut cpu_start = if a.warmup == 0 { Some(cpu_seconds()?) } else { None };
    while let Some(m) = t.step()? {
        if m.step > a.warmup {
            tokens += m.tokens;
            secs += m.seconds;
            loss = m.loss;
        } else if m.step == a.warmup {
            cpu_start = Some(cpu_seconds()?);
        }
    }
    let cpu = cpu_seconds()? - cpu_start.ok_or("no measured step")?;
    let peak = mlx_array::memory::peak()?;
    let out = serde_json::json!({
        "impl": "mlx-models",
        "mode": if a.lora_rank.is_some() { "lora" } else { "full" },
        "head": if !t.uses_chunked_head() { "full logits".to_string() } else if t.config().head_chunk >= a.batch_size * a.seq_len { "one piece".to_string() } else { format!("chunks of {}", t.config().head_chunk) },
        "grad_checkpoint": a.grad_checkpoint,
        "cpu_fusion": a.cpu_fusion,
        "trainable_params": trainable,
        "tokens_per_second": tokens as f64 / secs,
        "tokens_per_cpu_second": tokens as f64 / cpu,
        "peak_memory_gb": peak as f64 / 1e9,
        "last_loss": loss,
    });
    println!("{out}");
    Ok(())
}
