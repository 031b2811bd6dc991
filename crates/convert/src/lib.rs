//! # mlx-convert
//!
//! Checkpoint conversion for mlx-models: GGUF import ([`gguf`]: reader, dequantization, and
//! [`gguf::to_hf`] for a Hugging Face directory) and MLX quantization in mlx-lm's layout
//! ([`quantize`]), written atomically ([`output`]).
use std::path::PathBuf;

pub mod gguf;
pub mod output;
pub mod quantize;

pub use gguf::to_hf::{convert as gguf_to_hf, ConvertSummary, GgufToHfOptions, Progress};
pub use output::OutDtype;
pub use quantize::{quantize_dir, QuantizeOptions, QuantizeSummary, Recipe};

/// Why a conversion failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("GGUF architecture {arch:?} is not supported (supported: {supported})")]
    UnsupportedArchitecture { arch: String, supported: String },
    #[error("tensor {tensor:?} has no Hugging Face name in a {arch} checkpoint")]
    UnmappedTensor { tensor: String, arch: String },
    #[error("GGUF metadata: {0}")]
    BadMetadata(String),
    #[error("{reason}: pass the model's Hugging Face directory as config_from (--config-from)")]
    NeedsConfig { reason: String },
    #[error("{path}: {msg}")]
    BadConfig { path: PathBuf, msg: String },
    #[error("config.json {key} = {config}, but the GGUF says {gguf}")]
    ConfigMismatch { key: String, config: String, gguf: String },
    #[error("output path {0} has no directory name")]
    BadOutput(PathBuf),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
    #[error("{0} is already quantized (config.json has quantization)")]
    AlreadyQuantized(PathBuf),
    #[error("{0}")]
    BadOption(String),
    #[error("tensor {name}: {msg}")]
    BadTensor { name: String, msg: String },
    #[error("internal error: {0}")]
    Internal(String),
}
