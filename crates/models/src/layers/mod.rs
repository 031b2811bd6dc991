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
pub(crate) use linear::dequantize_f32;
pub use mlp::{Activation, GatedMlp};
pub use norm::RmsNorm;
pub use rope::{rotate_half_by, DynamicNtk, Rope, RopeAt, RopeScaling};

/// Whether new operations run on the CPU: MLX's default device is not the GPU. The CPU-only
/// tactics (chunked attention, per-expert MoE products) and the CPU's f32 default dtype ask this.
pub(crate) fn runs_on_cpu() -> bool {
    !matches!(mlx_array::default_device(), Ok(mlx_array::Device::Gpu))
}

/// Every array a layer computes with, visited in a fixed order. Gradient checkpointing passes
/// them to [`mlx_array::grad::checkpoint`] as explicit inputs and runs a copy of the layer whose
/// arrays are replaced, in the same order, by the ones the checkpoint hands back
/// ([`decoder::checkpoint_layer`]). Packed quantized weights (never trained) are left out: they
/// stay constants of the checkpointed function.
pub(crate) trait LayerArrays {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut mlx_array::Array));
}

impl LayerArrays for mlx_array::Array {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut mlx_array::Array)) {
        f(self);
    }
}

impl<T: LayerArrays> LayerArrays for Option<T> {
    fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut mlx_array::Array)) {
        if let Some(t) = self {
            t.visit_arrays(f);
        }
    }
}

/// [`LayerArrays`] for a struct whose arrays all sit in the named fields, visited in that order.
macro_rules! layer_arrays {
    ($t:ty { $($field:ident),+ }) => {
        impl $crate::layers::LayerArrays for $t {
            fn visit_arrays(&mut self, f: &mut dyn FnMut(&mut mlx_array::Array)) {
                $($crate::layers::LayerArrays::visit_arrays(&mut self.$field, f);)+
            }
        }
    };
}
pub(crate) use layer_arrays;
