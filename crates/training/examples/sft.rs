//! Supervised fine-tuning from the command line.
//!
//! ```text
//! cargo run --release -p mlx-training --example sft -- --model DIR --data F.jsonl --out OUT_DIR
//!     [--steps N] [--epochs E] [--batch-size B] [--lr X] [--weight-decay W] [--optimizer adamw|sgd]
//!     [--max-grad-norm G (0 = off)] [--lora-rank R] [--seed S] [--resume OUT_DIR] [--json]
//! ```
//!
//! Writes OUT_DIR/model.safetensors (f32 unless `--save-dtype`), the config and tokenizer files,
//! OUT_DIR/optimizer.safetensors (AdamW moments, or SGD momentum buffers) and
//! OUT_DIR/trainer_state.json. With `--lora-rank`, only adapters are trained (mlx-lm's
//! LoRALinear; `--lora-scale`/`--lora-alpha`, `--lora-dropout`, `--lora-layers`,
//! `--lora-targets`) and OUT_DIR holds adapters.safetensors + adapter_config.json (mlx-lm's
//! layout) in place of the model, plus, with `--fuse`, the fused model (model.safetensors,
//! config and tokenizer files). A run whose updates had non-finite gradients more than
//! `--max-nan-gradients` times stops with an error after saving its last finite state to
//! OUT_DIR (an emergency checkpoint, resumable). `--json` prints one JSON object per step on
//! stdout and nothing else; otherwise a progress bar runs on a terminal (stderr).
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_array::DType;
use mlx_models::{LoadOptions, ParameterTree};
use mlx_training::lora::{self, LoraConfig};
use mlx_training::{AdamWConfig, ClipConfig, OptimizerConfig, Schedule, ScheduleKind, SftConfig, SftTrainer, SgdConfig, TextEncoder, TrainError};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Opt {
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Sched {
    Constant,
    Cosine,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum SaveDtype {
    F32,
    Bf16,
    F16,
}

#[derive(Parser, Debug)]
#[command(about = "Supervised fine-tuning of a checkpoint on a JSONL dataset")]
struct Args {
    /// Checkpoint directory to start from (not needed with --resume).
    #[arg(long, required_unless_present = "resume")]
    model: Option<PathBuf>,
    /// JSONL: {"messages": [...]}, {"prompt", "completion"} or {"prompt_ids", "completion_ids"};
    /// or a .parquet file with those columns (each row read as a JSON line).
    #[arg(long)]
    data: PathBuf,
    /// Output directory (the trained model, optimizer and trainer state).
    #[arg(long)]
    out: PathBuf,
    /// Optimizer updates; wins over --epochs.
    #[arg(long)]
    steps: Option<u64>,
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Micro-batches per update.
    #[arg(long, default_value_t = 1)]
    grad_accumulation: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-5)]
    lr: f64,
    #[arg(long, value_enum, default_value_t = Sched::Constant)]
    schedule: Sched,
    /// Linear warm-up updates.
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// Final learning rate of the cosine schedule.
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
    /// Weight decay (AdamW: decoupled, default 0.01; SGD: L2 on the gradient, default 0).
    #[arg(long)]
    weight_decay: Option<f64>,
    #[arg(long, value_enum, default_value_t = Opt::Adamw)]
    optimizer: Opt,
    /// SGD momentum (0 = none).
    #[arg(long, default_value_t = 0.0)]
    momentum: f64,
    /// Clip the global gradient norm (0 = off).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Clamp gradient elements to [-V, V].
    #[arg(long)]
    clip_value: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f64,
    /// Truncate examples to this many tokens.
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Freeze parameters whose names contain this text (repeatable).
    #[arg(long)]
    freeze: Vec<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep the dataset order (no shuffling).
    #[arg(long)]
    no_shuffle: bool,
    /// Continue the run saved in this directory (same data and settings); writes to --out.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Also save a checkpoint to --out every N updates.
    #[arg(long)]
    save_every: Option<u64>,
    #[arg(long, value_enum, default_value_t = SaveDtype::F32)]
    save_dtype: SaveDtype,
    /// Train LoRA adapters of this rank instead of the model's weights.
    #[arg(long)]
    lora_rank: Option<usize>,
    /// Multiplier of the adapters' product (mlx-lm's scale; default 20).
    #[arg(long, requires = "lora_rank", conflicts_with = "lora_alpha")]
    lora_scale: Option<f32>,
    /// PEFT's alpha: the scale is alpha / rank.
    #[arg(long, requires = "lora_rank")]
    lora_alpha: Option<f32>,
    #[arg(long, requires = "lora_rank")]
    lora_dropout: Option<f32>,
    /// Adapt the last N decoder layers (-1: all; default 16, as mlx-lm).
    #[arg(long, requires = "lora_rank", allow_hyphen_values = true)]
    lora_layers: Option<i64>,
    /// Projections to adapt, by path inside a layer (self_attn.q_proj,mlp.down_proj) or full
    /// name (lm_head); default: every linear projection of the layer.
    #[arg(long, requires = "lora_rank", value_delimiter = ',')]
    lora_targets: Vec<String>,
    /// With --lora-rank: also write the model with the adapters fused into its weights.
    #[arg(long, requires = "lora_rank")]
    fuse: bool,
    /// Stop (after an emergency checkpoint) once more than N updates had non-finite gradients.
    #[arg(long, default_value_t = mlx_training::guard::DEFAULT_MAX_NAN_GRADIENTS)]
    max_nan_gradients: u64,
    /// One JSON object per step on stdout, nothing else.
    #[arg(long)]
    json: bool,
    /// Train data parallel over the ranks of an MLX distributed group, `ring` or `nccl` (what
    /// the mlx-models `launch` example passes): each rank computes its share of every batch,
    /// gradients are averaged, and only rank 0 prints and saves.
    #[arg(long, value_parser = ["ring", "nccl"])]
    distributed: Option<String>,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let opts = LoadOptions { dtype: Some(DType::F32), ..Default::default() };
    let resumed = args.resume.as_deref().map(mlx_training::state::resolve_checkpoint).transpose()?;
    let lora_checkpoint = resumed.as_ref().is_some_and(|r| r.join(lora::ADAPTERS_FILE).is_file());
    let source = match (&resumed, &args.model) {
        // a LoRA checkpoint holds adapters only: the model comes from --model, else from
        // adapter_config.json's "model"
        (Some(_), Some(m)) if lora_checkpoint => m.clone(),
        (Some(r), None) if lora_checkpoint => {
            let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(r.join(lora::ADAPTER_CONFIG_FILE))?)?;
            cfg.get("model").and_then(|m| m.as_str()).map(PathBuf::from).ok_or("the LoRA checkpoint names no base model: pass --model")?
        }
        (Some(r), _) => r.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => return Err("--model or --resume is required".into()),
    };
    if resumed.is_some() && args.lora_rank.is_some() {
        return Err("--lora-* settings are taken from the checkpoint when resuming".into());
    }
    let lora_config = args
        .lora_rank
        .map(|rank| {
            let d = LoraConfig::default();
            let scale = match (args.lora_scale, args.lora_alpha) {
                (Some(s), _) => s,
                (None, Some(a)) => a / rank as f32,
                (None, None) => d.scale,
            };
            LoraConfig {
                rank,
                scale,
                dropout: args.lora_dropout.unwrap_or(d.dropout),
                num_layers: args.lora_layers.unwrap_or(d.num_layers),
                keys: (!args.lora_targets.is_empty()).then(|| args.lora_targets.clone()),
                seed: args.seed,
            }
        });
    let examples = mlx_training::load_dataset(&args.data, &TextEncoder::from_dir(&source), args.max_seq_len)?;
    let optimizer = match args.optimizer {
        Opt::Adamw => {
            if args.momentum != 0.0 {
                return Err("--momentum applies to --optimizer sgd".into());
            }
            OptimizerConfig::AdamW(AdamWConfig { weight_decay: args.weight_decay.unwrap_or(0.01), ..Default::default() })
        }
        Opt::Sgd => OptimizerConfig::Sgd(SgdConfig { momentum: args.momentum, weight_decay: args.weight_decay.unwrap_or(0.0), ..Default::default() }),
    };
    let updates_per_epoch = (examples.len().div_ceil(args.batch_size.max(1)).div_ceil(args.grad_accumulation.max(1))) as u64;
    let total = args.steps.unwrap_or(updates_per_epoch * args.epochs);
    let kind = match args.schedule {
        Sched::Constant => ScheduleKind::Constant,
        Sched::Cosine => ScheduleKind::Cosine { min_lr: args.min_lr },
    };
    let config = SftConfig {
        batch_size: args.batch_size,
        grad_accumulation: args.grad_accumulation,
        epochs: args.epochs,
        max_steps: args.steps,
        shuffle: !args.no_shuffle,
        seed: args.seed,
        label_smoothing: args.label_smoothing,
        schedule: Schedule { lr: args.lr, warmup_steps: args.warmup_steps, kind, total_steps: total },
        optimizer,
        clip: ClipConfig { max_norm: (args.max_grad_norm > 0.0).then_some(args.max_grad_norm), max_value: args.clip_value },
        lora: lora_config.clone(),
        max_nan_gradients: args.max_nan_gradients,
        ..Default::default()
    };
    let group = match args.distributed.as_deref() {
        Some(name) => Some(mlx_array::distributed::Group::init(mlx_array::distributed::Backend::parse(name).ok_or("unknown backend")?)?),
        None => None,
    };
    // Rank 0 prints and saves; the other ranks hold the same state.
    let lead = group.as_ref().is_none_or(|g| g.rank() == 0);
    let trainer = match &args.resume {
        Some(r) => {
            if !args.freeze.is_empty() {
                return Err("--freeze is taken from the checkpoint when resuming".into());
            }
            let base = if lora_checkpoint { Some(ParameterTree::load(&source, &opts)?) } else { None };
            SftTrainer::resume_with_base(r, base, &opts, examples, config)?
        }
        None => {
            let mut tree = ParameterTree::load(&source, &opts)?;
            if let Some(l) = &lora_config {
                if !args.freeze.is_empty() {
                    return Err("--freeze does not apply with --lora-rank (the base model is frozen)".into());
                }
                lora::apply_lora(&mut tree, l)?;
            }
            for pat in &args.freeze {
                if tree.freeze(|n| n.contains(pat.as_str())) == 0 {
                    return Err(format!("--freeze {pat:?} matches no trainable parameter").into());
                }
            }
            SftTrainer::new(tree, &opts, examples, config)?
        }
    };
    if args.fuse && trainer.config().lora.is_none() {
        return Err("--fuse applies to LoRA runs".into());
    }
    let mut trainer = match group {
        Some(g) => trainer.with_data_parallel(g),
        None => trainer,
    };
    let save_dtype = match args.save_dtype {
        SaveDtype::F32 => DType::F32,
        SaveDtype::Bf16 => DType::BF16,
        SaveDtype::F16 => DType::F16,
    };
    let bar = (lead && !args.json && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::new(trainer.total_steps());
        b.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}").expect("valid template"));
        b.set_position(trainer.steps_done());
        b
    });
    let mut stdout = std::io::stdout().lock();
    let (mut tokens, mut seconds) = (0usize, 0f64);
    loop {
        let m = match trainer.step() {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e @ TrainError::NanGradients { .. }) => {
                if lead {
                    trainer.save(&args.out, Some(save_dtype))?;
                }
                return Err(format!("{e}; the last finite state is saved in {}", args.out.display()).into());
            }
            Err(e) => return Err(e.into()),
        };
        tokens += m.tokens;
        seconds += m.seconds;
        if args.json && lead {
            serde_json::to_writer(&mut stdout, &m)?;
            writeln!(stdout)?;
            stdout.flush()?;
        }
        if let Some(b) = &bar {
            b.set_position(m.step);
            b.set_message(format!("loss {:.4} lr {:.2e} {:.0} tok/s", m.loss, m.lr, tokens as f64 / seconds.max(1e-9)));
        }
        if lead && args.save_every.is_some_and(|n| n > 0 && m.step % n == 0) {
            trainer.save(&args.out, Some(save_dtype))?;
        }
    }
    if let Some(b) = &bar {
        b.finish();
    }
    if !lead {
        return Ok(());
    }
    if args.fuse {
        trainer.save_fused(&args.out, Some(save_dtype))?;
    } else {
        trainer.save(&args.out, Some(save_dtype))?;
    }
    if !args.json {
        eprintln!("{} updates; saved to {}", trainer.steps_done(), args.out.display());
    }
    Ok(())
}
