//! Per-sequence caches: what a model carries from one forward call to the next.
//!
//! A model is a function of (tokens, caches). [`CacheSpec`] says what each layer needs;
//! [`Cache::new`] builds matching storage: attention layers keep K/V in a [`KvCache`] (flat or
//! rotating, [`crate::kv`]), recurrent layers (GatedDeltaNet, short conv) their own state arrays.
//! A paged cache (from a model loaded with a paged KV mode) keeps attention K/V in the model's shared block pool
//! instead ([`crate::paged`]); families see the same [`ForwardKv`] / [`LayerKv`] either way.
pub use crate::kv::{CacheSpec, KvCache, LayerKind};
use crate::paged::{PagedKv, PagedLayerKv, PagedSeq, PagedStep};
use crate::{ModelError, Result};
use mlx_array::Array;
use std::sync::{Arc, Mutex};

/// The cache of one layer.
#[derive(Clone)]
pub enum LayerCache {
    Kv(KvCache),
    /// KV-shared layer: reads its anchor's K/V.
    Shared { anchor: usize },
    /// Recurrent state slots, `None` until first written.
    Recurrent(Vec<Option<Array>>),
}

/// All layers' caches for one sequence batch.
pub struct Cache {
    pub layers: Vec<LayerCache>,
    /// Paged mode: attention layers live in the model's shared block pool instead.
    pub(crate) paged: Option<PagedSeq>,
    last_skipped: usize,
    /// Batch caches: the rows' padding and positions ([`crate::batch`]).
    pub(crate) batch: Option<crate::batch::BatchRows>,
    /// Rotary position minus cache position of the next token (multimodal rope after media).
    position_delta: i64,
}

/// A cache's state at one position, from [`Cache::snapshot`].
#[derive(Clone)]
pub struct CacheSnapshot {
    layers: Vec<LayerCache>,
    offset: usize,
    paged: bool,
    position_delta: i64,
}

impl CacheSnapshot {
    /// The position the snapshot was taken at.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

/// The K/V access of one attention layer during a forward pass: flat storage or the paged pool.
pub enum LayerKv<'a> {
    Flat(&'a mut KvCache),
    Paged(PagedLayerKv<'a>),
    /// A batch cache's layer: flat storage of every row, and where the rows stand.
    Batch(&'a mut KvCache, &'a crate::batch::BatchRows),
}

impl<'a> LayerKv<'a> {
    /// The rope offset of this step's first token (batch caches: its first column; each row's
    /// position is that minus its padding, see [`LayerKv::batch`]).
    pub fn offset(&self) -> usize {
        match self {
            LayerKv::Flat(c) | LayerKv::Batch(c, _) => c.offset(),
            LayerKv::Paged(p) => p.offset(),
        }
    }
    /// The rows of a batch cache: attention then uses per-row rope offsets and their mask.
    pub fn batch(&self) -> Option<&'a crate::batch::BatchRows> {
        match self {
            LayerKv::Batch(_, r) => Some(*r),
            _ => None,
        }
    }
    /// Store this step's `k`, `v` (`[B, H, L, D]`) and return all keys/values to attend to.
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        match self {
            LayerKv::Flat(c) | LayerKv::Batch(c, _) => c.update_and_fetch(k, v),
            LayerKv::Paged(p) => p.update_and_fetch(k, v),
        }
    }
}

/// Per-forward view of a [`Cache`], from [`Cache::begin_forward`].
pub struct ForwardKv<'a> {
    layers: &'a mut Vec<LayerCache>,
    paged: Option<PagedStep<'a>>,
    batch: Option<&'a crate::batch::BatchRows>,
}

/// The mirror of model layer `i` (its flat K/V cache), if it has one.
fn mirror_of<'a>(layers: &'a [LayerCache]) -> impl Fn(usize) -> Option<&'a KvCache> + 'a {
    move |i| match layers.get(i) {
        Some(LayerCache::Kv(m)) => Some(m),
        _ => None,
    }
}

