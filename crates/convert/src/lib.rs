//! # mlx-convert
//!
//! Checkpoint conversion for mlx-models: GGUF import, MLX quantization on write, random checkpoints.

pub mod gguf;
