//! The paged KV cache ([`kv_paged`]) behind a model: one block pool per loaded model, shared by
//! every sequence (so chat sessions on one model share cached prompt prefixes), and one
//! sequence per [`Cache`](crate::Cache).
//!
//! A forward call on a paged cache hashes the new tokens' full blocks; on the first call of a
//! sequence, blocks already in the pool (same tokens from the start, same extra keys) are
//! reused and their tokens are not recomputed: the outputs then cover only the computed suffix
//! ([`crate::Cache::last_skipped`] says how many were skipped).
//!
//! Nothing here waits on the device in a pipelined decode loop. A step's input ids are usually
//! the previous step's lazy output: they enter the sequence as pending ids
//! ([`KvCacheManager::append_pending`]) and are read back for block hashing only once computed.
//! The pool writes are queued with the step's outputs, in the one `async_eval` of the step
//! ([`crate::Cache::async_eval_with`]; a forward call not followed by one queues them itself at
//! its end). A forward call on another thread waits until they are queued and computed (MLX
//! streams belong to a thread, so no thread builds on another's unqueued graph).
//!
//! With [`PagedConfig::contiguous_reads`] attention reads the sequence's mirror, so the pool
//! only serves prefix hits and rollbacks: one-token (decode) steps do not write it each step.
//! Their rows are kept and written in one go per layer when a block fills (before the block
//! can be registered for sharing), before any longer step, and before a rollback.
use crate::kv::{CacheSpec, KvCache, LayerKind};
use crate::{ModelError, Result};
use kv_paged::{ExtraKeys, KvCacheManager, KvConfig, KvLayout, KvPool, LayerSpec, SeqId, Step, StepBatch};
use mlx_array::{Array, DType};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

/// Paged cache settings.
#[derive(Debug, Clone)]
pub struct PagedConfig {
    /// Tokens per block (seed default 16).
    pub block_size: usize,
    /// Most memory for all K/V, in MB; `None`: the automatic budget, enough for
    /// `max_position_embeddings` tokens of every attention layer (the model's context), at most
    /// `memory_limit_mb` and at least `memory_floor_mb`. Storage is allocated as blocks are
    /// needed (see `initial_blocks`), so this is a ceiling, not what a load costs.
    pub memory_mb: Option<f64>,
    /// The most memory the automatic budget may take, in MB (default 2048). Ignored when
    /// `memory_mb` is set.
    pub memory_limit_mb: f64,
    /// The least memory the automatic budget takes, in MB, above `memory_limit_mb` if need be;
    /// `None`: the family's floor (16384 MB for Qwen3.5, as mlx-node; none for the others).
    /// Ignored when `memory_mb` is set.
    pub memory_floor_mb: Option<f64>,
    /// Concurrent sequences sliding-window groups are sized for.
    pub max_seqs: usize,
    /// Attention layers also keep each live sequence's K/V in a contiguous per-sequence buffer
    /// (the flat cache: rotating for sliding-window layers), and attention reads it instead of
    /// gathering the sequence's blocks out of the pool every step. The pool is still written
    /// (decode rows a block at a time; prefix sharing, rollback and copy-on-write work as
    /// without it); the buffer is
    /// filled from the pool when a sequence starts on cached blocks or rolls back further than
    /// a rotating buffer keeps. Costs the flat cache's memory for live sequences on top of the
    /// pool; on the CPU backend it makes paged decode as fast as flat decode (the per-step
    /// gather and its fresh buffers cost a third of a small model's decode step).
    pub contiguous_reads: bool,
    /// Blocks each cache group starts with ([`kv_paged::KvConfig::initial_blocks`]). When none
    /// of them is free (blocks kept only as prefix cache count as free: they are evicted first),
    /// the group opens twice as many and the storage grows to match, up to what `memory_mb`
    /// allows. Memory then follows the most blocks live at once, and the prefix cache keeps
    /// what fits beside them. `None`: allocate all of `memory_mb` at load (the most prefix
    /// cache, mlx-node's behaviour).
    pub initial_blocks: Option<usize>,
    /// Models with recurrent layers (Qwen3.5, LFM2): recurrent-state snapshots kept at most (the
    /// oldest is dropped first). A snapshot is every recurrent layer's state at a block boundary
    /// of a prompt, keyed like that prefix's blocks, so that a new sequence starting with the
    /// same tokens (a repeated system prompt) restores it and skips their prefill. 0: none.
    pub recurrent_snapshots: usize,
    /// Models with recurrent layers: a prompt is prefilled in pieces ending at multiples of this
    /// many positions (rounded up to whole blocks), and the state is kept at each piece's end.
    pub snapshot_interval: usize,
}

impl Default for PagedConfig {
    fn default() -> Self {
        PagedConfig { block_size: 16, memory_mb: None, memory_limit_mb: 2048.0, memory_floor_mb: None, max_seqs: 8, contiguous_reads: true, initial_blocks: Some(32), recurrent_snapshots: 32, snapshot_interval: 256 }
    }
}

pub(crate) fn err(e: kv_paged::Error) -> ModelError {
    ModelError::Cache(e.to_string())
}

