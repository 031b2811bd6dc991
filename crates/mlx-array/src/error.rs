//! The one error type of this crate.
use std::path::PathBuf;

/// Everything that can go wrong in an array operation or in weights I/O.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX rejected an operation (bad shapes, unsupported dtype on this backend, ...): MLX's message.
    #[error("MLX error in {op}: {msg}")]
    Mlx { op: &'static str, msg: String },
    /// Shapes that do not fit, caught before MLX sees them.
    #[error("shape error in {op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// A dtype that the operation or the caller does not accept.
    #[error("dtype error in {op}: expected {expected}, got {got}")]
    DType { op: &'static str, expected: String, got: String },
    /// An argument outside its domain (negative group size, k > n, ...).
    #[error("invalid argument to {op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },
    /// File system error, with the path involved.
    #[error("I/O error on {path}: {source}")]
    Io { path: PathBuf, #[source] source: std::io::Error },
    /// A safetensors file (or shard index) that cannot be parsed or does not match its header.
    #[error("invalid safetensors {path}: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    /// A safetensors file shorter than its header says (an interrupted download or copy).
    #[error("truncated safetensors {path}: the header needs {expected} bytes, the file has {actual}")]
    Truncated { path: PathBuf, expected: u64, actual: u64 },
    /// A tensor whose dtype this crate cannot load (`F8_E4M3`, `C64`, a misspelling, ...).
    #[error("tensor {name:?} in {path} has unsupported dtype {dtype:?}")]
    UnknownDType { path: PathBuf, name: String, dtype: String },
    /// A shard file that a `model.safetensors.index.json` names but that does not exist.
    #[error("shard {shard} named by {index} does not exist")]
    MissingShard { index: PathBuf, shard: PathBuf },
    /// A multi-process (distributed) operation failed: a backend missing from this build of
    /// MLX, an environment that describes no group, a collective MLX rejected.
    #[error("distributed {op}: {msg}")]
    Distributed { op: &'static str, msg: String },
    /// A tensor that a caller asked for is not in the checkpoint.
    #[error("tensor {name:?} not found in {path}")]
    MissingTensor { name: String, path: PathBuf },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn mlx(op: &'static str, e: mlx_rs::error::Exception) -> Self {
        // mlx-c appends " at <source path>:<line>" to messages: that is noise for users.
        let what = e.what();
        let msg = match what.rfind(" at /") {
            Some(i) if what[i..].contains(".cpp:") => what[..i].to_string(),
            _ => what.to_string(),
        };
        Error::Mlx { op, msg }
    }
    pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape { op, msg: msg.into() }
    }
    pub(crate) fn arg(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { op, msg: msg.into() }
    }
}

/// `result.op("name")?` turns an mlx-rs result into ours, naming the operation.
pub(crate) trait OpExt<T> {
    fn op(self, op: &'static str) -> Result<T>;
}

impl<T> OpExt<T> for std::result::Result<T, mlx_rs::error::Exception> {
    fn op(self, op: &'static str) -> Result<T> {
        self.map_err(|e| Error::mlx(op, e))
    }
}
