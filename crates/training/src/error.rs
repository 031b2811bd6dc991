//! Errors of the training crate.
use std::path::PathBuf;

/// What can go wrong while preparing data, training, saving or resuming.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
    #[error(transparent)]
    Model(#[from] mlx_models::ModelError),
    #[error(transparent)]
    Chat(#[from] mlx_models::chat::ChatError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A dataset line that is not one of the accepted forms.
    #[error("{path}:{line}: {msg}")]
    Data { path: PathBuf, line: usize, msg: String },
    /// A configuration value out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A saved optimizer or trainer state that does not fit the run it is loaded into.
    #[error("{path}: {msg}")]
    State { path: PathBuf, msg: String },
    /// More updates with non-finite gradients than allowed ([`crate::guard::NanGuard`]): the
    /// run stops; the parameters are those of the last finite update.
    #[error("{skipped} updates had non-finite gradients (at most {max} allowed): training stopped")]
    NanGradients { skipped: u64, max: u64 },
    /// Inputs that do not fit together (parameter and gradient counts or shapes, empty batches).
    #[error("{0}")]
    InvalidInput(String),
    /// The GRPO output store (SQLite, XLSX export).
    #[error("output store: {0}")]
    Store(String),
}

pub type Result<T> = std::result::Result<T, TrainError>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.into();
    move |source| TrainError::Io { path, source }
}
