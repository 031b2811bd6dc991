//! # kv-paged
//!
//! A paged KV cache for LLM inference over MLX: a block allocator with reference counts, an LRU
//! free list and chained prefix hashing (vLLM-style automatic prefix caching), sequences over
//! one or more cache groups (full attention, sliding windows), and per-layer K/V storage as MLX
//! arrays with a gather read path for `scaled_dot_product_attention`. The storage starts at
//! [`KvConfig::initial_blocks`] and doubles as blocks are used, up to the budget. Decode inputs
//! that are still being computed join a sequence with [`KvCacheManager::append_pending`] and
//! get their ids (for prefix hashing) later with [`KvCacheManager::resolve`], so a pipelined
//! decode loop never waits for the device to hash blocks.
//!
//! ```
//! use kv_paged::{ExtraKeys, KvCacheManager, KvConfig, KvLayout, KvPool, KvLayerKind, LayerSpec};
//! use mlx_array::{Array, AttentionMask, DType};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let spec = LayerSpec { kind: KvLayerKind::Full, kv_heads: 2, head_dim: 8 };
//! let cfg = KvConfig { block_size: 4, budget_mb: 1.0, dtype_bytes: 4, ..Default::default() };
//! let layout = KvLayout::new(vec![spec; 2], cfg)?;
//! let mut cache = KvCacheManager::new(&layout)?;
//! let mut pool = KvPool::new(&layout, DType::F32)?;
//!
//! let prompt: Vec<u32> = (0..10).collect();
//! let seq = cache.begin(&prompt, ExtraKeys::none())?;
//! assert_eq!(seq.cached_tokens, 0);
//! let step = cache.step(seq.seq, usize::MAX)?; // all 10 prompt tokens
//! let batch = pool.batch(&[&step])?;
//! for layer in 0..2 {
//!     let k = Array::ones(&[1, 2, 10, 8], DType::F32)?; // from the layer's k_proj + rope
//!     pool.write(layer, &batch, &k, &k)?;
//!     let (keys, values) = pool.read(layer, &batch)?;
//!     let q = Array::ones(&[1, 4, 10, 8], DType::F32)?;
//!     let out = q.sdpa(&keys, &values, 0.35, AttentionMask::Causal)?;
//!     assert_eq!(out.shape(), vec![1, 4, 10, 8]);
//! }
//! cache.finish(seq.seq)?;
//!
//! // The same prompt again: the two full blocks (8 tokens) come from the cache.
//! let again = cache.begin(&prompt, ExtraKeys::none())?;
//! assert_eq!(again.cached_tokens, 8);
//! assert_eq!(cache.step(again.seq, usize::MAX)?.start, 8);
//! # Ok(()) }
//! ```
// `is_multiple_of` is newer than the workspace MSRV (1.85).
#![allow(clippy::manual_is_multiple_of)]

mod allocator;
mod error;
mod hash;
mod layout;
mod lru;
mod manager;
mod pool;

pub use allocator::{blocks_for_budget, AllocatorStats, BlockAllocator, BlockId, DEFAULT_BLOCK_SIZE};
pub use error::{Error, Result};
pub use hash::{block_keys, BlockHash, BlockKey, ExtraKeys};
pub use layout::{Attention, Group, KvConfig, KvLayout, KvLayerKind, LayerSpec};
pub use manager::{BlockCopy, Begun, GroupStep, KvCacheManager, ManagerStats, SeqId, Step};
pub use pool::{KvPool, StepBatch};
