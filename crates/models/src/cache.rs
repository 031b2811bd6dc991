//! Per-sequence caches: what a model carries from one forward call to the next.
//!
//! A model is a function of (tokens, caches). [`CacheSpec`] says what each layer needs;
//! [`Cache::new`] builds matching storage: attention layers keep K/V in a [`KvCache`] (flat or
//! rotating, [`crate::kv`]), recurrent layers (GatedDeltaNet, short conv) their own state arrays.
//! A paged cache (from a model loaded with a paged KV mode) keeps attention K/V in the model's shared block pool
//! instead ([`crate::paged`]); families see the same [`ForwardKv`] / [`LayerKv`] either way.
pub use crate::kv::{CacheSpec, KvCache, LayerKind};
use crate::paged::{PagedKv, PagedLayerKv, PagedRowsKv, PagedSeq, PagedStep, RowTokens, RowsStep};
use kv_paged::Step;
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
    /// [`Cache::set_gradient_checkpointing`].
    gradient_checkpointing: bool,
    /// A view over several paged sequences stepped together ([`Cache::paged_rows`]).
    pub(crate) rows: Option<PagedRows>,
}

/// The sequences of a view over paged caches ([`Cache::paged_rows`]).
pub(crate) struct PagedRows {
    shared: Arc<Mutex<PagedKv>>,
    seqs: Vec<PagedSeq>,
    /// Each row's own layers; its recurrent slots are stacked in the view's while it is joined.
    row_layers: Vec<Vec<LayerCache>>,
    /// The next step of every row ([`Cache::schedule_rows`]), each row's left padding in it and
    /// the step's columns.
    steps: Vec<Step>,
    pad: Vec<usize>,
    cols: usize,
    /// [`Cache::set_queue_with_outputs`].
    later: bool,
    /// The planned step takes its tokens packed ([`Cache::set_step_tokens`]).
    packed: bool,
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
    /// A step over paged rows (`Cache::paged_rows`): each row's blocks, and where the rows
    /// stand.
    Rows(PagedRowsKv<'a>, &'a crate::batch::BatchRows),
}

impl<'a> LayerKv<'a> {
    /// The rope offset of this step's first token (batch caches: its first column; each row's
    /// position is that minus its padding, see [`LayerKv::batch`]; a step over paged rows: 0,
    /// the rows give every position).
    pub fn offset(&self) -> usize {
        match self {
            LayerKv::Flat(c) | LayerKv::Batch(c, _) => c.offset(),
            LayerKv::Paged(p) => p.offset(),
            LayerKv::Rows(..) => 0,
        }
    }
    /// The rows of a batch cache: attention then uses per-row rope offsets and their mask.
    pub fn batch(&self) -> Option<&'a crate::batch::BatchRows> {
        match self {
            LayerKv::Batch(_, r) | LayerKv::Rows(_, r) => Some(*r),
            _ => None,
        }
    }
    /// Store this step's `k`, `v` (`[B, H, L, D]`) and return all keys/values to attend to.
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        match self {
            LayerKv::Flat(c) => c.update_and_fetch(k, v),
            LayerKv::Batch(c, r) => {
                let out = c.update_and_fetch(k, v)?;
                match r.realign() {
                    Some(idx) => c.batch_realign(idx),
                    None => Ok(out),
                }
            }
            LayerKv::Paged(p) => p.update_and_fetch(k, v),
            LayerKv::Rows(p, _) => p.update_and_fetch(k, v),
        }
    }
}

/// Per-forward view of a [`Cache`], from [`Cache::begin_forward`].
pub struct ForwardKv<'a> {
    layers: &'a mut Vec<LayerCache>,
    paged: Option<PagedStep<'a>>,
    rows: Option<RowsStep<'a>>,
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
    /// A view over `layers` alone (no paged pool, no batch rows): the scratch caches of a pass
    /// that keeps nothing ([`Cache::set_gradient_checkpointing`]).
    pub(crate) fn scratch(layers: &'a mut Vec<LayerCache>) -> Self {
        ForwardKv { layers, paged: None, batch: None, rows: None }
    }

    /// The rows of a batch cache (see [`crate::batch`]).
    pub fn batch(&self) -> Option<&'a crate::batch::BatchRows> {
        self.batch
    }
}

