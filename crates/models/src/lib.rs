//! # mlx-models
//!
//! Load, run and chat with LLMs on MLX (Linux CPU, CUDA, Apple Metal), from Rust.
//!
//! A model is a function of (tokens, caches): [`ModelRuntime::forward`] appends to a [`Cache`]
//! and returns logits. [`load_model`] reads a checkpoint directory (config.json + safetensors),
//! picking the family from the [`registry`].
//!
//! ```
//! use mlx_models::{load_model, LoadOptions, Logits};
//! use mlx_array::Array;
//! # fn main() -> mlx_models::Result<()> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny/qwen3");
//! let model = load_model(dir, &LoadOptions::default())?.into_lm()?;
//! let mut cache = model.new_cache();
//! let prompt = Array::from_slice(&[1i32, 2, 3], &[1, 3])?;
//! let out = model.forward(&prompt, &mut cache, Logits::Last, false)?;
//! let next = out.logits.unwrap().argmax(-1, false)?.reshape(&[-1])?.to_vec::<u32>()?[0];
//! assert!((next as usize) < model.info().vocab_size);
//! assert_eq!(cache.offset(), 3);
//! # Ok(()) }
//! ```
/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

pub mod batch;
mod batch_generate;
pub mod cache;
pub mod engine;
pub mod calibrate;
pub mod chat;
pub mod config;
mod error;
pub mod families;
pub mod generate;
pub mod kv;
pub mod layers;
pub mod media;
mod model;
pub mod observe;
pub mod ocr;
pub mod random;
pub mod paged;
mod params;
pub mod privacy;
pub mod docunwarp;
pub mod registry;
mod session;
mod runtime;
pub mod weights;

pub use batch_generate::{generate_batch, BatchGenerationResult, BatchSequence};
pub use engine::{Engine, EngineConfig, EngineError, EngineHandle, EngineKv, EngineStats, PromptPasses, Event, RequestHandle, Usage};
pub use cache::{Cache, CacheSnapshot, CacheSpec, LayerKind};
pub use error::{ModelError, Result};
pub use generate::{generate, CancelHandle, FinishReason, GenerateConfig, Generator, Performance, SpeculativeStats, Speculator, Token};
pub use model::{load_model, KvCacheMode, LoadOptions, LoadedModel, Model, QuantizedWeights, TENSOR_PARALLEL_FAMILIES};
pub use paged::PagedConfig;
pub use params::{Parameter, ParameterTree};
pub use layers::LoraSettings;
pub use session::{load_session, ChatConfig, ChatResult, ChatSession, ChatStream, StreamEvent};
pub use random::{create_random_checkpoint, create_random_preset, expected_tensors, preset_config};
pub use runtime::{ForwardOutput, Logits, ModelInfo, ModelRuntime};
