//! One module per model family.
pub mod harrier;
pub mod lfm2;
pub mod qwen3;
