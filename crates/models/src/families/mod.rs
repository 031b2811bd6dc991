//! One module per model family.
pub mod harrier;
pub mod qwen3;
