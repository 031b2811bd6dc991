//! # mlx-speculative
//!
//! Speculative decoding over [`mlx_models`]: a [`Drafter`] proposes up to `k` tokens, the target
//! model scores the newest token and all proposals in one forward call, and the verifier keeps
//! what the target agrees with, plus one token of the target's own ([`verify`]). The output is
//! distributed exactly as plain sampling with the same sampler settings (penalties and filters
//! included); at temperature 0 it is the target's greedy output, token for token.
//!
//! Drafters: [`DraftModel`] (any LM sharing the target's vocabulary), [`MtpDrafter`] (Qwen3.5's
//! multi-token-prediction head), [`AssistantDrafter`] (Gemma 4 `gemma4_assistant` drafts) and
//! [`BlockDrafter`] (DSpark and DFlash block drafts over the target's residual stream);
//! [`load_drafter_for`] reads the kind from the draft's config.json.
//!
//! At temperature 0 a draft model also drafts ahead while the target verifies
//! ([`SpeculativeDecoder::with_draft_ahead`]; on a GPU by default on a thread of its own,
//! [`DraftAhead::Background`], which builds its graphs while this thread builds and runs the
//! verify forward): the next cycle's first draft forwards run on the guess that every draft is
//! accepted.
//!
//! Rollback works with every cache: flat and paged K/V are trimmed; rotating (sliding-window)
//! K/V and recurrent state (GatedDeltaNet, LFM2's short conv) return to a snapshot taken before
//! the verify step (arrays are immutable, so a snapshot is the previous arrays) and the accepted
//! tokens are run again.
//!
//! ```no_run
//! use mlx_models::{generate, load_model, GenerateConfig, LoadOptions};
//! use mlx_speculative::{DraftModel, SpeculativeDecoder};
//! # fn main() -> mlx_models::Result<()> {
//! let target = load_model("Qwen3-8B", &LoadOptions::default())?.into_lm()?;
//! let draft = load_model("Qwen3-0.6B", &LoadOptions::default())?.into_lm()?;
//! let mut spec = SpeculativeDecoder::new(Box::new(DraftModel::new(draft)), Some(4));
//! let mut cache = target.new_cache();
//! let mut gen = generate(&target, &mut cache, &[1, 2, 3], GenerateConfig::default())?.with_speculator(&mut spec);
//! for t in &mut gen {
//!     print!("{} ", t?.id);
//! }
//! println!("{:?}", gen.performance().speculative);
//! # Ok(()) }
//! ```
mod adaptive;
mod assistant;
mod background;
mod block;
mod decoder;
mod drafter;
mod forward;
mod load;
mod mtp;
mod tracked;
pub mod verify;

pub use adaptive::Adaptive;
pub use assistant::AssistantDrafter;
pub use background::Background;
pub use block::{create_random_block_draft, BlockConfig, BlockDrafter, BlockNet, BlockTrace};
pub use decoder::{Depth, DraftAhead, SpeculativeDecoder};
pub use drafter::{Agreed, Draft, DraftModel, Drafter, Feedback};
pub use load::{draft_kind, embedded_draft_dir, load_drafter, load_drafter_for, DraftKind};
pub use mtp::MtpDrafter;
pub use verify::Verdict;

/// What [`forward_drafter!`]'s expansion names, for crates that do not depend on these.
#[doc(hidden)]
pub mod __macro_support {
    pub use mlx_models::{Cache, Result};
    pub use sampling::SamplingConfig;
}
