//! GRPO from the command line, sampling completions or replaying recorded ones.
//!
//! ```text
//! cargo run --release -p mlx-training --example grpo -- --model DIR --prompts F.jsonl --reward length|xml|json|tool
//!     --out OUT_DIR [--group-size G] [--loss grpo|dapo|dr_grpo|bnpo] [--beta B] [--epsilon E]
//!     [--scale-rewards group|batch|none] [--max-completion-length N] [--steps N] [--lr X]
//!     [--optimizer adamw|sgd] [--json]
//! cargo run --release -p mlx-training --example grpo -- --model DIR --rollouts R.jsonl --out OUT_DIR [...]
//! cargo run --release -p mlx-training --example grpo -- --resume CKPT_DIR --prompts F.jsonl|--rollouts R.jsonl --out OUT_DIR [...]
//! ```
//!
//! `--prompts`: each step samples `--group-size` completions of `--prompts-per-step` prompts
//! (taken in file order, cycling) in one batched generation and scores them with the `--reward`
//! functions (comma-separated, weight 1 each). `--rollouts`: each step trains on
//! `--prompts-per-step` recorded groups (`{"group", "prompt_ids", "completion_ids", "reward"}`
//! lines, as the output store's JSONL export writes them), so a step is deterministic.
//!
//! Every step's prompts, completions and rewards go to the SQLite output store (`--store`,
//! default `OUT_DIR.outputs.sqlite` next to OUT_DIR), exportable with `--export-jsonl` and
//! `--export-xlsx`. OUT_DIR receives model.safetensors (f32 unless `--save-dtype`), the config
//! and tokenizer files, optimizer.safetensors and trainer_state.json. When more than
//! `--max-nan-gradients` steps had non-finite gradients, the last finite parameters are saved
//! to OUT_DIR as an emergency checkpoint and the run fails. `--json` prints one JSON object per
//! step on stdout and nothing else; otherwise a progress bar runs on a terminal (stderr).
//!
//! With `--lora-rank R` only LoRA adapters are trained, as in the `sft` example (`--lora-scale` or
//! `--lora-alpha`, `--lora-layers`, `--lora-targets`; GRPO applies no LoRA dropout, so
//! `--lora-dropout` above 0 is refused), and OUT_DIR holds adapters.safetensors and
//! adapter_config.json in place of the model; resuming such a checkpoint takes the base model
//! from `--model`, else from adapter_config.json.
//!
//! `--save-every N` also saves to OUT_DIR after every N steps. `--resume DIR` continues the run
//! saved in DIR (model, optimizer state, step, data position, sampling seed, NaN count, and with
//! `--beta` > 0 the original reference model) and writes to `--out`; it needs the same data
//! file, `--prompts-per-step`, `--seed` and training flags as the saved run, and `--steps`
//! counts from the start of the run. It records into the saved run of the output store (by
//! default the store the saved run used), replacing that run's steps recorded after the
//! checkpoint; with another `--store` it starts a new run there.
mod common;

