//! # mlx-models
//!
//! Load, run and chat with LLMs on MLX.
pub mod chat;