/// Block pool, sequences and K/V storage of one model.
pub struct PagedKv {
    manager: KvCacheManager,
    pool: KvPool,
    /// Model layer -> pool layer (attention layers only).
    layer_map: Vec<Option<usize>>,
    /// [`PagedConfig::contiguous_reads`].
    contiguous_reads: bool,
    /// The thread whose pool writes may still be in flight (queued, not waited for).
    writer: Option<ThreadId>,
    /// The thread whose pool writes are not queued yet: it queues them with its step's outputs
    /// ([`crate::Cache::async_eval_with`]); other threads wait for that on `queued`.
    unqueued: Option<ThreadId>,
    queued: Arc<Condvar>,
    /// Recurrent-state snapshots by prefix ([`PagedConfig::recurrent_snapshots`]).
    snapshots: Snapshots,
    /// [`PagedConfig::snapshot_interval`], in whole blocks' positions.
    snapshot_interval: usize,
}

/// Every recurrent layer's state slots (model layer index, slots) at one block boundary.
pub(crate) type Snapshot = Vec<(usize, Vec<Option<Array>>)>;

/// Recurrent-state snapshots keyed by the prefix hash of the block that ends at their position.
#[derive(Default)]
struct Snapshots {
    map: std::collections::HashMap<u128, Snapshot>,
    order: VecDeque<u128>,
    cap: usize,
}

impl Snapshots {
    fn insert(&mut self, key: u128, s: Snapshot) {
        if self.cap == 0 || self.map.contains_key(&key) {
            return;
        }
        while self.map.len() >= self.cap {
            match self.order.pop_front() {
                Some(old) => drop(self.map.remove(&old)),
                None => break,
            }
        }
        self.order.push_back(key);
        self.map.insert(key, s);
    }
}

/// The extra keys of a new sequence's blocks: none when it shares prefixes with others, else a
/// private salt (its blocks are neither found by nor find any other sequence's).
fn extra_keys(allow_prefix_skip: bool) -> ExtraKeys {
    if allow_prefix_skip {
        return ExtraKeys::none();
    }
    static PRIVATE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = PRIVATE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u128;
    ExtraKeys { salt: Some((0x5eed_u128 << 64) | n), ..ExtraKeys::none() }
}

/// Prefix keys of the full blocks of `ids` (the snapshots' keys).
fn prefix_keys(ids: &[u32], bs: usize) -> Vec<u128> {
    kv_paged::block_keys(&ids[..ids.len() / bs * bs], bs, 0, &ExtraKeys::none()).iter().map(|k| k.hash.0).collect()
}