use clap::{Parser, ValueEnum};
use common::{LoraArgs, OptimizerArgs, SaveDtype};
use mlx_array::DType;
use mlx_models::chat::Tokenizer;
use mlx_models::{LoadOptions, ParameterTree};
use mlx_training::output_store::{GenerationRecord, OutputStore};
use mlx_training::rewards::{
    JsonSchemaReward, LengthReward, RewardSet, ToolUseReward, XmlFormatReward,
};
use mlx_training::{
    compute_advantages, default_rollout_sampling, load_prompts, load_rollouts, rollout_batch,
    ClipConfig, GrpoBatch, GrpoConfig, GrpoData, GrpoTrainer, ImportanceSampling, LossType,
    OutputRun, ScaleRewards, Schedule, TextEncoder, TrainError,
};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum RewardKind {
    Length,
    Xml,
    Json,
    Tool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Loss {
    Grpo,
    Dapo,
    #[value(name = "dr_grpo")]
    DrGrpo,
    Bnpo,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Scale {
    Group,
    Batch,
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Level {
    Token,
    Sequence,
}

#[derive(Parser, Debug)]
#[command(about = "GRPO training on sampled or recorded groups of completions")]
struct Args {
    /// Checkpoint directory to train (not needed with --resume; with a LoRA checkpoint, its base
    /// model when adapter_config.json does not name it).
    #[arg(long, required_unless_present = "resume")]
    model: Option<PathBuf>,
    /// Continue the run saved in this directory (see the module docs).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Also save to --out after every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// JSONL prompts ({"prompt"}, {"messages"} or {"prompt_ids"}) to sample completions for.
    #[arg(
        long,
        required_unless_present = "rollouts",
        conflicts_with = "rollouts",
        requires = "reward"
    )]
    prompts: Option<PathBuf>,
    /// Reward functions for --prompts (comma-separated, weight 1 each).
    #[arg(long, value_enum, value_delimiter = ',', requires = "prompts")]
    reward: Vec<RewardKind>,
    /// JSONL of recorded groups: {"group", "prompt_ids", "completion_ids", "reward"} per line.
    #[arg(long)]
    rollouts: Option<PathBuf>,
    /// Output directory (trained model, optimizer and trainer state).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    /// Prompts (with --rollouts: recorded groups) per step.
    #[arg(long, default_value_t = 1)]
    prompts_per_step: usize,
    #[arg(long, value_enum, default_value_t = Loss::Dapo)]
    loss: Loss,
    /// KL coefficient to the frozen initial model (k3 estimator).
    #[arg(long, default_value_t = 0.0)]
    beta: f64,
    #[arg(long, default_value_t = 0.2)]
    epsilon: f64,
    /// Upper clipping epsilon (default: --epsilon).
    #[arg(long)]
    epsilon_high: Option<f64>,
    #[arg(long, value_enum, default_value_t = Scale::Group)]
    scale_rewards: Scale,
    #[arg(long, value_enum, default_value_t = Level::Token)]
    importance_sampling: Level,
    /// New tokens per completion (a longer recorded completion is an error; dr_grpo divides by it).
    #[arg(long, default_value_t = 512)]
    max_completion_length: usize,
    /// Completions per micro-batch (default: all of a step's).
    #[arg(long)]
    micro_batch_size: Option<usize>,
    /// Steps (default: one pass over the prompts or recorded groups); with --resume, counted
    /// from the start of the run.
    #[arg(long)]
    steps: Option<u64>,
    #[arg(long, default_value_t = 1e-6)]
    lr: f64,
    #[command(flatten)]
    optim: OptimizerArgs,
    #[command(flatten)]
    lora: LoraArgs,
    /// Always run the model's full logits (default: the chunked head where it applies).
    #[arg(long)]
    full_logits: bool,
    /// Recompute each decoder layer's activations in the backward pass instead of keeping
    /// them (less memory, one more forward pass through the layers).
    #[arg(long)]
    grad_checkpoint: bool,
    /// Completion positions per head chunk.
    #[arg(long, default_value_t = 1024)]
    head_chunk: usize,
    /// Skipped non-finite steps allowed before the run stops.
    #[arg(long, default_value_t = 100)]
    max_nan_gradients: u64,
    /// Sampling temperature (--prompts).
    #[arg(long, default_value_t = 0.8, conflicts_with = "rollouts")]
    temperature: f32,
    #[arg(long, default_value_t = 0.95, conflicts_with = "rollouts")]
    top_p: f32,
    #[arg(long, default_value_t = 1.1, conflicts_with = "rollouts")]
    repetition_penalty: f32,
    /// Sampling seed of step s is seed + s (--prompts).
    #[arg(long, default_value_t = 0, conflicts_with = "rollouts")]
    seed: u64,
    /// Length reward: target range in characters (default 50..500).
    #[arg(long, conflicts_with = "rollouts")]
    min_length: Option<usize>,
    #[arg(long, conflicts_with = "rollouts")]
    max_length: Option<usize>,
    /// XML reward: required tags (default thinking,answer).
    #[arg(long, value_delimiter = ',', conflicts_with = "rollouts")]
    xml_tags: Option<Vec<String>>,
    /// JSON reward: required top-level fields (default none).
    #[arg(long, value_delimiter = ',', conflicts_with = "rollouts")]
    json_fields: Option<Vec<String>>,
    /// Tool reward: allowed tool names (default search,calculate,code).
    #[arg(long, value_delimiter = ',', conflicts_with = "rollouts")]
    tools: Option<Vec<String>>,
    /// SQLite output store (default: OUT_DIR.outputs.sqlite).
    #[arg(long)]
    store: Option<PathBuf>,
    /// After training, export this run's completions as JSONL (replayable with --rollouts).
    #[arg(long)]
    export_jsonl: Option<PathBuf>,
    /// After training, export this run's completions as XLSX.
    #[arg(long)]
    export_xlsx: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = SaveDtype::F32)]
    save_dtype: SaveDtype,
    /// One JSON object per step on stdout, nothing else.
    #[arg(long)]
    json: bool,
    /// Train data parallel over the ranks of an MLX distributed group, `ring` or `nccl` (what
    /// the mlx-models `launch` example passes): every rank builds the same global batch (the
    /// same data and seed), computes its share of the batch's micro-batches, the gradients are
    /// summed over the ranks, and only rank 0 prints, records to the output store and saves.
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

