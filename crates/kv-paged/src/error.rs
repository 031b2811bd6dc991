//! The error type of this crate.

/// Everything that can go wrong in the paged KV cache. Bad input is an error, never a panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not enough free blocks (counting evictable cached blocks) for a request. The caller can
    /// finish or preempt a sequence and retry, or refuse the request.
    #[error("out of KV blocks in group {group}: need {needed}, {free} free of {total}")]
    OutOfBlocks { group: usize, needed: usize, free: usize, total: usize },
    /// A configuration or argument outside its domain (zero block size, budget too small, ...).
    #[error("invalid KV cache configuration: {0}")]
    Config(String),
    /// A block id that is not in this allocator, or not in the state the operation needs.
    #[error("invalid block {block}: {msg}")]
    Block { block: u32, msg: String },
    /// A sequence id that is unknown (never begun, or already finished).
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    /// A trim that would need keys a sliding-window group has already released.
    #[error("cannot trim to {keep} tokens: group {group} released the blocks before position {released_before}")]
    TrimBeyondWindow { group: usize, keep: usize, released_before: usize },
    /// A trim past the end, or another argument about token counts that does not fit.
    #[error("invalid token count: {0}")]
    Tokens(String),
    /// A layer index, shape or dtype that does not fit the pool.
    #[error("KV pool: {0}")]
    Pool(String),
    /// An MLX operation failed.
    #[error(transparent)]
    Array(#[from] mlx_array::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