impl PagedKv {
    pub fn new(spec: &CacheSpec, cfg: &PagedConfig, dtype: DType, max_positions: usize) -> Result<Self> {
        let mut layer_map = Vec::new();
        let mut specs: Vec<LayerSpec> = Vec::new();
        let mut pool_index = Vec::new();
        for k in &spec.layers {
            let s = match *k {
                LayerKind::Attention { kv_heads, head_dim } => Some(LayerSpec { kind: kv_paged::KvLayerKind::Full, kv_heads, head_dim }),
                LayerKind::SlidingAttention { kv_heads, head_dim, window } => {
                    Some(LayerSpec { kind: kv_paged::KvLayerKind::Sliding { window }, kv_heads, head_dim })
                }
                LayerKind::SharedKv { anchor } => {
                    let a: Option<usize> = pool_index.get(anchor).copied().flatten();
                    let a = a.ok_or_else(|| ModelError::Cache(format!("shared layer's anchor {anchor} has no K/V")))?;
                    let sa = specs[a];
                    Some(LayerSpec { kind: kv_paged::KvLayerKind::Shared { anchor: a }, ..sa })
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
        let kcfg = KvConfig {
            block_size: cfg.block_size,
            dtype_bytes: dtype.size(),
            max_seqs: cfg.max_seqs,
            initial_blocks: cfg.initial_blocks,
            ..Default::default()
        };
        // Auto budget: full-attention layers hold max_position_embeddings tokens (capped at
        // 2048 MB); sliding layers need their fixed per-sequence window groups on top.
        let bs = cfg.block_size.max(1);
        let (mut full, mut sliding) = (0usize, 0usize);
        for s in &specs {
            let per_token = 2 * s.kv_heads * s.head_dim * dtype.size();
            match s.kind {
                kv_paged::KvLayerKind::Full => full += per_token,
                kv_paged::KvLayerKind::Sliding { window } => {
                    let blocks = (window + kcfg.rollback_tokens + kcfg.max_step_tokens).div_ceil(bs) + 1;
                    sliding += per_token * (cfg.max_seqs * blocks + 1) * bs;
                }
                kv_paged::KvLayerKind::Shared { .. } => {}
            }
        }
        let auto_full = ((full * max_positions.max(bs)) as f64 / 1e6 * 1.1).min(cfg.memory_limit_mb.max(0.0));
        let auto = (auto_full + sliding as f64 / 1e6 * 1.1 + 1.0).max(cfg.memory_floor_mb.unwrap_or(0.0));
        let budget_mb = cfg.memory_mb.unwrap_or(auto);
        let kcfg = KvConfig { budget_mb, ..kcfg };
        let layout = KvLayout::new(specs, kcfg).map_err(err)?;
        let mut pool = KvPool::new(&layout, dtype).map_err(err)?;
        // Materialize the storage now: MLX streams are per thread, and a lazy array built here
        // could not be evaluated by the session threads that share the pool.
        pool.eval().map_err(err)?;
        Ok(PagedKv { manager: KvCacheManager::new(&layout).map_err(err)?, pool, layer_map, contiguous_reads: cfg.contiguous_reads, writer: None, unqueued: None, queued: Arc::new(Condvar::new()), snapshots: Snapshots { cap: cfg.recurrent_snapshots, ..Default::default() }, snapshot_interval: cfg.snapshot_interval.max(1).div_ceil(bs) * bs })
    }

    /// Lock the pool for this thread's use of its arrays: first wait until writes another
    /// thread left unqueued are queued (that thread does so right after its forward call),
    /// then until writes another thread queued are computed.
    fn claim(shared: &Mutex<PagedKv>) -> std::sync::MutexGuard<'_, PagedKv> {
        let me = std::thread::current().id();
        let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
        while g.unqueued.is_some_and(|t| t != me) {
            let cv = g.queued.clone();
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g
    }

    /// Wait for writes another thread queued (after [`PagedKv::claim`]).
    fn settle(&mut self) -> Result<()> {
        let me = std::thread::current().id();
        if self.writer.is_some_and(|w| w != me) {
            self.pool.wait().map_err(err)?;
            self.writer = None;
        }
        // This thread's own queued writes stay marked: a forward of it that writes nothing new
        // must not let another thread skip waiting for them.
        Ok(())
    }

    /// After this thread changed the pool's arrays, before unlocking it. `later`: the caller
    /// queues the writes with its step's outputs (one queueing call a step: MLX blocks a
    /// queueing call while many tasks are in flight, so a second one would stall the host).
    /// Otherwise they are queued now. A forward that wrote nothing (a decode step keeping its
    /// rows) leaves nothing to queue.
    fn release(&mut self, later: bool) -> Result<()> {
        if !self.pool.is_dirty() {
            return Ok(());
        }
        if later {
            self.unqueued = Some(std::thread::current().id());
            return Ok(());
        }
        self.pool.async_eval().map_err(err)?;
        self.queued_by_me();
        Ok(())
    }

    /// This thread queued (or computed) every write: other threads may go on.
    fn queued_by_me(&mut self) {
        self.writer = Some(std::thread::current().id());
        if self.unqueued.take().is_some() {
            self.queued.notify_all();
        }
    }

    /// Bytes of K/V storage allocated now (it grows with the blocks in use and cached).
    pub fn storage_bytes(&self) -> usize {
        self.pool.nbytes()
    }

    /// Block and prefix-hit counters.
    pub fn stats(&self) -> kv_paged::ManagerStats {
        self.manager.stats()
    }

    /// Queue `arrays` with the pool's pending writes through `run` (`eval` or `async_eval`);
    /// other threads may use the pool once this returns.
    pub(crate) fn queue(shared: &Mutex<PagedKv>, arrays: Vec<&Array>, run: impl FnOnce(&[&Array]) -> mlx_array::Result<()>) -> Result<()> {
        let mut g = PagedKv::claim(shared);
        let mut arrays: Vec<&Array> = arrays.into_iter().collect();
        // Pool arrays only when written since they were last queued: most decode steps write
        // nothing there (rows go in a block at a time), and every array handed to MLX's eval
        // costs host time even when it is already computed.
        if g.pool.is_dirty() {
            arrays.extend(g.pool.arrays());
        }
        run(&arrays)?;
        drop(arrays);
        g.pool.mark_queued();
        g.queued_by_me();
        Ok(())
    }
}

impl PagedKv {
    /// Start a sequence of a model with recurrent layers on all of `ids`, skipping only up to a
    /// block boundary that has a recurrent-state snapshot: returns the sequence, the positions
    /// skipped and that snapshot.
    fn begin_on_snapshot(&mut self, ids: &[u32], extra: ExtraKeys) -> Result<(SeqId, usize, Option<Snapshot>)> {
        let g = self;
        // Skip only up to a boundary with a snapshot: begin over the prefix up to the last such
        // boundary (and one token), so no further block is reused.
        let bs = g.manager.block_size();
        let keys = prefix_keys(&ids[..ids.len() - 1], bs);
        let has: Vec<bool> = keys.iter().map(|k| g.snapshots.map.contains_key(k)).collect();
        let snap = |n: usize| n > 0 && has[n - 1];
        let limit = (1..=keys.len()).rev().find(|&n| snap(n)).unwrap_or(0);
        let b = g.manager.begin(&ids[..limit * bs + 1], extra).map_err(err)?;
        // Fewer blocks cached than snapshotted: back to the last boundary with one.
        let mut n = b.cached_tokens / bs;
        while n > 0 && !snap(n) {
            n -= 1;
        }
        let known = if n * bs < b.cached_tokens {
            let copies = g.manager.trim(b.seq, n * bs).map_err(err)?;
            g.pool.copy_blocks(&copies).map_err(err)?;
            n * bs
        } else {
            limit * bs + 1
        };
        let restore = if n > 0 { g.snapshots.map.get(&keys[n - 1]).cloned() } else { None };
        let rest = &ids[known..];
        if !rest.is_empty() {
            g.manager.append(b.seq, rest).map_err(err)?;
        }
        Ok((b.seq, n * bs, restore))
    }
}

/// One sequence in a shared [`PagedKv`]; its blocks return to the pool's cache when dropped.
pub(crate) struct PagedSeq {
    shared: Arc<Mutex<PagedKv>>,
    state: SeqState,
}

/// Where a [`PagedSeq`] stands in the shared pool.
#[derive(Default)]
struct SeqState {
    seq: Option<SeqId>,
    offset: usize,
    /// Inputs appended as pending ids, oldest first, not yet read back.
    pending: VecDeque<Array>,
    /// Decode rows not yet in the pool: per pool layer, each deferred step's `(k, v)`...
    rows: Vec<Vec<(Array, Array)>>,
    /// ...and per cache group, their slots.
    row_slots: Vec<Vec<u32>>,
    /// The step in flight keeps its rows in `rows` (a one-token step with mirrors).
    defer: bool,
    /// The step in flight fills a block: write the kept rows when it ends.
    flush_at_end: bool,
    /// [`crate::Cache::set_queue_with_outputs`].
    queue_later: bool,
    /// The sequence's blocks are shared by prefix (not privately salted).
    shared: bool,
}

/// Pending inputs kept at most before the oldest is waited for (a caller that never evaluates
/// its inputs must not grow the queue without bound).
const MAX_PENDING: usize = 8;

/// The ids of a `[1, L]` token array, read in its own dtype (no new device work is queued, so a
/// computed array is read without waiting for later steps).
fn host_ids(tokens: &Array) -> Result<Vec<u32>> {
    let bad = |v: i64| ModelError::InvalidInput(format!("token id {v} is not a valid id (0..2^32)"));
    Ok(match tokens.dtype() {
        DType::U32 => tokens.to_vec::<u32>()?,
        DType::I32 => tokens.to_vec::<i32>()?.into_iter().map(|v| u32::try_from(v).map_err(|_| bad(v as i64))).collect::<Result<_>>()?,
        DType::I64 => tokens.to_vec::<i64>()?.into_iter().map(|v| u32::try_from(v).map_err(|_| bad(v))).collect::<Result<_>>()?,
        _ => tokens.astype(DType::U32)?.to_vec()?,
    })
}

impl SeqState {
    /// Write the kept decode rows into the pool: one write per layer for all of them. The rows
    /// are the last positions of the layer's mirror (`mirror(i)` for model layer `i`; `layer_map`
    /// maps model layers to pool layers): one slice of it, where a concatenation of the steps' rows
    /// would be one copy per row on the device. A mirror that does not hold them all (a
    /// rotating one with a window shorter than a block) gives the kept rows instead.
    fn flush<'m>(&mut self, pool: &mut KvPool, layer_map: &[Option<usize>], mirror: &impl Fn(usize) -> Option<&'m KvCache>) -> Result<()> {
        for (i, l) in layer_map.iter().enumerate() {
            let Some(layer) = *l else { continue };
            let Some(rows) = self.rows.get_mut(layer).filter(|r| !r.is_empty()) else { continue };
            let g = pool.layout().placement[layer].0;
            let slots = &self.row_slots[g];
            if slots.len() != rows.len() {
                return Err(ModelError::Cache(format!("layer {layer}: {} kept rows for {} slots", rows.len(), slots.len())));
            }
            let span = match mirror(i) {
                Some(m) => m.span(self.offset - rows.len(), self.offset)?,
                None => None,
            };
            let (k, v) = match span {
                Some(kv) => kv,
                None => {
                    let (ks, vs): (Vec<&Array>, Vec<&Array>) = rows.iter().map(|(k, v)| (k, v)).unzip();
                    (mlx_array::ops::concatenate(&ks, 2)?, mlx_array::ops::concatenate(&vs, 2)?)
                }
            };
            pool.write_rows(layer, slots, &k, &v).map_err(err)?;
            rows.clear();
        }
        self.row_slots.iter_mut().for_each(Vec::clear);
        Ok(())
    }

    /// Read back the pending inputs that are computed (all of them with `wait`) and give their
    /// ids to the manager.
    fn resolve(&mut self, g: &mut PagedKv, wait: bool) -> Result<()> {
        let Some(seq) = self.seq else { return Ok(()) };
        while let Some(a) = self.pending.front() {
            if !wait && self.pending.len() <= MAX_PENDING && !a.is_available() {
                break;
            }
            let ids = host_ids(a)?;
            g.manager.resolve(seq, &ids).map_err(err)?;
            self.pending.pop_front();
        }
        Ok(())
    }

    /// Register `tokens` (`[1, L]`) and schedule them; returns (batch, tokens skipped as cached,
    /// rope offset). A new sequence reads its ids now (prefix lookup needs them); later inputs
    /// that are not computed yet go in as pending ids.
    ///
    /// `recurrent`: the model has recurrent layers, whose state must be restored from a snapshot
    /// for any skipped prefix: a new sequence then skips only up to a block boundary that has
    /// one (returned with the skip).
    fn schedule<'m>(&mut self, g: &mut PagedKv, tokens: &Array, allow_prefix_skip: bool, recurrent: bool, mirror: &impl Fn(usize) -> Option<&'m KvCache>) -> Result<(StepBatch, usize, usize, Option<Snapshot>)> {
        let mut restore = None;
        let (seq, skipped) = match self.seq {
            None => {
                let extra = extra_keys(allow_prefix_skip);
                self.shared = allow_prefix_skip;
                let ids = host_ids(tokens)?;
                if !(recurrent && allow_prefix_skip) {
                    let b = g.manager.begin(&ids, extra).map_err(err)?;
                    (b.seq, b.cached_tokens)
                } else {
                    let (seq, skipped, snap) = g.begin_on_snapshot(&ids, extra)?;
                    restore = snap;
                    (seq, skipped)
                }
            }
            Some(s) => {
                self.resolve(g, false)?;
                if self.pending.is_empty() && tokens.is_available() {
                    g.manager.append(s, &host_ids(tokens)?).map_err(err)?;
                } else {
                    g.manager.append_pending(s, tokens.size()).map_err(err)?;
                    self.pending.push_back(tokens.clone());
                }
                (s, 0)
            }
        };
        self.seq = Some(seq);
        let step = g.manager.step(seq, usize::MAX).map_err(err)?;
        let batch = g.pool.batch(&[&step]).map_err(err)?;
        self.defer = g.contiguous_reads && step.len == 1;
        if !self.defer {
            // A step that does not keep its rows writes the rows kept by earlier steps first:
            // the mirrors' last positions before this step (`self.offset` is still its start).
            self.flush(&mut g.pool, &g.layer_map, mirror)?;
        }
        self.offset = step.start + step.len;
        self.rows.resize_with(g.pool.layout().layers.len(), Vec::new);
        self.row_slots.resize_with(step.groups.len(), Vec::new);
        if self.defer {
            for (slots, gs) in self.row_slots.iter_mut().zip(&step.groups) {
                slots.extend(&gs.slot_mapping);
            }
            self.flush_at_end = self.offset.is_multiple_of(g.manager.block_size());
        } else {
            self.flush_at_end = false;
        }
        Ok((batch, skipped, step.start, restore))
    }
}

impl PagedSeq {
    pub(crate) fn new(shared: Arc<Mutex<PagedKv>>) -> Self {
        PagedSeq { shared, state: SeqState::default() }
    }