impl<'a> ForwardKv<'a> {
    /// The rows of a batch cache (see [`crate::batch`]).
    pub fn batch(&self) -> Option<&'a crate::batch::BatchRows> {
        self.batch
    }
}

impl ForwardKv<'_> {
    /// The K/V access of model layer `i`.
    pub fn layer(&mut self, i: usize) -> Result<LayerKv<'_>> {
        match &mut self.paged {
            Some(step) => {
                let mirror = match self.layers.get_mut(i) {
                    Some(LayerCache::Kv(c)) => Some(c),
                    _ => None,
                };
                Ok(LayerKv::Paged(step.layer(i, mirror)?))
            }
            None => match self.layers.get_mut(i) {
                Some(LayerCache::Kv(c)) => Ok(match self.batch {
                    Some(r) => LayerKv::Batch(c, r),
                    None => LayerKv::Flat(c),
                }),
                _ => Err(ModelError::Cache(format!("layer {i} has no K/V cache"))),
            },
        }
    }
    /// End the forward pass. A paged step of a model with recurrent layers that ends a prefill
    /// piece on a block boundary keeps their state as a snapshot for that prefix
    /// ([`crate::PagedConfig::recurrent_snapshots`]). In paged mode this writes the kept decode rows when the step filled
    /// a block, then queues the pool writes without waiting for them, or, with
    /// [`Cache::set_queue_with_outputs`], leaves them for the caller's queueing call (see
    /// [`PagedStep::finish`]). A forward pass dropped without `finish` (an error) still queues
    /// what it wrote.
    pub fn finish(mut self) -> Result<()> {
        match self.paged.take() {
            Some(mut step) => {
                if self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_))) {
                    let layers = &*self.layers;
                    step.keep_snapshot(|| {
                        layers.iter().enumerate().filter_map(|(i, l)| if let LayerCache::Recurrent(s) = l { Some((i, s.clone())) } else { None }).collect()
                    })?;
                }
                step.finish(mirror_of(self.layers))
            }
            None => Ok(()),
        }
    }

    /// Recurrent state slots of layer `i` (kept outside the pool in both modes).
    pub fn recurrent(&mut self, i: usize) -> Result<&mut Vec<Option<Array>>> {
        match self.layers.get_mut(i) {
            Some(LayerCache::Recurrent(s)) => Ok(s),
            _ => Err(ModelError::Cache(format!("layer {i} has no recurrent state"))),
        }
    }
}

impl Cache {
    /// Empty caches laid out as `spec` says.
    pub fn new(spec: &CacheSpec) -> Self {
        let layers = spec
            .layers
            .iter()
            .map(|k| match k {
                LayerKind::Attention { .. } => LayerCache::Kv(KvCache::new(None)),
                LayerKind::SlidingAttention { window, .. } => LayerCache::Kv(KvCache::new(Some(*window))),
                LayerKind::SharedKv { anchor } => LayerCache::Shared { anchor: *anchor },
                LayerKind::Recurrent { slots } => LayerCache::Recurrent(vec![None; *slots]),
            })
            .collect();
        Cache { layers, paged: None, last_skipped: 0, batch: None, position_delta: 0 }
    }

    /// A cache whose attention layers live in the shared paged pool `shared`.
    pub(crate) fn new_paged(spec: &CacheSpec, shared: Arc<Mutex<PagedKv>>) -> Self {
        let mut c = Self::new(spec);
        c.paged = Some(PagedSeq::new(shared));
        c
    }

    /// Leading tokens of the last forward call served by the paged prefix cache (not recomputed).
    pub fn last_skipped(&self) -> usize {
        self.last_skipped
    }

