//! Supervised fine-tuning from the command line.
//!
//! ```text
//! cargo run --release -p mlx-training --example sft -- --model DIR --data F.jsonl --out OUT_DIR
//!     [--steps N] [--epochs E] [--batch-size B] [--lr X] [--weight-decay W] [--optimizer adamw|sgd]
//!     [--max-grad-norm G (0 = off)] [--seed S] [--resume OUT_DIR] [--json]
//! ```
//!
//! Writes OUT_DIR/model.safetensors (f32 unless `--save-dtype`), the config and tokenizer files,
//! OUT_DIR/optimizer.safetensors (AdamW moments, or SGD momentum buffers) and
//! OUT_DIR/trainer_state.json. `--json` prints one JSON object per step on stdout and nothing
//! else; otherwise a progress bar runs on a terminal (stderr).
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_array::DType;
use mlx_models::{LoadOptions, ParameterTree};
use mlx_training::{load_jsonl, AdamWConfig, ClipConfig, OptimizerConfig, Schedule, ScheduleKind, SftConfig, SftTrainer, SgdConfig, TextEncoder};
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
    /// JSONL: {"messages": [...]}, {"prompt", "completion"} or {"prompt_ids", "completion_ids"}.
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
    let source = match (&args.resume, &args.model) {
        (Some(r), _) => mlx_training::state::resolve_checkpoint(r)?,
        (None, Some(m)) => m.clone(),
        (None, None) => return Err("--model or --resume is required".into()),
    };
    let examples = load_jsonl(&args.data, &TextEncoder::from_dir(&source), args.max_seq_len)?;
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
            SftTrainer::resume(r, &opts, examples, config)?
        }
        None => {
            let mut tree = ParameterTree::load(&source, &opts)?;
            for pat in &args.freeze {
                if tree.freeze(|n| n.contains(pat.as_str())) == 0 {
                    return Err(format!("--freeze {pat:?} matches no trainable parameter").into());
                }
            }
            SftTrainer::new(tree, &opts, examples, config)?
        }
    };
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
    while let Some(m) = trainer.step()? {
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
    trainer.save(&args.out, Some(save_dtype))?;
    if !args.json {
        eprintln!("{} updates; saved to {}", trainer.steps_done(), args.out.display());
    }
    Ok(())
}