    /// Positions processed so far.
    pub(crate) fn offset(&self) -> usize {
        self.state.offset
    }

    /// [`crate::Cache::set_queue_with_outputs`].
    pub(crate) fn set_queue_later(&mut self, on: bool) {
        self.state.queue_later = on;
    }

    /// Start a forward step over `tokens` (`[1, L]`): lock the pool, register and schedule the
    /// tokens. Returns the step and how many leading tokens the prefix cache served. `mirror(i)`
    /// is model layer `i`'s contiguous mirror, if it keeps one.
    /// `recurrent`: the model has recurrent layers; a skipped prefix then comes with the
    /// snapshot of their state at its end (see [`SeqState::schedule`]).
    pub(crate) fn begin<'m>(&mut self, tokens: &Array, allow_prefix_skip: bool, recurrent: bool, mirror: impl Fn(usize) -> Option<&'m KvCache>) -> Result<(PagedStep<'_>, usize, Option<Snapshot>)> {
        let PagedSeq { shared, state } = self;
        let mut guard = PagedKv::claim(shared);
        guard.settle()?;
        let (batch, skipped, offset, snap) = state.schedule(&mut guard, tokens, allow_prefix_skip, recurrent, &mirror)?;
        Ok((PagedStep { guard, batch, offset, state, finished: false }, skipped, snap))
    }

