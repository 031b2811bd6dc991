//! Batched caches: several sequences of different lengths in one `[B, L]` forward pass.
//!
//! A batch cache ([`Cache::new_batch`]) holds `B` rows in flat storage: attention K/V
//! `[B, H, T, D]` (sliding-window layers too: the window is applied by the mask, not by a
//! rotating buffer) and recurrent state `[B, ..]`. Rows are aligned on the right: row `b`'s
//! tokens occupy the columns `pad[b]..T`, the columns before them are left padding. Positions
//! follow from that: column `c` of row `b` holds position `c - pad[b]`, so rope runs with one
//! offset per row ([`crate::layers::Rope::forward_rows`]) and attention takes a boolean mask
//! ([`BatchRows::mask`]) that hides every padding key (and keeps the causal order and sliding
//! windows). A padding query sees only its own key, so no softmax row is empty. A batch with no
//! padding at all ([`BatchRows::uniform`]: prompts of one length, or rows left after the padded
//! ones) runs attention exactly as a single-sequence cache does.
//!
//! Recurrent mixers (GatedDeltaNet, LFM2's short convolution) see the step's validity
//! ([`BatchRows::step_valid`]) and zero their inputs at padding positions: a padding position
//! then leaves a fresh (zero) state as it found it, so a row's state is what the row alone
//! would have. Padding only ever comes before a row's first token, where the state is still
//! zero: rows are prefilled together from empty caches, and [`Cache::merge_batch`] adds the
//! padding of a merged row to its attention K/V only.
//!
//! Rows join ([`Cache::merge_batch`]) and leave ([`Cache::select_rows`]) between forward calls.
use crate::cache::{Cache, LayerCache};
use crate::kv::{CacheSpec, KvCache, LayerKind};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};
use std::cell::RefCell;

/// Where each row of a batch cache stands: its left padding and the current step's columns.
pub struct BatchRows {
    /// Padding columns before each row's first token.
    pad: Vec<usize>,
    /// `pad` as an i32 `[B]` array.
    pad_arr: Array,
    /// Columns stored so far (after the current step).
    cols: usize,
    /// First column of the current step and its length.
    step: (usize, usize),
    /// Masks built during the current step, by (queries, keys, window).
    masks: RefCell<Vec<((usize, usize, Option<usize>), Array)>>,
}

impl BatchRows {
    fn new(pad: Vec<usize>, cols: usize) -> Result<Self> {
        let p: Vec<i32> = pad.iter().map(|&p| p as i32).collect();
        let pad_arr = Array::from_slice(&p, &[p.len()])?;
        Ok(BatchRows {
            pad,
            pad_arr,
            cols,
            step: (cols, 0),
            masks: RefCell::new(Vec::new()),
        })
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.pad.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.pad.is_empty()
    }

    /// Left padding of each row, in columns.
    pub fn padding(&self) -> &[usize] {
        &self.pad
    }

    /// Whether no row has padding: every row then sits at the same positions, and attention
    /// runs as over a single-sequence cache (scalar rope offset, the family's own mask).
    pub fn uniform(&self) -> bool {
        self.pad.iter().all(|&p| p == 0)
    }

    /// Columns stored (the longest row's positions, padding included for the others).
    pub fn columns(&self) -> usize {
        self.cols
    }

    /// Positions row `b` holds (its tokens so far).
    pub fn row_len(&self, b: usize) -> usize {
        self.cols - self.pad[b]
    }

    /// Start a forward step over `l` columns.
    pub(crate) fn begin(&mut self, b: usize, l: usize) -> Result<()> {
        if b != self.pad.len() {
            return Err(ModelError::InvalidInput(format!(
                "batch cache holds {} rows, tokens have {b}",
                self.pad.len()
            )));
        }
        self.step = (self.cols, l);
        self.cols += l;
        self.masks.borrow_mut().clear();
        Ok(())
    }

    /// Per-row rope offsets (i32 `[B]`) of column `col`: `col - pad[b]`.
    pub fn positions(&self, col: usize) -> Result<Array> {
        Ok(Array::scalar(col as i32).sub(&self.pad_arr)?)
    }

    /// The largest position of the current step plus one (over all rows).
    pub fn longest(&self) -> usize {
        self.cols - self.pad.iter().copied().min().unwrap_or(0)
    }

    /// Boolean `[B, 1, lq, kn]` attention mask for `lq` queries that are the last of `kn` key
    /// columns: key `j` is visible to the query in column `i` when it is a token of the row
    /// (`j >= pad[b]`), not after the query, and (with `window`) within the window; a padding
    /// query sees its own column only.
    pub fn mask(&self, lq: usize, kn: usize, window: Option<usize>) -> Result<Array> {
        let key = (lq, kn, window);
        if let Some((_, m)) = self.masks.borrow().iter().find(|(k, _)| *k == key) {
            return Ok(m.clone());
        }
        if lq > kn {
            return Err(ModelError::Cache(format!("{lq} queries over {kn} keys")));
        }
        let b = self.pad.len() as i32;
        let kcol = Array::arange(0, kn as i64, DType::I32)?.reshape(&[1, 1, 1, kn as i32])?;
        let qcol = Array::arange((kn - lq) as i64, kn as i64, DType::I32)?
            .reshape(&[1, 1, lq as i32, 1])?;
        let pad = self.pad_arr.reshape(&[b, 1, 1, 1])?;
        let mut m = kcol.ge(&pad)?.logical_and(&kcol.le(&qcol)?)?;
        if let Some(w) = window {
            m = m.logical_and(&kcol.gt(&qcol.sub(&Array::scalar(w as i32))?)?)?;
        }
        let m = m.logical_or(&kcol.eq(&qcol)?)?;
        self.masks.borrow_mut().push((key, m.clone()));
        Ok(m)
    }

