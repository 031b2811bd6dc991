//! One module per model family.
pub mod gated_delta;
pub mod gemma3;
pub mod gemma4;
pub mod gemma4_audio;
pub mod gemma4_media;
pub mod gemma4_vision;
pub mod harrier;
pub mod internvl;
pub mod lfm2;
pub mod llama;
pub mod moe;
pub mod paddleocr_vl;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_vl;
mod qwen3_5_mtp;
