//! Training LLMs on MLX over [`mlx_models::ParameterTree`]: optimizers over named parameters
//! ([`optim`]), optimizer and checkpoint state in mlx-node's layout ([`state`]), SFT datasets
//! ([`data`]) and the supervised fine-tuning loop ([`SftTrainer`]).
//!
//! The library never prints: [`SftTrainer::step`] returns each update's [`StepMetrics`].
pub mod data;
pub mod error;
pub mod optim;
pub mod sft;
pub mod state;

pub use data::{load_jsonl, make_batch, Example, TextEncoder};
pub use error::{Result, TrainError};
pub use optim::{clip_gradients, global_norm, AdamWConfig, ClipConfig, Optimizer, OptimizerConfig, Schedule, ScheduleKind, SgdConfig};
pub use sft::{SftConfig, SftTrainer, StepMetrics};
pub use state::{load_optimizer_state, save_optimizer_state, TrainerState};