impl ForwardKv<'_> {
    /// The K/V access of model layer `i`.
    pub fn layer(&mut self, i: usize) -> Result<LayerKv<'_>> {
        if let Some(step) = &mut self.rows {
            let r = self.batch.ok_or_else(|| ModelError::Cache("a step over paged rows without its rows (internal error)".into()))?;
            return Ok(LayerKv::Rows(step.layer(i)?, r));
        }
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
    /// `PagedStep::finish`). A forward pass dropped without `finish` (an error) still queues
    /// what it wrote.
    pub fn finish(mut self) -> Result<()> {
        if let Some(mut step) = self.rows.take() {
            if self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_))) {
                let layers = &*self.layers;
                step.keep_snapshots(|b, n| row_snapshot(layers, b, n))?;
            }
            return step.finish();
        }
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
        Cache { layers, paged: None, last_skipped: 0, batch: None, rows: None, position_delta: 0, gradient_checkpointing: false }
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

    /// Training forward passes with per-layer gradient checkpointing: each decoder layer runs
    /// under [`mlx_array::grad::checkpoint`] with its arrays as explicit inputs, so a gradient
    /// transform keeps only the layers' inputs and recomputes each layer's activations in the
    /// backward pass. Such a pass starts at position 0 of a flat, non-batch cache, computes
    /// every position, and stores no K/V or recurrent state (the cache stays empty); other
    /// passes, and models whose forward does not support it, return
    /// [`ModelError::UnsupportedOption`] with the reason.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Whether [`Cache::set_gradient_checkpointing`] is on.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
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
        if self.gradient_checkpointing {
            return Err(ModelError::UnsupportedOption("gradient checkpointing: this model's forward pass does not support it".into()));
        }
        let Cache { layers, paged, last_skipped, batch, rows, .. } = self;
        *last_skipped = 0;
        if let Some(r) = rows {
            let (b, l) = (tokens.dims()[0] as usize, tokens.dims()[1] as usize);
            let packed = std::mem::take(&mut r.packed);
            let want = if packed { (1, r.pad.iter().map(|p| r.cols - p).sum()) } else { (r.seqs.len(), r.cols) };
            if r.steps.len() != r.seqs.len() || (b, l) != want {
                return Err(ModelError::InvalidInput(format!(
                    "a step over {} paged rows takes the {:?} tokens schedule_rows planned, got {:?}",
                    r.seqs.len(),
                    [want.0, want.1],
                    tokens.shape()
                )));
            }
            let steps = std::mem::take(&mut r.steps);
            let starts: Vec<usize> = steps.iter().map(|s| s.start).collect();
            let prefix_shared: Vec<bool> = r.seqs.iter().map(PagedSeq::prefix_shared).collect();
            let step = RowsStep::begin(&r.shared, &steps, &r.pad, r.cols, r.later, &prefix_shared)?;
            *batch = Some(crate::batch::BatchRows::paged(r.pad.clone(), &starts, r.cols, step.key_groups(), packed)?);
            return Ok((ForwardKv { layers, paged: None, rows: Some(step), batch: batch.as_ref() }, 0));
        }
        if let Some(rows) = batch {
            rows.begin_tokens(tokens)?;
        }
        let batch = batch.as_ref();
        match paged {
            None => Ok((ForwardKv { layers, paged: None, rows: None, batch }, 0)),
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
                Ok((ForwardKv { layers, paged: Some(step), rows: None, batch }, skipped))
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

    /// Size every flat attention layer's storage for at least `positions` positions
    /// ([`KvCache::reserve`]); paged caches (blocks from the pool) and rotating windows are
    /// unaffected.
    pub fn reserve(&mut self, positions: usize) -> Result<()> {
        if self.paged.is_some() || self.rows.is_some() || self.batch.is_some() {
            return Ok(());
        }
        for l in &mut self.layers {
            if let LayerCache::Kv(c) = l {
                c.reserve(positions)?;
            }
        }
        Ok(())
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
        if self.batch.is_some() || self.rows.is_some() {
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
        match (&self.paged, &self.rows) {
            (Some(p), _) => p.queue(arrays, run),
            (None, Some(r)) => PagedKv::queue(&r.shared, arrays, run),
            (None, None) => Ok(run(&arrays)?),
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
        if let Some(r) = &mut self.rows {
            r.later = on;
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


/// Several paged sequences stepped together: continuous batching over the model's block pool.
///
/// [`Cache::paged_rows`] joins caches of one paged model (from [`crate::Model::new_cache`]) into a
/// view whose forward passes carry every row at once. Each row keeps its own block table and
/// position; a step gives each row its own number of new tokens ([`Cache::schedule_rows`]),
/// left-padded to the longest, and attention reads every row's keys from its own blocks (per-row
/// rope positions and mask: [`crate::batch::BatchRows`]). Padding is not stored: it costs only
/// the step's compute. Recurrent layers keep each row's state, stacked along the batch axis
/// while the rows are joined; a row's padding in a step comes before its tokens and leaves its
/// state as it was ([`crate::batch::conv_input`], zero gates at padding positions).
/// [`Cache::into_rows`] gives the row caches back; [`Cache::select_rows`] and
/// [`Cache::merge_batch`] keep and add rows as for flat batch caches.
impl Cache {
    /// A view over `rows` (paged caches of one model, none of them a batch or a view).
    pub(crate) fn paged_rows(rows: Vec<Cache>) -> Result<Cache> {
        let first = rows.first().ok_or_else(|| ModelError::InvalidInput("paged_rows: no rows".into()))?;
        let n_layers = first.layers.len();
        let shared = match &first.paged {
            Some(p) => p.pool().clone(),
            None => return Err(ModelError::Cache("paged_rows joins paged caches (the model has no paged pool)".into())),
        };
        let (mut seqs, mut row_layers) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
        for c in rows {
            if c.batch.is_some() || c.rows.is_some() || c.layers.len() != n_layers {
                return Err(ModelError::Cache("paged_rows joins single-sequence caches of one model".into()));
            }
            let p = c.paged.ok_or_else(|| ModelError::Cache("paged_rows joins paged caches only".into()))?;
            if !Arc::ptr_eq(p.pool(), &shared) {
                return Err(ModelError::Cache("paged_rows: the caches belong to different models".into()));
            }
            seqs.push(p);
            row_layers.push(c.layers);
        }
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            layers.push(match &row_layers[0][i] {
                LayerCache::Kv(_) => LayerCache::Kv(KvCache::new(None)),
                LayerCache::Shared { anchor } => LayerCache::Shared { anchor: *anchor },
                LayerCache::Recurrent(s) => {
                    let slots = s.len();
                    let mut stacked = Vec::with_capacity(slots);
                    for slot in 0..slots {
                        let vals: Vec<Option<Array>> = row_layers
                            .iter_mut()
                            .map(|l| match &mut l[i] {
                                LayerCache::Recurrent(s) => s.get_mut(slot).and_then(Option::take),
                                _ => None,
                            })
                            .collect();
                        stacked.push(stack_rows(vals)?);
                    }
                    LayerCache::Recurrent(stacked)
                }
            });
        }
        let rows = PagedRows { shared, seqs, row_layers, steps: Vec::new(), pad: Vec::new(), cols: 0, later: false, packed: false };
        Ok(Cache { layers, paged: None, last_skipped: 0, batch: None, rows: Some(rows), position_delta: 0, gradient_checkpointing: false })
    }

    /// The row caches of a view ([`Cache::paged_rows`]), in row order, each with its own
    /// recurrent state.
    pub(crate) fn into_rows(self) -> Result<Vec<Cache>> {
        let Cache { layers, rows, .. } = self;
        let PagedRows { seqs, mut row_layers, .. } = rows.ok_or_else(|| ModelError::Cache("into_rows needs a view over paged rows".into()))?;
        let n = seqs.len();
        for (i, l) in layers.into_iter().enumerate() {
            let LayerCache::Recurrent(slots) = l else { continue };
            for (s, v) in slots.into_iter().enumerate() {
                let Some(v) = v else { continue };
                for (b, rl) in row_layers.iter_mut().enumerate() {
                    if let Some(LayerCache::Recurrent(rs)) = rl.get_mut(i) {
                        rs[s] = Some(if n == 1 { v.clone() } else { v.slice_axis(0, b, b + 1)? });
                    }
                }
            }
        }
        Ok(seqs.into_iter().zip(row_layers).map(|(p, layers)| Cache { layers, paged: Some(p), last_skipped: 0, batch: None, rows: None, position_delta: 0, gradient_checkpointing: false }).collect())
    }

    /// Rows of a view (0 for any other cache).
    pub(crate) fn num_rows(&self) -> usize {
        self.rows.as_ref().map_or(0, |r| r.seqs.len())
    }

    /// A paged cache that has not started yet: start it on all of `prompt` (the next forward
    /// passes of a view compute it, [`Cache::schedule_rows`]), reusing its cached prefix when
    /// `allow_prefix_skip`. Returns how many leading tokens the prefix cache serves.
    pub(crate) fn begin_paged(&mut self, prompt: &[u32], allow_prefix_skip: bool) -> Result<usize> {
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("a paged sequence needs at least one prompt token".into()));
        }
        let recurrent = self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_)));
        let p = self.paged.as_mut().ok_or_else(|| ModelError::Cache("begin_paged needs a paged cache".into()))?;
        let (skipped, snapshot) = p.begin_row(prompt, allow_prefix_skip, recurrent)?;
        // A skipped prefix of a model with recurrent layers starts from their state there.
        for (i, slots) in snapshot.into_iter().flatten() {
            if let Some(l) = self.layers.get_mut(i) {
                *l = LayerCache::Recurrent(slots);
            }
        }
        Ok(skipped)
    }

    /// Take the next forward pass's tokens packed (`[1, T]`, row `b`'s `counts[b]` tokens after
    /// the rows before it; [`crate::batch::Ragged`]) instead of `[B, L]` rows: flat batch
    /// caches, or a view over paged rows whose planned step ([`Cache::schedule_rows`]) has these
    /// counts.
    pub(crate) fn set_step_tokens(&mut self, counts: Vec<usize>) -> Result<()> {
        if let Some(r) = self.rows.as_mut() {
            let planned: Vec<usize> = r.steps.iter().map(|s| s.len).collect();
            if planned != counts {
                return Err(ModelError::InvalidInput(format!("packed step of {counts:?} tokens, planned {planned:?}")));
            }
            r.packed = true;
            return Ok(());
        }
        self.batch.as_mut().ok_or_else(|| ModelError::Cache("a packed step needs a batch cache".into()))?.set_step_tokens(counts)
    }

    /// Plan the next forward pass of a view: row `b` registers `inputs[b].0` and computes at
    /// most `inputs[b].1` of its tokens not yet computed. Returns each row's (first position,
    /// token count); the forward pass then takes `[rows, longest count]` tokens, each row's
    /// right-aligned (left padding ignored).
    pub(crate) fn schedule_rows(&mut self, inputs: &[(RowTokens, usize)]) -> Result<Vec<(usize, usize)>> {
        let r = self.rows.as_mut().ok_or_else(|| ModelError::Cache("schedule_rows needs a view over paged rows".into()))?;
        let steps = crate::paged::schedule_rows(&r.shared, &mut r.seqs, inputs)?;
        let cols = steps.iter().map(|s| s.len).max().unwrap_or(0);
        r.pad = steps.iter().map(|s| cols - s.len).collect();
        r.cols = cols;
        let out = steps.iter().map(|s| (s.start, s.len)).collect();
        r.steps = steps;
        Ok(out)
    }

    /// [`Cache::select_rows`] of a view: an index that repeats forks its row's sequence (the
    /// blocks are shared, a partial last block copied).
    pub(crate) fn select_paged_rows(&mut self, keep: &[usize]) -> Result<()> {
        let n = self.num_rows();
        if keep.is_empty() {
            return Err(ModelError::InvalidInput("select_rows: no rows kept".into()));
        }
        if let Some(&bad) = keep.iter().find(|&&r| r >= n) {
            return Err(ModelError::InvalidInput(format!("select_rows: row {bad} of {n}")));
        }
        if keep.len() == n && keep.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(());
        }
        let later = self.rows.as_ref().is_some_and(|r| r.later);
        let view = std::mem::replace(self, Cache::new(&CacheSpec { layers: Vec::new() }));
        let mut rows: Vec<Option<Cache>> = view.into_rows()?.into_iter().map(Some).collect();
        let mut out = Vec::with_capacity(keep.len());
        for (i, &r) in keep.iter().enumerate() {
            let row = rows[r].as_mut().ok_or_else(|| ModelError::Cache("select_rows: row taken (internal error)".into()))?;
            out.push(if keep[i + 1..].contains(&r) { row.fork_paged()? } else { rows[r].take().expect("checked above") });
        }
        *self = Cache::paged_rows(out)?;
        self.set_queue_with_outputs(later);
        Ok(())
    }

    /// [`Cache::merge_batch`] of two views: `other`'s rows after this one's.
    pub(crate) fn merge_paged_rows(&mut self, other: Cache) -> Result<()> {
        let later = self.rows.as_ref().is_some_and(|r| r.later);
        let view = std::mem::replace(self, Cache::new(&CacheSpec { layers: Vec::new() }));
        let mut rows = view.into_rows()?;
        rows.extend(other.into_rows()?);
        *self = Cache::paged_rows(rows)?;
        self.set_queue_with_outputs(later);
        Ok(())
    }

    /// A second paged sequence with this one's tokens and state (blocks shared).
    fn fork_paged(&mut self) -> Result<Cache> {
        let p = self.paged.as_mut().ok_or_else(|| ModelError::Cache("fork of a cache that is not paged".into()))?.fork()?;
        let layers = self.layers.iter().map(|l| if let LayerCache::Kv(_) = l { LayerCache::Kv(KvCache::new(None)) } else { l.clone() }).collect();
        Ok(Cache { layers, paged: Some(p), last_skipped: 0, batch: None, rows: None, position_delta: 0, gradient_checkpointing: false })
    }
}