    /// Models with recurrent layers: the positions between snapshots
    /// ([`PagedConfig::snapshot_interval`]) and, for `ids` starting a new sequence, how many of
    /// its leading tokens (not the last) a snapshot covers.
    pub(crate) fn snapshot_plan(&self, ids: Option<&[u32]>) -> (usize, usize) {
        let g = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        let bs = g.manager.block_size();
        let covered = match ids {
            Some(ids) if self.state.seq.is_none() && !ids.is_empty() => {
                let keys = prefix_keys(&ids[..ids.len() - 1], bs);
                (1..=keys.len()).rev().find(|&n| g.snapshots.map.contains_key(&keys[n - 1])).map_or(0, |n| n * bs)
            }
            _ => 0,
        };
        (g.snapshot_interval, covered)
    }

    /// Queue `arrays` (a step's outputs and the sequence's own arrays) with the pool's pending
    /// writes through `run` (`eval` or `async_eval`).
    pub(crate) fn queue(&self, arrays: Vec<&Array>, run: impl FnOnce(&[&Array]) -> mlx_array::Result<()>) -> Result<()> {
        PagedKv::queue(&self.shared, arrays, run)
    }

    /// Roll the sequence back by `n` positions (kept rows are written first, from `mirror`).
    pub(crate) fn trim<'m>(&mut self, n: usize, mirror: impl Fn(usize) -> Option<&'m KvCache>) -> Result<()> {
        let st = &mut self.state;
        if n > st.offset {
            return Err(ModelError::Cache(format!("cannot trim {n} of {} positions", st.offset)));
        }
        if let Some(s) = st.seq {
            let mut g = PagedKv::claim(&self.shared);
            g.settle()?;
            st.resolve(&mut g, true)?;
            let g = &mut *g;
            st.flush(&mut g.pool, &g.layer_map, &mirror)?;
            let copies = g.manager.trim(s, st.offset - n).map_err(err)?;
            g.pool.copy_blocks(&copies).map_err(err)?;
            g.release(false)?;
        }
        st.offset -= n;
        Ok(())
    }
}

/// One forward step of a paged sequence: holds the pool locked from [`PagedSeq::begin`] to
/// [`PagedStep::finish`] (or drop).
pub(crate) struct PagedStep<'a> {
    guard: MutexGuard<'a, PagedKv>,
    batch: StepBatch,
    offset: usize,
    state: &'a mut SeqState,
    finished: bool,
}

impl Drop for PagedStep<'_> {
    /// A forward call that failed before [`PagedStep::finish`] still queues what it wrote.
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.guard.release(false);
        }
    }
}

