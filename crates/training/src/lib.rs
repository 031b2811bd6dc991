//! Training LLMs on MLX over [`mlx_models::ParameterTree`]: optimizers over named parameters
//! ([`optim`]), optimizer and checkpoint state in mlx-node's layout ([`state`]), SFT datasets
//! ([`data`], Parquet: [`parquet_data`]), the supervised fine-tuning loop ([`SftTrainer`]),
//! LoRA adapters in mlx-lm's layout ([`lora`]) and the NaN-gradient guard ([`guard`]); GRPO
//! ([`GrpoTrainer`], with [`rewards`] and the SQLite [`output_store`]).
//!
//! The library never prints: [`SftTrainer::step`] returns each update's [`StepMetrics`].
//!
//! ```no_run
//! use mlx_models::{LoadOptions, ParameterTree};
//! use mlx_training::{load_jsonl, SftConfig, SftTrainer, TextEncoder};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("path/to/Qwen3-0.6B");
//! let opts = LoadOptions { dtype: Some(mlx_array::DType::F32), ..Default::default() };
//! let examples = load_jsonl("train.jsonl".as_ref(), &TextEncoder::from_dir(dir), Some(1024))?;
//! let mut tree = ParameterTree::load(dir, &opts)?;
//! tree.freeze(|name| name.contains("embed_tokens"));
//! let mut trainer = SftTrainer::new(tree, &opts, examples, SftConfig { max_steps: Some(100), ..Default::default() })?;
//! while let Some(m) = trainer.step()? {
//!     eprintln!("step {} loss {:.4} grad norm {:.3}", m.step, m.loss, m.grad_norm);
//! }
//! trainer.save("out".as_ref(), None)?; // model, optimizer and trainer state, atomically
//! # Ok(()) }
//! ```
pub mod data;
pub mod distributed;
pub mod error;
pub mod grpo;
pub mod guard;
pub mod lora;
pub mod optim;
pub mod output_store;
pub mod rewards;
pub mod parquet_data;
pub mod sft;
pub mod state;

pub use data::{load_jsonl, make_batch, Example, TextEncoder};
pub use error::{Result, TrainError};
pub use grpo::{compute_advantages, default_rollout_sampling, load_prompts, load_rollouts, rollout_batch, GrpoPrompt, SampledGroups, Completion, Rollout, GrpoBatch, GrpoConfig, GrpoData, GrpoLoss, GrpoStepMetrics, GrpoTrainer, ImportanceSampling, LossType, RewardStats, OutputRun, ScaleRewards};
pub use lora::{apply_lora, fuse_lora, load_adapters, save_adapters, save_model, LoraConfig};
pub use parquet_data::{convert_parquet_to_jsonl, load_dataset, ConversionResult};
pub use optim::{clip_gradients, global_norm, AdamWConfig, ClipConfig, Optimizer, OptimizerConfig, Schedule, ScheduleKind, SgdConfig};
pub use sft::{SftConfig, SftTrainer, StepMetrics};
pub use state::{load_optimizer_state, save_optimizer_state, TrainerState};
