//! The paged KV cache ([`kv_paged`]) behind a model: one block pool per loaded model, shared by
//! every sequence (so chat sessions on one model share cached prompt prefixes), and one
//! sequence per [`Cache`](crate::Cache).
//!
//! A forward call on a paged cache hashes the new tokens' full blocks; on the first call of a
//! sequence, blocks already in the pool (same tokens from the start, same extra keys) are
//! reused and their tokens are not recomputed: the outputs then cover only the computed suffix
//! ([`crate::ForwardOutput::skipped`] says how many were skipped).
use crate::cache::{CacheSpec, LayerKind};
use crate::{ModelError, Result};
use kv_paged::{ExtraKeys, KvCacheManager, KvConfig, KvLayout, KvPool, LayerSpec, SeqId};
use mlx_array::DType;
use std::sync::{Arc, Mutex};

/// Paged cache settings.
#[derive(Debug, Clone)]
pub struct PagedConfig {
    /// Tokens per block (seed default 16).
    pub block_size: usize,
    /// Memory for all K/V, in MB; `None`: enough for `max_position_embeddings` tokens of every
    /// attention layer, capped at 2048 MB.
    pub memory_mb: Option<f64>,
    /// Concurrent sequences sliding-window groups are sized for.
    pub max_seqs: usize,
    /// Attention layers also keep each live sequence's K/V in a contiguous per-sequence buffer
    /// (the flat cache: rotating for sliding-window layers), and attention reads it instead of
    /// gathering the sequence's blocks out of the pool every step. The pool is still written
    /// every step (prefix sharing, rollback and copy-on-write work as without it); the buffer is
    /// filled from the pool when a sequence starts on cached blocks or rolls back further than
    /// a rotating buffer keeps. Costs the flat cache's memory for live sequences on top of the
    /// pool; on the CPU backend it makes paged decode as fast as flat decode (the per-step
    /// gather and its fresh buffers cost a third of a small model's decode step).
    pub contiguous_reads: bool,
}

impl Default for PagedConfig {
    fn default() -> Self {
        PagedConfig { block_size: 16, memory_mb: None, max_seqs: 8, contiguous_reads: true }
    }
}

pub(crate) fn err(e: kv_paged::Error) -> ModelError {
    ModelError::Cache(e.to_string())
}

/// Block pool, sequences and K/V storage of one model.
pub struct PagedKv {
    pub(crate) manager: KvCacheManager,
    pub(crate) pool: KvPool,
    /// Model layer -> pool layer (attention layers only).
    pub(crate) layer_map: Vec<Option<usize>>,
    /// [`PagedConfig::contiguous_reads`].
    pub(crate) contiguous_reads: bool,
}

