//! Errors of model loading, running and chatting.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The array layer failed (MLX message inside).
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
    /// The logits of a generation step were NaN or +inf (the sampled token's log-prob says so):
    /// the weights or the activations overflowed. Generation stops instead of emitting tokens
    /// drawn from garbage.
    #[error("non-finite logits at generated token {step} (sampled token log-prob {logprob}): NaN or infinite activations")]
    NonFiniteLogits { step: usize, logprob: f32 },
    /// `config.json` is absent or unreadable.
    #[error("Cannot detect model type: config.json not found in {}", .0.display())]
    ConfigNotFound(PathBuf),
    /// `config.json` parses but has the wrong structure (or is not JSON at all).
    #[error("Malformed config.json in {}: {reason}", path.display())]
    MalformedConfig { path: PathBuf, reason: String },
    /// `model_type` names no family we support.
    #[error("Unsupported model_type \"{model_type}\" in {}/config.json", path.display())]
    UnsupportedModelType { path: PathBuf, model_type: String },
    /// A load option the family does not accept.
    #[error("{0}")]
    UnsupportedOption(String),
    /// The checkpoint's tensors do not match what the config describes.
    #[error("checkpoint {}: {msg}", path.display())]
    Checkpoint { path: PathBuf, msg: String },
    /// Bad arguments to a model call (shapes, token ids out of range, ...).
    #[error("{0}")]
    InvalidInput(String),
    /// An embedding model was asked to chat, or a chat model to embed.
    #[error("{0}")]
    WrongKind(String),
    /// Chat-side failure (template, tokenizer, messages).
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// File system error with its path.
    #[error("I/O error on {}: {source}", path.display())]
    Io { path: PathBuf, #[source] source: std::io::Error },
    /// KV-cache block pool exhausted or misused.
    #[error("KV cache: {0}")]
    Cache(String),
    /// Privacy-filter labels, calibration or options.
    #[error(transparent)]
    Privacy(#[from] crate::privacy::PrivacyError),
    /// A thread running part of the work (a draft model drafting in the background) stopped
    /// before answering: it panicked.
    #[error("worker thread: {0}")]
    Worker(String),
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
}