fn rewards_of(args: &Args) -> Result<RewardSet, Box<dyn std::error::Error>> {
    let uses = |k: RewardKind| args.reward.contains(&k);
    for (given, kind, flag) in [
        (
            args.min_length.is_some() || args.max_length.is_some(),
            RewardKind::Length,
            "--min-length/--max-length",
        ),
        (args.xml_tags.is_some(), RewardKind::Xml, "--xml-tags"),
        (
            args.json_fields.is_some(),
            RewardKind::Json,
            "--json-fields",
        ),
        (args.tools.is_some(), RewardKind::Tool, "--tools"),
    ] {
        if given && !uses(kind) {
            return Err(format!("{flag} needs --reward {kind:?}")
                .to_lowercase()
                .into());
        }
    }
    let (length, xml, json, tool) = (
        LengthReward::default(),
        XmlFormatReward::default(),
        JsonSchemaReward::default(),
        ToolUseReward::default(),
    );
    let mut set = RewardSet::new();
    for kind in &args.reward {
        match kind {
            RewardKind::Length => set.add(
                LengthReward::new(
                    args.min_length.unwrap_or(length.min_length),
                    args.max_length.unwrap_or(length.max_length),
                    true,
                )?,
                1.0,
            )?,
            RewardKind::Xml => set.add(
                XmlFormatReward {
                    required_tags: args.xml_tags.clone().unwrap_or(xml.required_tags.clone()),
                },
                1.0,
            )?,
            RewardKind::Json => set.add(
                JsonSchemaReward {
                    required_fields: args
                        .json_fields
                        .clone()
                        .unwrap_or(json.required_fields.clone()),
                },
                1.0,
            )?,
            RewardKind::Tool => set.add(
                ToolUseReward {
                    allowed_tools: args.tools.clone().unwrap_or(tool.allowed_tools.clone()),
                    required: true,
                },
                1.0,
            )?,
        };
    }
    Ok(set)
}