    /// Boolean `[B, L, 1]`: which positions of the current step are tokens (not padding), or
    /// `None` when every one is.
    pub fn step_valid(&self) -> Result<Option<Array>> {
        let (start, l) = self.step;
        if self.pad.iter().all(|&p| p <= start) {
            return Ok(None);
        }
        let b = self.pad.len() as i32;
        let col = Array::arange(start as i64, (start + l) as i64, DType::I32)?
            .reshape(&[1, l as i32, 1])?;
        Ok(Some(col.ge(&self.pad_arr.reshape(&[b, 1, 1])?)?))
    }
}

/// `x` (`[B, L, ..]`) with the positions `valid` (`[B, L, 1]`) marks false set to zero.
pub(crate) fn zero_padding(x: &Array, valid: Option<&Array>) -> Result<Array> {
    Ok(match valid {
        Some(v) => ops::where_(v, x, &Array::scalar(0f32).astype(x.dtype())?)?,
        None => x.clone(),
    })
}

impl Cache {
    /// An empty batch cache for `rows` sequences laid out as `spec` says (see [`crate::batch`]).
    /// Prefill it with the rows' prompts left-padded to one length and `padding` the pad count
    /// of each row (tokens in padding columns are ignored).
    pub fn new_batch(spec: &CacheSpec, padding: Vec<usize>) -> Result<Self> {
        let mut c = Cache::new(spec);
        for (l, k) in c.layers.iter_mut().zip(&spec.layers) {
            if matches!(k, LayerKind::SlidingAttention { .. }) {
                *l = LayerCache::Kv(KvCache::new(None));
            }
        }
        c.batch = Some(BatchRows::new(padding, 0)?);
        Ok(c)
    }

    /// The rows of a batch cache (`None` for a single-sequence cache).
    pub fn batch_rows(&self) -> Option<&BatchRows> {
        self.batch.as_ref()
    }

    /// Keep the rows `keep` (indices into the current rows, in the new order; an index may
    /// repeat, copying a row: one prefilled prompt becomes a group). Leading columns that are
    /// padding in every kept row are dropped.
    pub fn select_rows(&mut self, keep: &[usize]) -> Result<()> {
        let rows = self
            .batch
            .as_ref()
            .ok_or_else(|| ModelError::Cache("select_rows needs a batch cache".into()))?;
        if keep.is_empty() {
            return Err(ModelError::InvalidInput("select_rows: no rows kept".into()));
        }
        if let Some(&bad) = keep.iter().find(|&&r| r >= rows.len()) {
            return Err(ModelError::InvalidInput(format!(
                "select_rows: row {bad} of {}",
                rows.len()
            )));
        }
        let identity = keep.len() == rows.len() && keep.iter().enumerate().all(|(i, &r)| i == r);
        let pad: Vec<usize> = keep.iter().map(|&r| rows.pad[r]).collect();
        let drop = pad.iter().copied().min().unwrap_or(0);
        let cols = rows.cols;
        if identity && drop == 0 {
            return Ok(());
        }
        let idx = Array::from_slice(
            &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
            &[keep.len()],
        )?;
        for l in &mut self.layers {
            match l {
                LayerCache::Kv(c) => {
                    c.batch_select(if identity { None } else { Some(&idx) }, drop)?
                }
                LayerCache::Recurrent(s) if !identity => {
                    for a in s.iter_mut().flatten() {
                        *a = a.take(&idx, 0)?;
                    }
                }
                _ => {}
            }
        }
        self.batch = Some(BatchRows::new(
            pad.iter().map(|p| p - drop).collect(),
            cols - drop,
        )?);
        Ok(())
    }

    /// Append the rows of `other` (another batch cache of the same model) after this cache's
    /// rows. The cache with fewer columns is padded on the left, so every row stays right-aligned.
    pub fn merge_batch(&mut self, other: Cache) -> Result<()> {
        let (Some(a), Some(b)) = (self.batch.as_ref(), other.batch.as_ref()) else {
            return Err(ModelError::Cache(
                "merge_batch needs two batch caches".into(),
            ));
        };
        if self.layers.len() != other.layers.len() {
            return Err(ModelError::Cache(format!(
                "merge_batch: caches of {} and {} layers",
                self.layers.len(),
                other.layers.len()
            )));
        }
        let cols = a.cols.max(b.cols);
        let (da, db) = (cols - a.cols, cols - b.cols);
        let mut pad: Vec<usize> = a.pad.iter().map(|p| p + da).collect();
        pad.extend(b.pad.iter().map(|p| p + db));
        let (na, nb) = (a.len(), b.len());
        let Cache {
            layers: other_layers,
            ..
        } = other;
        for (l, o) in self.layers.iter_mut().zip(other_layers) {
            match (l, o) {
                (LayerCache::Kv(x), LayerCache::Kv(y)) => x.batch_concat(y, da, db, na, nb)?,
                (LayerCache::Recurrent(x), LayerCache::Recurrent(y)) => {
                    for (sx, sy) in x.iter_mut().zip(y) {
                        *sx = match (sx.take(), sy) {
                            (Some(p), Some(q)) => Some(ops::concatenate(&[&p, &q], 0)?),
                            (None, None) => None,
                            _ => {
                                return Err(ModelError::Cache(
                                    "merge_batch: recurrent state written in one cache only".into(),
                                ))
                            }
                        };
                    }
                }
                (LayerCache::Shared { .. }, LayerCache::Shared { .. }) => {}
                _ => {
                    return Err(ModelError::Cache(
                        "merge_batch: caches of different layouts".into(),
                    ))
                }
            }
        }
        self.batch = Some(BatchRows::new(pad, cols)?);
        Ok(())
    }
}