    /// Paged caches of models with recurrent layers: the positions between recurrent-state
    /// snapshots, and how many leading tokens of `ids` (not the last) a snapshot covers when they
    /// start a new sequence (0 otherwise). `None` for other caches.
    pub(crate) fn snapshot_plan(&self, ids: Option<&[u32]>) -> Option<(usize, usize)> {
        let p = self.paged.as_ref()?;
        if !self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_))) {
            return None;
        }
        Some(p.snapshot_plan(ids))
    }

    /// Set what [`Cache::last_skipped`] reports (a forward run in several pieces).
    pub(crate) fn set_last_skipped(&mut self, n: usize) {
        self.last_skipped = n;
    }

    /// What a family adds to a cache position to get the rotary position of the next tokens
    /// (Qwen's M-RoPE `rope_deltas` after an image; 0 otherwise).
    pub fn position_delta(&self) -> i64 {
        self.position_delta
    }
    /// Set [`Cache::position_delta`] (a family's media forward pass).
    pub fn set_position_delta(&mut self, d: i64) {
        self.position_delta = d;
    }

    /// Whether attention K/V live in a paged block pool.
    pub fn is_paged(&self) -> bool {
        self.paged.is_some()
    }

    /// [`Cache::begin_forward_with`] allowing prefix skips.
    pub fn begin_forward(&mut self, tokens: &Array) -> Result<(ForwardKv<'_>, usize)> {
        self.begin_forward_with(tokens, true)
    }

    /// Start a forward pass over `tokens` (`[1, L]` in paged mode): returns the per-layer view
    /// and how many leading tokens were found in the paged prefix cache (0 in flat mode); the
    /// caller computes only `tokens[skipped..]`. With `allow_prefix_skip` false (callers that
    /// need outputs for every position) a new paged sequence is salted privately: it neither
    /// reuses nor shares cached blocks, and nothing is skipped.
    pub fn begin_forward_with(&mut self, tokens: &Array, allow_prefix_skip: bool) -> Result<(ForwardKv<'_>, usize)> {
        let Cache { layers, paged, last_skipped, batch, .. } = self;
        *last_skipped = 0;
        if let Some(rows) = batch {
            rows.begin(tokens.dims()[0] as usize, tokens.dims()[1] as usize)?;
        }
        let batch = batch.as_ref();
        match paged {
            None => Ok((ForwardKv { layers, paged: None, batch }, 0)),
            Some(p) => {
                if tokens.ndim() != 2 || tokens.dims()[0] != 1 {
                    return Err(ModelError::InvalidInput(format!("paged caches take one sequence ([1, L] tokens), got {:?}", tokens.shape())));
                }
                let recurrent = layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_)));
                let (step, skipped, snapshot) = p.begin(tokens, allow_prefix_skip, recurrent, mirror_of(layers))?;
                // A skipped prefix of a model with recurrent layers starts from their state there.
                for (i, slots) in snapshot.into_iter().flatten() {
                    if let Some(l) = layers.get_mut(i) {
                        *l = LayerCache::Recurrent(slots);
                    }
                }
                *last_skipped = skipped;
                Ok((ForwardKv { layers, paged: Some(step), batch }, skipped))
            }
        }
    }

    /// Positions processed so far (from the first attention layer).
    pub fn offset(&self) -> usize {
        if let Some(p) = &self.paged {
            return p.offset();
        }
        self.layers.iter().find_map(|l| if let LayerCache::Kv(c) = l { Some(c.offset()) } else { None }).unwrap_or(0)
    }

    /// The K/V cache of layer `i`.
    pub fn kv(&mut self, i: usize) -> Result<&mut KvCache> {
        match self.layers.get_mut(i) {
            Some(LayerCache::Kv(c)) => Ok(c),
            _ => Err(ModelError::Cache(format!("layer {i} has no K/V cache"))),
        }
    }

    /// Roll every attention layer back by `n` positions; fails on recurrent layers, whose state
    /// cannot be rewound (callers re-prefill instead).
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_))) {
            return Err(ModelError::Cache("recurrent layers cannot be trimmed".into()));
        }
        if self.batch.is_some() {
            return Err(ModelError::Cache("batch caches cannot be trimmed (drop rows with select_rows)".into()));
        }
        if let Some(p) = &mut self.paged {
            return p.trim(n, mirror_of(&self.layers));
        }
        for l in &mut self.layers {
            if let LayerCache::Kv(c) = l {
                c.trim(n)?;
            }
        }
        Ok(())
    }

    /// Whether [`Cache::trim`] of `n` positions would succeed: no recurrent layer, and every
    /// sliding-window layer still holds what the next position needs after it.
    pub fn can_trim(&self, n: usize) -> bool {
        if self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_))) || n > self.offset() {
            return false;
        }
        self.paged.is_some() || self.layers.iter().all(|l| !matches!(l, LayerCache::Kv(c) if !c.can_trim(n)))
    }

    /// A snapshot of this sequence's state for [`Cache::restore`]. Arrays are immutable, so it
    /// keeps the current arrays (no copy): flat and rotating K/V, recurrent state. A paged cache
    /// keeps its recurrent state and position; its K/V in the pool are rolled back by trimming.
    pub fn snapshot(&self) -> CacheSnapshot {
        CacheSnapshot { layers: self.layers.clone(), offset: self.offset(), paged: self.paged.is_some(), position_delta: self.position_delta }
    }

    /// Return to `snap`, taken from this cache at an earlier (or the same) position, dropping the
    /// positions processed since: speculative decoding's rollback for caches [`Cache::trim`]
    /// cannot rewind (recurrent state, rotating windows).
    pub fn restore(&mut self, snap: &CacheSnapshot) -> Result<()> {
        let now = self.offset();
        if snap.offset > now || snap.paged != self.paged.is_some() || snap.layers.len() != self.layers.len() {
            return Err(ModelError::Cache(format!("snapshot at position {} does not belong to this cache (at {now})", snap.offset)));
        }
        self.position_delta = snap.position_delta;
        match &mut self.paged {
            None => self.layers = snap.layers.clone(),
            Some(p) => {
                p.trim(now - snap.offset, mirror_of(&self.layers))?;
                for (l, s) in self.layers.iter_mut().zip(&snap.layers) {
                    if let (LayerCache::Recurrent(cur), LayerCache::Recurrent(old)) = (l, s) {
                        cur.clone_from(old);
                    }
                }
            }
        }
        Ok(())
    }

    /// Queue `outputs` and everything the cache holds (paged pool writes included) in one
    /// `async_eval`. Call it once per decode step, with the step's outputs: a second queueing
    /// call while a step is in flight can block the host (MLX throttles them).
    pub fn async_eval_with(&mut self, outputs: &[&Array]) -> Result<()> {
        self.queue(outputs, true)
    }

    /// [`Cache::async_eval_with`], waiting for the results.
    pub fn eval_with(&mut self, outputs: &[&Array]) -> Result<()> {
        self.queue(outputs, false)
    }

    fn queue(&mut self, outputs: &[&Array], queue_only: bool) -> Result<()> {
        let mut arrays: Vec<&Array> = outputs.to_vec();
        arrays.extend(self.arrays());
        let run = |a: &[&Array]| if queue_only { mlx_array::async_eval(a) } else { mlx_array::eval(a) };
        match &self.paged {
            None => Ok(run(&arrays)?),
            Some(p) => p.queue(arrays, run),
        }
    }

    /// Paged caches: leave each forward call's pool writes for the caller to queue with the
    /// step's outputs ([`Cache::async_eval_with`] or [`Cache::eval_with`], right after the
    /// call), instead of queueing them at its end. One queueing call a step keeps a pipelined
    /// decode loop from stalling; [`crate::generate()`] does this. Forward calls on other threads
    /// wait until the writes are queued, so a caller that turns this on must queue after
    /// every forward call. No effect on flat caches.
    pub fn set_queue_with_outputs(&mut self, on: bool) {
        if let Some(p) = &mut self.paged {
            p.set_queue_later(on);
        }
    }

    /// The arrays this cache holds itself (flat K/V, paged mirrors, recurrent state), not the
    /// shared paged pool's: to evaluate a step's outputs with everything, pool writes included,
    /// use [`Cache::async_eval_with`] or [`Cache::eval_with`].
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = Vec::new();
        for l in &self.layers {
            match l {
                LayerCache::Kv(c) => v.extend(c.arrays()),
                LayerCache::Recurrent(s) => v.extend(s.iter().flatten()),
                LayerCache::Shared { .. } => {}
            }
        }
        v
    }
}