impl PagedStep<'_> {
    /// Keep `snapshot` (the recurrent state after this step) when the step ends on a block
    /// boundary of a prefix-shared sequence whose ids are known, and spanned several positions
    /// (a prefill piece: its caller evaluates it before going on). The arrays are evaluated now,
    /// so another thread can restore them.
    pub(crate) fn keep_snapshot(&mut self, snapshot: impl FnOnce() -> Snapshot) -> Result<()> {
        let g = &mut *self.guard;
        let (st, bs) = (&*self.state, g.manager.block_size());
        let len = st.offset.saturating_sub(self.offset);
        let Some(seq) = st.seq else { return Ok(()) };
        if g.snapshots.cap == 0 || !st.shared || len < 2 || st.offset == 0 || st.offset % bs != 0 || g.manager.num_known(seq).map_err(err)? < st.offset {
            return Ok(());
        }
        let ids = g.manager.tokens(seq).map_err(err)?;
        let key = *prefix_keys(&ids[..st.offset], bs).last().expect("offset > 0");
        if g.snapshots.map.contains_key(&key) {
            return Ok(());
        }
        let s = snapshot();
        let arrays: Vec<&Array> = s.iter().flat_map(|(_, slots)| slots.iter().flatten()).collect();
        mlx_array::eval(&arrays)?;
        g.snapshots.insert(key, s);
        Ok(())
    }

    /// The pool access of model layer `i`; `mirror` is its contiguous copy, read instead of the
    /// pool with [`PagedConfig::contiguous_reads`].
    pub(crate) fn layer<'b>(&'b mut self, i: usize, mirror: Option<&'b mut KvCache>) -> Result<PagedLayerKv<'b>> {
        let g = &mut *self.guard;
        let layer = g.layer_map.get(i).copied().flatten().ok_or_else(|| ModelError::Cache(format!("layer {i} has no K/V")))?;
        let mirror = if g.contiguous_reads { mirror } else { None };
        let kept = if self.state.defer { self.state.rows.get_mut(layer) } else { None };
        Ok(PagedLayerKv { pool: &mut g.pool, batch: &self.batch, layer, offset: self.offset, mirror, kept })
    }

    /// End the step: write the kept decode rows when it filled a block, then queue the pool
    /// writes without waiting for them, or, with [`crate::Cache::set_queue_with_outputs`], leave
    /// them for the caller's queueing call. The pool is shared by every sequence of the model and
    /// MLX streams belong to a thread: a forward call on another thread waits until the writes
    /// are queued, then until they are computed.
    pub(crate) fn finish<'m>(mut self, mirror: impl Fn(usize) -> Option<&'m KvCache>) -> Result<()> {
        self.finished = true;
        let g = &mut *self.guard;
        if self.state.flush_at_end {
            self.state.flush(&mut g.pool, &g.layer_map, &mirror)?;
        }
        g.release(self.state.queue_later)
    }
}

/// The K/V access of one attention layer in a paged step (see [`crate::cache::LayerKv`]).
pub struct PagedLayerKv<'a> {
    pool: &'a mut KvPool,
    batch: &'a StepBatch,
    layer: usize,
    offset: usize,
    /// The sequence's contiguous copy of this layer's K/V that attention reads
    /// ([`PagedConfig::contiguous_reads`]); `None`: read (gather) the pool.
    mirror: Option<&'a mut KvCache>,
    /// This step's rows go here instead of the pool (written later, several steps at once).
    kept: Option<&'a mut Vec<(Array, Array)>>,
}

impl PagedLayerKv<'_> {
    /// The rope offset of this step's first token.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Store this step's `k`, `v` (`[B, H, L, D]`) and return all keys/values to attend to.
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let PagedLayerKv { pool, batch, layer, offset, mirror, kept } = self;
        match kept {
            Some(rows) => rows.push((k.clone(), v.clone())),
            None => pool.write(*layer, batch, k, v).map_err(err)?,
        }
        let Some(m) = mirror else { return pool.read(*layer, batch).map_err(err) };
        // Bring the mirror to the sequence's position first: back after a rollback (a rotating
        // mirror that cannot go back that far starts over), forward from the pool when the
        // sequence started on cached blocks. Positions before the first key this step attends
        // to (sliding layers) are not needed.
        let at = *offset;
        let group = pool.layout().placement[*layer].0;
        let first = batch.kv_start(group, 0).unwrap_or(0).min(at);
        if m.offset() > at && m.trim(m.offset() - at).is_err() {
            m.restart_at(first);
        }
        if m.offset() < first {
            m.restart_at(first);
        }
        if m.offset() < at {
            if kept.as_ref().is_some_and(|r| r.len() > 1) {
                // kept rows are flushed before any rollback, so a refill never needs them
                return Err(ModelError::Cache(format!("layer {layer}: mirror refill with decode rows not in the pool (internal error)")));
            }
            let (pk, pv) = pool.read_span(*layer, batch, m.offset(), at).map_err(err)?;
            m.update_and_fetch(&pk, &pv)?;
        }
        m.update_and_fetch(k, v)
    }
}

// ------------------------------------------------------------------ several sequences a step

/// How a row of a step over paged sequences gets its new tokens ([`crate::Cache::schedule_rows`]).
pub(crate) enum RowTokens {
    /// Ids known on the host, appended to the sequence.
    Host(Vec<u32>),
    /// Ids still being computed on the device (`[n]`): appended as pending, read back later
    /// (for block hashing), so a pipelined decode loop does not wait for them.
    Lazy(Array),
    /// Nothing new: the step computes the next tokens registered earlier (a prompt's next chunk).
    Next,
}