/// Row `b` of `n` of a view's recurrent layers (stacked along the batch axis): every recurrent
/// layer's slots, `[1, ..]` each.
fn row_snapshot(layers: &[LayerCache], b: usize, n: usize) -> Result<crate::paged::Snapshot> {
    let mut out = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        if let LayerCache::Recurrent(s) = l {
            let slots = s.iter().map(|a| a.as_ref().map(|a| if n == 1 { Ok(a.clone()) } else { a.slice_axis(0, b, b + 1) }).transpose()).collect::<mlx_array::Result<Vec<_>>>()?;
            out.push((i, slots));
        }
    }
    Ok(out)
}

/// One recurrent slot of each row (`[1, ..]`, `None` before it is written) stacked along the
/// batch axis; rows without one get zeros (what an unwritten slot stands for).
fn stack_rows(vals: Vec<Option<Array>>) -> Result<Option<Array>> {
    let Some(like) = vals.iter().flatten().next() else { return Ok(None) };
    let zero = Array::zeros(&like.shape(), like.dtype())?;
    let filled: Vec<Array> = vals.into_iter().map(|v| v.unwrap_or_else(|| zero.clone())).collect();
    if filled.len() == 1 {
        return Ok(filled.into_iter().next());
    }
    let refs: Vec<&Array> = filled.iter().collect();
    Ok(Some(mlx_array::ops::concatenate(&refs, 0)?))
}