/// Where each step's completions come from.
enum Source {
    Sampled {
        prompts: Vec<mlx_training::GrpoPrompt>,
        rewards: RewardSet,
    },
    Recorded(Vec<Vec<mlx_training::Rollout>>),
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let opts = LoadOptions {
        dtype: Some(DType::F32),
        ..Default::default()
    };
    if args.prompts_per_step == 0 {
        return Err("--prompts-per-step must be >= 1".into());
    }
    let start = common::start(args.resume.as_deref(), args.model.as_deref(), &args.lora)?;
    let resumed = start.resumed.clone();
    let model_dir: PathBuf = start.model.clone();
    let tokenizer = Tokenizer::from_dir(&model_dir);
    let source = match (&args.prompts, &args.rollouts) {
        (Some(p), None) => Source::Sampled {
            prompts: load_prompts(p, &TextEncoder::from_dir(&model_dir))?,
            rewards: rewards_of(args)?,
        },
        (None, Some(r)) => Source::Recorded(load_rollouts(r, args.group_size)?),
        _ => return Err("give exactly one of --prompts and --rollouts".into()),
    };
    let available = match &source {
        Source::Sampled { prompts, .. } => prompts.len(),
        Source::Recorded(groups) => groups.len(),
    };
    let steps = args
        .steps
        .unwrap_or(available.div_ceil(args.prompts_per_step) as u64);
    let optimizer = args.optim.config()?;
    let config = GrpoConfig {
        group_size: args.group_size,
        loss: match args.loss {
            Loss::Grpo => LossType::Grpo,
            Loss::Dapo => LossType::Dapo,
            Loss::DrGrpo => LossType::DrGrpo,
            Loss::Bnpo => LossType::Bnpo,
        },
        beta: args.beta,
        epsilon: args.epsilon,
        epsilon_high: args.epsilon_high,
        scale_rewards: match args.scale_rewards {
            Scale::Group => ScaleRewards::Group,
            Scale::Batch => ScaleRewards::Batch,
            Scale::None => ScaleRewards::None,
        },
        importance_sampling: match args.importance_sampling {
            Level::Token => ImportanceSampling::Token,
            Level::Sequence => ImportanceSampling::Sequence,
        },
        max_completion_length: args.max_completion_length,
        micro_batch_size: args.micro_batch_size,
        schedule: Schedule {
            lr: args.lr,
            ..Default::default()
        },
        optimizer,
        clip: ClipConfig {
            max_norm: args.optim.max_norm(),
            max_value: None,
        },
        max_nan_gradients: args.max_nan_gradients,
        chunked_head: !args.full_logits,
        gradient_checkpointing: args.grad_checkpoint,
        head_chunk: args.head_chunk,
        pad_id: None,
    };
    let sampling = default_rollout_sampling();
    let sampling = sampling::SamplingConfig {
        temperature: args.temperature,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        ..sampling
    };
    sampling.validate()?;
    let data = GrpoData {
        items: available,
        per_step: args.prompts_per_step,
        seed: args.seed,
    };
    let group = match args.distributed.as_deref() {
        Some(name) => Some(mlx_array::distributed::Group::init(
            mlx_array::distributed::Backend::parse(name).ok_or("unknown backend")?,
        )?),
        None => None,
    };
    // Rank 0 prints, records and saves; the other ranks hold the same state.
    let lead = group.as_ref().is_none_or(|g| g.rank() == 0);
    let trainer = match &resumed {
        Some(r) => {
            let base = if start.lora_checkpoint {
                Some(ParameterTree::load(&model_dir, &opts)?)
            } else {
                None
            };
            GrpoTrainer::resume_with_base(r, base, &opts, config.clone(), Some(data))?
        }
        None => {
            let mut tree = ParameterTree::load(&model_dir, &opts)?;
            let lora = args.lora.config(args.seed);
            if let Some(l) = &lora {
                mlx_training::lora::apply_lora(&mut tree, l)?;
            }
            let t = GrpoTrainer::new(tree, None, &opts, config.clone())?;
            match lora {
                Some(l) => t.with_lora(l)?,
                None => t,
            }
            .with_data(data)?
        }
    };
    let mut trainer = match group {
        Some(g) => trainer.with_data_parallel(g),
        None => trainer,
    };
    let save_dtype = args.save_dtype.dtype();
    let saved_run = trainer.output_run().cloned();
    let store_path = args
        .store
        .clone()
        .or_else(|| saved_run.as_ref().map(|o| o.store.clone()))
        .unwrap_or_else(|| {
            let name = args
                .out
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "grpo".into());
            args.out.with_file_name(format!("{name}.outputs.sqlite"))
        });
    if !lead {
        return follow(&mut trainer, &source, &sampling, steps, &decode_with(&tokenizer));
    }
    if let Some(parent) = store_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let mut store = OutputStore::open(&store_path)?;
    let run_config = serde_json::json!({
        "group_size": args.group_size, "loss": format!("{:?}", config.loss), "beta": args.beta, "epsilon": args.epsilon,
        "epsilon_high": args.epsilon_high, "scale_rewards": format!("{:?}", config.scale_rewards),
        "importance_sampling": format!("{:?}", config.importance_sampling), "lr": args.lr, "steps": steps,
        "source": if args.prompts.is_some() { "prompts" } else { "rollouts" },
    });
    let same_store =
        |a: &std::path::Path, b: &std::path::Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
    let run_id = match &saved_run {
        Some(o) if same_store(&o.store, &store_path) && store.has_run(o.run_id)? => {
            store.truncate_run(o.run_id, trainer.batches_done())?;
            o.run_id
        }
        _ => store.start_run(
            &args.out.display().to_string(),
            &model_dir.display().to_string(),
            &run_config,
        )?,
    };
    trainer.set_output_run(Some(OutputRun {
        store: store_path.canonicalize()?,
        run_id,
    }));
    let decode = decode_with(&tokenizer);
    let bar = common::progress_bar(args.json, steps, trainer.batches_done().min(steps));
    let mut stdout = std::io::stdout().lock();
    while trainer.batches_done() < steps {
        let s = trainer.batches_done();
        let picks = trainer
            .next_items()
            .ok_or("the trainer has no data layout")?;
        let seed = trainer
            .sampling_seed()
            .ok_or("the trainer has no data layout")?;
        let (batch, prompt_texts, completion_texts, finish) =
            next_batch(&trainer, &source, &picks, &sampling.clone().with_seed(seed), &decode)?;
        let metrics = match trainer.step(&batch) {
            Ok(m) => m,
            Err(e @ TrainError::NanGradients { .. }) => {
                trainer.save(&args.out, Some(save_dtype))?;
                return Err(format!(
                    "{e}; emergency checkpoint of the last finite parameters in {}",
                    args.out.display()
                )
                .into());
            }
            Err(e) => return Err(e.into()),
        };
        let totals = batch.total_rewards();
        let advantages = compute_advantages(&totals, args.group_size, config.scale_rewards)?;
        let group0 = store.next_group_id(run_id)?;
        let records: Vec<GenerationRecord> = batch
            .completions
            .iter()
            .enumerate()
            .map(|(i, c)| GenerationRecord {
                group_id: group0 + (i / args.group_size) as i64,
                prompt: prompt_texts[i].clone(),
                completion: completion_texts[i].clone(),
                prompt_ids: c.prompt_ids.clone(),
                completion_ids: c.completion_ids.clone(),
                reward: totals[i],
                rewards: batch
                    .reward_names
                    .iter()
                    .cloned()
                    .zip(c.rewards.iter().copied())
                    .collect(),
                advantage: advantages[i],
                finish_reason: finish[i].clone(),
            })
            .collect();
        store.record_step(run_id, s + 1, &metrics, &records)?;
        if args.save_every > 0 && (s + 1) % args.save_every == 0 {
            trainer.save(&args.out, Some(save_dtype))?;
        }
        if args.json {
            common::json_line(&mut stdout, &metrics)?;
        }
        if let Some(b) = &bar {
            b.set_position(s + 1);
            b.set_message(format!(
                "loss {:.4} reward {:.3} {:.0} tok/s",
                metrics.loss, metrics.reward_mean, metrics.tokens_per_second
            ));
        }
    }
    if let Some(b) = &bar {
        b.finish();
    }
    trainer.save(&args.out, Some(save_dtype))?;
    if let Some(p) = &args.export_jsonl {
        store.export_jsonl(Some(run_id), p)?;
    }
    if let Some(p) = &args.export_xlsx {
        store.export_xlsx(Some(run_id), p)?;
    }
    if !args.json {
        eprintln!(
            "{} updates ({} skipped steps); saved to {}; outputs in {}",
            trainer.steps_done(),
            trainer.nan_skipped(),
            args.out.display(),
            store_path.display()
        );
    }
    Ok(())
}

