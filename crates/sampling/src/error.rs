//! The error type of this crate.

/// Invalid sampling settings or inputs, or an array operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    /// `temperature` must be finite and `>= 0` (0 selects greedy decoding).
    #[error("temperature must be finite and >= 0 (0 = greedy), got {0}")]
    Temperature(f32),
    /// `top_p` must lie in `(0, 1]` (1 disables it).
    #[error("top_p must be in (0, 1] (1 = disabled), got {0}")]
    TopP(f32),
    /// `min_p` must lie in `[0, 1]` (0 disables it).
    #[error("min_p must be in [0, 1] (0 = disabled), got {0}")]
    MinP(f32),
    /// `repetition_penalty` must be finite and `> 0` (1 disables it).
    #[error("repetition_penalty must be finite and > 0 (1 = disabled), got {0}")]
    RepetitionPenalty(f32),
    /// A setting that must be finite is NaN or infinite.
    #[error("{field} must be finite, got {value}")]
    NotFinite { field: &'static str, value: f32 },
    /// A logit bias that is NaN or `+inf` (`-inf` is allowed: it bans the token).
    #[error("logit_bias for token {token} must be finite or -inf, got {value}")]
    LogitBias { token: u32, value: f32 },
    /// A stop-guard setting outside its domain.
    #[error("invalid stop guard setting: {0}")]
    StopGuard(String),
    /// A token id (in the history or the logit bias) that is not below the vocabulary size.
    #[error("token id {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// Logits or history of the wrong shape.
    #[error("shape error: {0}")]
    Shape(String),
    /// An array operation failed.
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
}

/// `Result` with [`SamplingError`].
pub type Result<T> = std::result::Result<T, SamplingError>;