impl SeqState {
    /// Start the sequence on all of `prompt` (computed by later steps), reusing its cached prefix
    /// when `allow_prefix_skip`; returns how many leading tokens the prefix cache serves.
    /// `recurrent`: the model has recurrent layers; the skip then stops at a block boundary with
    /// a snapshot of their state, returned with it ([`PagedKv::begin_on_snapshot`]).
    fn begin_row(&mut self, g: &mut PagedKv, prompt: &[u32], allow_prefix_skip: bool, recurrent: bool) -> Result<(usize, Option<Snapshot>)> {
        if self.seq.is_some() {
            return Err(ModelError::Cache("a paged sequence can begin only once".into()));
        }
        let extra = extra_keys(allow_prefix_skip);
        let (seq, cached, snap) = if recurrent && allow_prefix_skip {
            g.begin_on_snapshot(prompt, extra)?
        } else {
            let b = g.manager.begin(prompt, extra).map_err(err)?;
            (b.seq, b.cached_tokens, None)
        };
        self.shared = allow_prefix_skip;
        self.seq = Some(seq);
        self.offset = cached;
        Ok((cached, snap))
    }

    /// Register `input` and schedule the next (at most `max`) tokens not yet computed.
    fn step_row(&mut self, g: &mut PagedKv, input: &RowTokens, max: usize) -> Result<Step> {
        let seq = self.seq.ok_or_else(|| ModelError::Cache("a paged row steps before it began".into()))?;
        if !matches!(input, RowTokens::Next) {
            self.resolve(g, false)?;
        }
        match input {
            RowTokens::Host(ids) if self.pending.is_empty() => g.manager.append(seq, ids).map_err(err)?,
            RowTokens::Host(ids) => {
                g.manager.append_pending(seq, ids.len()).map_err(err)?;
                self.pending.push_back(Array::from_slice(ids, &[ids.len()])?);
            }
            RowTokens::Lazy(a) => {
                g.manager.append_pending(seq, a.size()).map_err(err)?;
                self.pending.push_back(a.clone());
            }
            RowTokens::Next => {}
        }
        let step = g.manager.step(seq, max).map_err(err)?;
        self.offset = step.start + step.len;
        Ok(step)
    }
}

impl PagedSeq {
    /// The pool this sequence lives in.
    pub(crate) fn pool(&self) -> &Arc<Mutex<PagedKv>> {
        &self.shared
    }

    /// Whether the sequence's blocks are shared by prefix (not privately salted).
    pub(crate) fn prefix_shared(&self) -> bool {
        self.state.shared
    }

    /// [`SeqState::begin_row`].
    pub(crate) fn begin_row(&mut self, prompt: &[u32], allow_prefix_skip: bool, recurrent: bool) -> Result<(usize, Option<Snapshot>)> {
        let mut g = PagedKv::claim(&self.shared);
        self.state.begin_row(&mut g, prompt, allow_prefix_skip, recurrent)
    }

    /// A second sequence with the same tokens and position, sharing the blocks (the partial
    /// last block is copied).
    pub(crate) fn fork(&mut self) -> Result<PagedSeq> {
        let mut g = PagedKv::claim(&self.shared);
        g.settle()?;
        self.state.resolve(&mut g, true)?;
        let seq = self.state.seq.ok_or_else(|| ModelError::Cache("fork of a paged sequence that has not begun".into()))?;
        let (id, copies) = g.manager.fork(seq).map_err(err)?;
        g.pool.copy_blocks(&copies).map_err(err)?;
        g.release(false)?;
        let state = SeqState { seq: Some(id), offset: self.state.offset, shared: self.state.shared, ..SeqState::default() };
        Ok(PagedSeq { shared: self.shared.clone(), state })
    }
}

/// Schedule one step of every row of `seqs` (sequences of the pool `shared`): row `b` registers
/// `inputs[b].0` and computes at most `inputs[b].1` tokens.
pub(crate) fn schedule_rows(shared: &Mutex<PagedKv>, seqs: &mut [PagedSeq], inputs: &[(RowTokens, usize)]) -> Result<Vec<Step>> {
    if seqs.len() != inputs.len() {
        return Err(ModelError::InvalidInput(format!("{} inputs for {} paged rows", inputs.len(), seqs.len())));
    }
    let mut g = PagedKv::claim(shared);
    seqs.iter_mut().zip(inputs).map(|(s, (input, max))| s.state.step_row(&mut g, input, *max)).collect()
}

/// One forward step over rows of one pool ([`crate::Cache::paged_rows`]): holds the pool locked
/// from [`RowsStep::begin`] to [`RowsStep::finish`] (or drop). Every row reads its keys from its
/// own blocks (no contiguous mirror) and writes its new ones there at once.
pub(crate) struct RowsStep<'a> {
    guard: MutexGuard<'a, PagedKv>,
    batch: StepBatch,
    /// Flat indices (`b * columns + c`) of the step's token columns, row by row (the write order
    /// of the batch's slots); `None` when no row has padding.
    tokens: Option<Array>,
    /// Leave the pool writes to the caller's queueing call.
    later: bool,
    finished: bool,
    /// Each row's sequence, position after the step, tokens in the step, and whether its blocks
    /// are shared by prefix (for recurrent-state snapshots).
    rows: Vec<(SeqId, usize, usize, bool)>,
}

impl Drop for RowsStep<'_> {
    /// A forward call that failed before [`RowsStep::finish`] still queues what it wrote.
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.guard.release(false);
        }
    }
}