/// `decode` for the sampler and the store: the tokenizer's text of some ids.
fn decode_with<E: std::fmt::Display>(
    tokenizer: &Result<Tokenizer, E>,
) -> impl Fn(&[u32]) -> Result<String, String> + '_ {
    move |ids: &[u32]| match tokenizer {
        Ok(t) => t.decode(ids, true).map_err(|e| e.to_string()),
        Err(e) => Err(format!("no tokenizer: {e}")),
    }
}

/// A step's batch for the items `picks`: sampled (with `sampling`) and scored, or recorded;
/// with its prompt and completion texts and finish reasons.
type StepBatch = (GrpoBatch, Vec<String>, Vec<String>, Vec<String>);

fn next_batch(
    trainer: &GrpoTrainer,
    source: &Source,
    picks: &[usize],
    sampling: &sampling::SamplingConfig,
    decode: &dyn Fn(&[u32]) -> Result<String, String>,
) -> Result<StepBatch, Box<dyn std::error::Error>> {
    Ok(match source {
        Source::Sampled { prompts, rewards } => {
            let chosen: Vec<_> = picks.iter().map(|&i| prompts[i].clone()).collect();
            let sampled = trainer.sample(&chosen, rewards, sampling, None, decode)?;
            (
                sampled.batch,
                sampled.prompt_texts,
                sampled.completion_texts,
                sampled.finish_reasons,
            )
        }
        Source::Recorded(groups) => {
            let chosen: Vec<Vec<mlx_training::Rollout>> =
                picks.iter().map(|&i| groups[i].clone()).collect();
            let batch = rollout_batch(&chosen)?;
            let texts = |ids: &[u32]| decode(ids).unwrap_or_default();
            let p: Vec<String> = batch
                .completions
                .iter()
                .map(|c| texts(&c.prompt_ids))
                .collect();
            let c: Vec<String> = batch
                .completions
                .iter()
                .map(|c| texts(&c.completion_ids))
                .collect();
            let n = batch.completions.len();
            (batch, p, c, vec!["recorded".to_string(); n])
        }
    })
}

/// A data-parallel rank other than 0: the same steps as rank 0 (the same batches, its share of
/// the gradients, the same updates), printing, recording and saving nothing.
fn follow(
    trainer: &mut GrpoTrainer,
    source: &Source,
    sampling: &sampling::SamplingConfig,
    steps: u64,
    decode: &dyn Fn(&[u32]) -> Result<String, String>,
) -> Result<(), Box<dyn std::error::Error>> {
    while trainer.batches_done() < steps {
        let picks = trainer.next_items().ok_or("the trainer has no data layout")?;
        let seed = trainer.sampling_seed().ok_or("the trainer has no data layout")?;
        let (batch, ..) = next_batch(trainer, source, &picks, &sampling.clone().with_seed(seed), decode)?;
        trainer.step(&batch)?;
    }
    Ok(())
}