impl PagedKv {
    pub fn new(spec: &CacheSpec, cfg: &PagedConfig, dtype: DType, max_positions: usize) -> Result<Self> {
        let mut layer_map = Vec::new();
        let mut specs: Vec<LayerSpec> = Vec::new();
        let mut pool_index = Vec::new();
        for k in &spec.layers {
            let s = match *k {
                LayerKind::Attention { kv_heads, head_dim } => Some(LayerSpec { kind: kv_paged::LayerKind::Full, kv_heads, head_dim }),
                LayerKind::SlidingAttention { kv_heads, head_dim, window } => {
                    Some(LayerSpec { kind: kv_paged::LayerKind::Sliding { window }, kv_heads, head_dim })
                }
                LayerKind::SharedKv { anchor } => {
                    let a: Option<usize> = pool_index.get(anchor).copied().flatten();
                    let a = a.ok_or_else(|| ModelError::Cache(format!("shared layer's anchor {anchor} has no K/V")))?;
                    let sa = specs[a];
                    Some(LayerSpec { kind: kv_paged::LayerKind::Shared { anchor: a }, ..sa })
                }
                LayerKind::Recurrent { .. } => None,
            };
            let idx = s.map(|s| {
                specs.push(s);
                specs.len() - 1
            });
            pool_index.push(idx);
            layer_map.push(idx);
        }
        let kcfg = KvConfig { block_size: cfg.block_size, dtype_bytes: dtype.size(), max_seqs: cfg.max_seqs, ..Default::default() };
        // Auto budget: full-attention layers hold max_position_embeddings tokens (capped at
        // 2048 MB); sliding layers need their fixed per-sequence window groups on top.
        let bs = cfg.block_size.max(1);
        let (mut full, mut sliding) = (0usize, 0usize);
        for s in &specs {
            let per_token = 2 * s.kv_heads * s.head_dim * dtype.size();
            match s.kind {
                kv_paged::LayerKind::Full => full += per_token,
                kv_paged::LayerKind::Sliding { window } => {
                    let blocks = (window + kcfg.rollback_tokens + kcfg.max_step_tokens).div_ceil(bs) + 1;
                    sliding += per_token * (cfg.max_seqs * blocks + 1) * bs;
                }
                kv_paged::LayerKind::Shared { .. } => {}
            }
        }
        let auto_full = ((full * max_positions.max(bs)) as f64 / 1e6 * 1.1).min(2048.0);
        let budget_mb = cfg.memory_mb.unwrap_or(auto_full + sliding as f64 / 1e6 * 1.1 + 1.0);
        let kcfg = KvConfig { budget_mb, ..kcfg };
        let layout = KvLayout::new(specs, kcfg).map_err(err)?;
        let pool = KvPool::new(&layout, dtype).map_err(err)?;
        // Materialize the storage now: MLX streams are per thread, and a lazy array built here
        // could not be evaluated by the session threads that share the pool.
        pool.eval().map_err(err)?;
        Ok(PagedKv { manager: KvCacheManager::new(&layout).map_err(err)?, pool, layer_map, contiguous_reads: cfg.contiguous_reads })
    }

    /// Block and prefix-hit counters.
    pub fn stats(&self) -> kv_paged::ManagerStats {
        self.manager.stats()
    }
}

/// One sequence in a shared [`PagedKv`]; its blocks return to the pool's cache when dropped.
pub(crate) struct PagedSeq {
    pub(crate) shared: Arc<Mutex<PagedKv>>,
    pub(crate) seq: Option<SeqId>,
    pub(crate) offset: usize,
}

impl PagedSeq {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, PagedKv> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Register `ids` and schedule them; returns (batch, tokens skipped as cached, rope offset).
    pub(crate) fn schedule(&mut self, ids: &[u32], allow_prefix_skip: bool) -> Result<(kv_paged::StepBatch, usize, usize)> {
        let shared = self.shared.clone();
        let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
        let (seq, skipped) = match self.seq {
            None => {
                let extra = if allow_prefix_skip {
                    ExtraKeys::none()
                } else {
                    static PRIVATE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                    let n = PRIVATE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u128;
                    ExtraKeys { salt: Some((0x5eed_u128 << 64) | n), ..ExtraKeys::none() }
                };
                let b = g.manager.begin(ids, extra).map_err(err)?;
                (b.seq, b.cached_tokens)
            }
            Some(s) => {
                g.manager.append(s, ids).map_err(err)?;
                (s, 0)
            }
        };
        self.seq = Some(seq);
        let step = g.manager.step(seq, usize::MAX).map_err(err)?;
        let batch = g.pool.batch(&[&step]).map_err(err)?;
        self.offset = step.start + step.len;
        Ok((batch, skipped, step.start))
    }
    pub(crate) fn trim(&mut self, n: usize) -> Result<()> {
        if n > self.offset {
            return Err(ModelError::Cache(format!("cannot trim {n} of {} positions", self.offset)));
        }
        if let Some(s) = self.seq {
            let shared = self.shared.clone();
            let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
            let copies = g.manager.trim(s, self.offset - n).map_err(err)?;
            g.pool.copy_blocks(&copies).map_err(err)?;
        }
        self.offset -= n;
        Ok(())
    }
}

impl Drop for PagedSeq {
    fn drop(&mut self) {
        if let Some(s) = self.seq.take() {
            let _ = self.lock().manager.finish(s);
        }
    }
}
