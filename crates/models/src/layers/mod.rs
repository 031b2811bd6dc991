//! Building blocks shared by every family.
mod attention;
mod linear;
mod mlp;
mod norm;
mod rope;

pub use attention::{causal_mask, Attention, AttentionConfig, CPU_QUERY_CHUNK};
pub(crate) use attention::sdpa;
pub(crate) use attention::last_query_mask;
pub use linear::{Embedding, FusedLinear, Linear};
pub use mlp::{Activation, GatedMlp};
pub use norm::RmsNorm;
pub use rope::Rope;