impl<'a> RowsStep<'a> {
    /// Lock the pool and build the step of `steps` (one per row, from [`schedule_rows`]): row `b`
    /// fills the last `columns - pad[b]` of the step's columns.
    pub(crate) fn begin(shared: &'a Mutex<PagedKv>, steps: &[Step], pad: &[usize], columns: usize, later: bool, prefix_shared: &[bool]) -> Result<Self> {
        let mut guard = PagedKv::claim(shared);
        guard.settle()?;
        let refs: Vec<&Step> = steps.iter().collect();
        let batch = guard.pool.batch(&refs).map_err(err)?;
        let tokens = if pad.iter().all(|&p| p == 0) {
            None
        } else {
            let idx: Vec<i32> = pad.iter().enumerate().flat_map(|(b, &p)| (p..columns).map(move |c| (b * columns + c) as i32)).collect();
            Some(Array::from_slice(&idx, &[idx.len()])?)
        };
        let rows = steps.iter().zip(prefix_shared).map(|(s, &sh)| (s.seq, s.start + s.len, s.len, sh)).collect();
        Ok(RowsStep { guard, batch, tokens, later, finished: false, rows })
    }

    /// Keep a recurrent-state snapshot for each row whose step ends on a block boundary of a
    /// prefix-shared sequence whose ids are known and spanned several positions (a prompt
    /// chunk), as [`PagedStep::keep_snapshot`] does for one sequence. `snapshot(b, n)` gives row
    /// `b` of `n`'s state after the step; it is evaluated now, so another thread can restore it.
    pub(crate) fn keep_snapshots(&mut self, snapshot: impl Fn(usize, usize) -> Result<Snapshot>) -> Result<()> {
        let g = &mut *self.guard;
        let (bs, n) = (g.manager.block_size(), self.rows.len());
        if g.snapshots.cap == 0 {
            return Ok(());
        }
        for (b, &(seq, end, len, shared)) in self.rows.iter().enumerate() {
            if !shared || len < 2 || end == 0 || end % bs != 0 || g.manager.num_known(seq).map_err(err)? < end {
                continue;
            }
            let ids = g.manager.tokens(seq).map_err(err)?;
            let key = *prefix_keys(&ids[..end], bs).last().expect("end > 0");
            if g.snapshots.map.contains_key(&key) {
                continue;
            }
            let s = snapshot(b, n)?;
            let arrays: Vec<&Array> = s.iter().flat_map(|(_, slots)| slots.iter().flatten()).collect();
            mlx_array::eval(&arrays)?;
            g.snapshots.insert(key, s);
        }
        Ok(())
    }

    /// Per kind of attention (`None` full, `Some(w)` a sliding window of `w`): each row's first
    /// key position and key count ([`crate::batch::BatchRows::paged`]).
    pub(crate) fn key_groups(&self) -> Vec<(Option<usize>, Vec<usize>, Vec<usize>)> {
        let layout = self.guard.pool.layout();
        (0..layout.groups.len())
            .filter_map(|g| {
                let w = match layout.groups[g].attention {
                    kv_paged::Attention::Full => None,
                    kv_paged::Attention::Sliding { window } => Some(window),
                };
                let (lens, _) = self.batch.kv_lens(g)?;
                let starts = (0..lens.len()).map(|b| self.batch.kv_start(g, b).unwrap_or(0)).collect();
                Some((w, starts, lens.to_vec()))
            })
            .collect()
    }

    /// The pool access of model layer `i`.
    pub(crate) fn layer(&mut self, i: usize) -> Result<PagedRowsKv<'_>> {
        let g = &mut *self.guard;
        let layer = g.layer_map.get(i).copied().flatten().ok_or_else(|| ModelError::Cache(format!("layer {i} has no K/V")))?;
        Ok(PagedRowsKv { pool: &mut g.pool, batch: &self.batch, layer, tokens: self.tokens.as_ref() })
    }

    /// End the step: queue the pool writes now, or leave them to the caller's queueing call
    /// ([`crate::Cache::set_queue_with_outputs`]).
    pub(crate) fn finish(mut self) -> Result<()> {
        self.finished = true;
        let later = self.later;
        self.guard.release(later)
    }
}

/// The K/V access of one attention layer in a step over paged rows.
pub struct PagedRowsKv<'a> {
    pool: &'a mut KvPool,
    batch: &'a StepBatch,
    layer: usize,
    tokens: Option<&'a Array>,
}

impl PagedRowsKv<'_> {
    /// Write the rows' new `k`, `v` (`[B, H, L, D]`, left padding skipped) into their blocks and
    /// return every row's keys and values (`[B, H, T, D]`, each row's from its first key
    /// position, padded at the end to the longest row).
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let pick = |x: &Array| -> Result<Array> {
            let Some(idx) = self.tokens else { return Ok(x.clone()) };
            let s = x.shape();
            let (b, h, l, d) = (s[0] as i32, s[1] as i32, s[2] as i32, s[3] as i32);
            let rows = x.transpose(&[0, 2, 1, 3])?.reshape(&[b * l, h, d])?.take(idx, 0)?;
            Ok(rows.reshape(&[1, -1, h, d])?.transpose(&[0, 2, 1, 3])?)
        };
        let (kw, vw) = (pick(k)?, pick(v)?);
        self.pool.write(self.layer, self.batch, &kw, &vw).map_err(err)?;
        self.pool.read(self.layer, self.batch).map_err(err)
    }
}

impl Drop for PagedSeq {
    fn drop(&mut self) {
        if self.state.seq.is_some() {
            let mut g = PagedKv::claim(&self.shared);
            // Writes this thread left for a queueing call that will not come now.
            if g.unqueued.is_some() {
                let _ = g.release(false);
            }
            // Best effort: the last blocks join the prefix cache only with their ids known.
            let _ = self.state.resolve(&mut g, true);
            if let Some(s) = self.state.seq.take() {
                let _ = g.manager.finish(s);
            }
        }
    }
}
