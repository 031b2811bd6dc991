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
//! OUT_DIR (an emergency checkpoint, resumable). `--grad-checkpoint` recomputes each decoder layer's
//! activations in the backward pass instead of keeping them (less memory). `--json` prints one JSON object per step on
//! stdout and nothing else; otherwise a progress bar runs on a terminal (stderr).
mod common;

use clap::{Parser, ValueEnum};
use common::{LoraArgs, OptimizerArgs, SaveDtype};
use mlx_array::DType;
use mlx_models::{LoadOptions, ParameterTree};
use mlx_training::lora;
use mlx_training::{ClipConfig, Schedule, ScheduleKind, SftConfig, SftTrainer, TextEncoder, TrainError};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Sched {
    Constant,
    Cosine,
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
    #[command(flatten)]
    optim: OptimizerArgs,
    /// Clamp gradient elements to [-V, V].
    #[arg(long)]
    clip_value: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f64,
    /// Recompute each decoder layer's activations in the backward pass instead of keeping
    /// them (less memory, one more forward pass through the layers).
    #[arg(long)]
    grad_checkpoint: bool,
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
    #[command(flatten)]
    lora: LoraArgs,
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
    let start = common::start(args.resume.as_deref(), args.model.as_deref(), &args.lora)?;
    let source = start.model.clone();
    let lora_config = args.lora.config(args.seed);
    let examples = mlx_training::load_dataset(&args.data, &TextEncoder::from_dir(&source), args.max_seq_len)?;
    let optimizer = args.optim.config()?;
    args.optim.apply_cpu_fusion();
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
        clip: ClipConfig { max_norm: args.optim.max_norm(), max_value: args.clip_value },
        lora: lora_config.clone(),
        max_nan_gradients: args.max_nan_gradients,
        gradient_checkpointing: args.grad_checkpoint,
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
            let base = if start.lora_checkpoint { Some(ParameterTree::load(&source, &opts)?) } else { None };
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
    let save_dtype = args.save_dtype.dtype();
    let bar = common::progress_bar(!lead || args.json, trainer.total_steps(), trainer.steps_done());
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
            common::json_line(&mut stdout, &m)?;
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
