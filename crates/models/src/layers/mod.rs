//! Building blocks shared by every family.
mod attention;
pub(crate) mod decoder;
mod linear;
mod mlp;
mod norm;
pub mod parallel;
mod rope;

pub use decoder::LmHead;
pub use attention::{causal_mask, Attention, AttentionConfig};
pub(crate) use attention::{last_query_mask, mask_window, sdpa};
pub use linear::{Embedding, FusedLinear, Linear, LoraSettings};
pub use mlp::{Activation, GatedMlp};
pub use norm::RmsNorm;
pub use rope::{rotate_half_by, DynamicNtk, Rope, RopeAt, RopeScaling};

/// Whether new operations run on the CPU: MLX's default device is not the GPU. The CPU-only
/// tactics (chunked attention, per-expert MoE products) and the CPU's f32 default dtype ask this.
pub(crate) fn runs_on_cpu() -> bool {
    !matches!(mlx_array::default_device(), Ok(mlx_array::Device::Gpu))
}
