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
//! A step may give each row its own number of new tokens (`Cache::set_step_tokens`: a row
//! decoding one token beside another's prompt chunk): the row's tokens are the step's last
//! columns, the ones before are padding, and a row that already holds tokens has them moved
//! right by its step padding when the step's K/V are stored (`BatchRows::realign`), so every
//! row stays right-aligned with all its padding on the left.
//!
//! Recurrent mixers (GatedDeltaNet, LFM2's short convolution) see the step's validity
//! ([`BatchRows::step_valid`]) and zero their inputs at padding positions, which come before a
//! row's tokens in the step: the gates leave the state as it was there, and the convolution
//! window of a row's tokens skips them (`conv_input`), so a row's state is what the row alone
//! would have. [`Cache::merge_batch`] adds the padding of a merged row to its attention K/V
//! only (a row that has not stepped yet has a zero state).
//!
//! A step may also take its tokens packed (`Cache::set_step_tokens`: `[1, T]`, each row's
//! tokens after the previous row's, no padding; [`Ragged`]). Layers that work token by token
//! run over the packed tokens; attention stores the step's K/V laid out as above (right-aligned,
//! padding only there) and runs each row's queries against its own keys, and a recurrence runs
//! over the rows laid out with padding ([`Ragged::to_rows`]).
//!
//! Rows join ([`Cache::merge_batch`]) and leave ([`Cache::select_rows`]) between forward calls.
//!
//! A step over rows of the paged pool (`Cache::paged_rows`) uses the same [`BatchRows`]
//! interface with nothing stored in columns: each step's columns are its own, row `b` fills its
//! last ones from position `start[b]`, and its keys come from its blocks
//! ([`kv_paged::KvPool::read`], each row's from its first key position, padded at the end), so
//! the mask is built from each row's key start and count.
use crate::cache::{Cache, LayerCache};
use crate::kv::{CacheSpec, KvCache, LayerKind};
use crate::{ModelError, Result};
use mlx_array::{ops, Array, DType};
use std::cell::RefCell;

/// (queries, keys, sliding window) of a batch mask.
type MaskKey = (usize, usize, Option<usize>);

/// Where each row of a batch cache stands: its left padding and the current step's columns.
pub struct BatchRows {
    /// Padding columns before each row's first token.
    pad: Vec<usize>,
    /// `pad` as an i32 `[B]` array.
    pad_arr: Array,
    /// Column of each row's position 0 (i32 `[B]`): column `c` of row `b` holds position
    /// `c - origin[b]`. `pad` for flat batch caches; `pad - start` for a step over paged rows.
    origin: Array,
    /// Columns stored so far (after the current step).
    cols: usize,
    /// First column of the current step and its length.
    step: (usize, usize),
    /// Masks built during the current step, by (queries, keys, window).
    masks: RefCell<Vec<(MaskKey, Array)>>,
    /// A step over rows of the paged pool ([`Cache::paged_rows`]): nothing is stored in
    /// columns, each row's keys are read from its own blocks.
    paged: Option<PagedKeys>,
    /// Flat batch caches: each row's padding columns at the start of the next step
    /// ([`Cache::set_step_tokens`]), taken by [`BatchRows::begin`].
    next_step_pad: Option<Vec<usize>>,
    /// The current step's per-row leading padding (i32 `[B]`), when some row has any.
    step_pad: Option<Array>,
    /// The current step's realignment of the stored columns (i32 `[B, 1, T, 1]`), when a row
    /// that holds tokens starts the step with padding ([`BatchRows::realign`]).
    realign: Option<Array>,
    /// Flat batch caches: each row's token count in the next step when it takes them packed
    /// ([`Cache::set_step_tokens`]), taken by [`BatchRows::begin_tokens`].
    next_packed: Option<Vec<usize>>,
    /// The current step's packed layout, when its tokens come packed ([`Ragged`]).
    ragged: Option<Ragged>,
}

/// The keys a step over paged rows attends to.
struct PagedKeys {
    /// Per kind of attention (`None` full, `Some(w)` a sliding window of `w`): each row's first
    /// key position and key count (i32 `[B]` each), keys padded at the end to the longest row.
    groups: Vec<(Option<usize>, Array, Array)>,
    /// The largest position of the step plus one.
    longest: usize,
}

impl BatchRows {
    fn new(pad: Vec<usize>, cols: usize) -> Result<Self> {
        let p: Vec<i32> = pad.iter().map(|&p| p as i32).collect();
        let pad_arr = Array::from_slice(&p, &[p.len()])?;
        Ok(BatchRows {
            pad,
            origin: pad_arr.clone(),
            pad_arr,
            cols,
            step: (cols, 0),
            masks: RefCell::new(Vec::new()),
            paged: None,
            next_step_pad: None,
            step_pad: None,
            realign: None,
            next_packed: None,
            ragged: None,
        })
    }

    /// One step of `l` columns over rows of the paged pool: row `b` has `pad[b]` padding columns,
    /// then its tokens from position `start[b]`; `groups` gives, per kind of attention, each
    /// row's first key position and key count.
    /// With `packed`, the step takes each row's tokens packed ([`Ragged`]) instead of `[B, l]`.
    pub(crate) fn paged(pad: Vec<usize>, start: &[usize], l: usize, groups: Vec<(Option<usize>, Vec<usize>, Vec<usize>)>, packed: bool) -> Result<Self> {
        let i32s = |v: &[usize]| -> Result<Array> { Ok(Array::from_slice(&v.iter().map(|&x| x as i32).collect::<Vec<_>>(), &[v.len()])?) };
        let origin: Vec<i32> = pad.iter().zip(start).map(|(&p, &s)| p as i32 - s as i32).collect();
        let longest = pad.iter().zip(start).map(|(&p, &s)| s + l - p).max().unwrap_or(0);
        let ragged = if packed {
            let counts: Vec<usize> = pad.iter().map(|&p| l - p).collect();
            let mut keys = Vec::with_capacity(groups.len());
            for (w, ks, kl) in &groups {
                let mut ranges = Vec::with_capacity(counts.len());
                for b in 0..counts.len() {
                    // the row's queries are the last of its keys
                    if ks[b] + kl[b] != start[b] + counts[b] {
                        return Err(ModelError::Cache(format!("paged row {b}: keys {}..{} do not end at its last query {} (internal error)", ks[b], ks[b] + kl[b], start[b] + counts[b])));
                    }
                    ranges.push((0, kl[b]));
                }
                keys.push((Some(*w), ranges));
            }
            Some(Ragged::new(counts, start.to_vec(), keys))
        } else {
            None
        };
        let groups = groups.into_iter().map(|(w, ks, kl)| Ok((w, i32s(&ks)?, i32s(&kl)?))).collect::<Result<Vec<_>>>()?;
        Ok(BatchRows {
            pad_arr: i32s(&pad)?,
            origin: Array::from_slice(&origin, &[origin.len()])?,
            pad,
            cols: l,
            step: (0, l),
            masks: RefCell::new(Vec::new()),
            paged: Some(PagedKeys { groups, longest }),
            next_step_pad: None,
            step_pad: None,
            realign: None,
            next_packed: None,
            ragged,
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
    /// runs as over a single-sequence cache (scalar rope offset, the family's own mask). Never
    /// for a step over paged rows (each row has its own positions and keys) or a packed step.
    pub fn uniform(&self) -> bool {
        self.paged.is_none() && self.ragged.is_none() && self.pad.iter().all(|&p| p == 0)
    }

    /// Columns stored (the longest row's positions, padding included for the others).
    pub fn columns(&self) -> usize {
        self.cols
    }

    /// Positions row `b` holds (its tokens so far).
    pub fn row_len(&self, b: usize) -> usize {
        self.cols - self.pad[b]
    }

    /// Start a forward step over `l` columns. With step padding set
    /// ([`BatchRows::begin_tokens`]), row `b`'s tokens are the last `l - step_pad[b]` columns of
    /// the step: its padding grows by `step_pad[b]`, and a row that already holds tokens has
    /// them moved right by as many columns when the step's K/V are stored ([`BatchRows::realign`]),
    /// so every row stays right-aligned.
    pub(crate) fn begin(&mut self, b: usize, l: usize) -> Result<()> {
        if b != self.pad.len() {
            return Err(ModelError::InvalidInput(format!(
                "batch cache holds {} rows, tokens have {b}",
                self.pad.len()
            )));
        }
        self.step_pad = None;
        self.realign = None;
        if let Some(sp) = self.next_step_pad.take() {
            if sp.len() != b || sp.iter().any(|&p| p > l) {
                return Err(ModelError::InvalidInput(format!("step padding {sp:?} for {b} rows of {l} columns")));
            }
            if sp.iter().any(|&p| p > 0) {
                let t = self.cols;
                let moved = sp.iter().zip(&self.pad).any(|(&p, &pd)| p > 0 && pd < t);
                if moved {
                    // row b: stored column j (< t + p) comes from column j - p; the step's own
                    // columns stay where they are
                    let n = t + l;
                    let idx: Vec<i32> = sp.iter().flat_map(|&p| (0..n).map(move |j| if j >= p && j < t + p { (j - p) as i32 } else { j as i32 })).collect();
                    self.realign = Some(Array::from_slice(&idx, &[b, 1, n, 1])?);
                }
                let i32s: Vec<i32> = sp.iter().map(|&p| p as i32).collect();
                self.step_pad = Some(Array::from_slice(&i32s, &[b])?);
                for (pd, &p) in self.pad.iter_mut().zip(&sp) {
                    *pd += p;
                }
                let p: Vec<i32> = self.pad.iter().map(|&p| p as i32).collect();
                self.pad_arr = Array::from_slice(&p, &[b])?;
                self.origin = self.pad_arr.clone();
            }
        }
        self.step = (self.cols, l);
        self.cols += l;
        self.masks.borrow_mut().clear();
        Ok(())
    }

    /// Start a forward step over `tokens`: `[B, L]`, or `[1, T]` packed when
    /// [`Cache::set_step_tokens`] set each row's count (the step is then `[B, widest]` with each
    /// row's tokens right-aligned in storage, and [`BatchRows::ragged`] describes the packing).
    pub(crate) fn begin_tokens(&mut self, tokens: &Array) -> Result<()> {
        self.ragged = None;
        let (b, l) = (tokens.dims()[0] as usize, tokens.dims()[1] as usize);
        let Some(counts) = self.next_packed.take() else { return self.begin(b, l) };
        let total: usize = counts.iter().sum();
        if b != 1 || l != total {
            return Err(ModelError::InvalidInput(format!("a packed step of {total} tokens over {} rows takes [1, {total}] tokens, got {:?}", counts.len(), tokens.shape())));
        }
        let cols = counts.iter().copied().max().unwrap_or(0);
        self.next_step_pad = Some(counts.iter().map(|&c| cols - c).collect());
        self.begin(counts.len(), cols)?;
        let first: Vec<usize> = counts.iter().zip(&self.pad).map(|(&c, &p)| self.step.0 + cols - c - p).collect();
        let keys = vec![(None, self.pad.iter().map(|&p| (p, self.cols)).collect())];
        self.ragged = Some(Ragged::new(counts, first, keys));
        Ok(())
    }

    /// Take the next step's tokens packed, `counts[b]` for row `b` (flat batch caches).
    pub(crate) fn set_step_tokens(&mut self, counts: Vec<usize>) -> Result<()> {
        if self.paged.is_some() || counts.len() != self.pad.len() || counts.iter().all(|&c| c == 0) {
            return Err(ModelError::InvalidInput(format!("packed step of {counts:?} tokens for a batch of {} rows", self.pad.len())));
        }
        self.next_packed = Some(counts);
        Ok(())
    }

    /// The current step's packed layout, when its tokens come packed.
    pub fn ragged(&self) -> Option<&Ragged> {
        self.ragged.as_ref()
    }

    /// The current step's realignment of a flat batch layer (i32 `[B, 1, T, 1]`: stored column
    /// `j` of row `b` takes column `idx[b, j]`), when a row holding tokens has step padding.
    pub(crate) fn realign(&self) -> Option<&Array> {
        self.realign.as_ref()
    }

    /// Per-row rope offsets (i32 `[B]`) of column `col`: `col - pad[b]` (a step over paged
    /// rows: `col - pad[b] + start[b]`).
    pub fn positions(&self, col: usize) -> Result<Array> {
        Ok(Array::scalar(col as i32).sub(&self.origin)?)
    }

    /// The largest position of the current step plus one (over all rows).
    pub fn longest(&self) -> usize {
        match &self.paged {
            Some(p) => p.longest,
            None => self.cols - self.pad.iter().copied().min().unwrap_or(0),
        }
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
        if lq > kn && self.paged.is_none() {
            return Err(ModelError::Cache(format!("{lq} queries over {kn} keys")));
        }
        if let Some(p) = &self.paged {
            let m = self.paged_mask(p, lq, kn, window)?;
            self.masks.borrow_mut().push((key, m.clone()));
            return Ok(m);
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

    /// [`BatchRows::mask`] of a step over paged rows: the `lq` queries are the step's last
    /// columns, key `j` of row `b` is position `kv_start[b] + j` and exists for `j < kv_len[b]`
    /// (the keys [`kv_paged::KvPool::read`] returns, padded at the end); a padding query sees key 0
    /// only.
    fn paged_mask(&self, p: &PagedKeys, lq: usize, kn: usize, window: Option<usize>) -> Result<Array> {
        let (_, kv_start, kv_len) = p.groups.iter().find(|(w, _, _)| *w == window).ok_or_else(|| ModelError::Cache(format!("no paged keys for attention window {window:?}")))?;
        let b = self.pad.len() as i32;
        let col = |a: &Array| a.reshape(&[b, 1, 1, 1]);
        let j = Array::arange(0, kn as i64, DType::I32)?.reshape(&[1, 1, 1, kn as i32])?;
        let c = Array::arange((self.cols - lq) as i64, self.cols as i64, DType::I32)?.reshape(&[1, 1, lq as i32, 1])?;
        let kpos = col(kv_start)?.add(&j)?;
        let qpos = c.sub(&col(&self.origin)?)?;
        let mut m = j.lt(&col(kv_len)?)?.logical_and(&kpos.le(&qpos)?)?;
        if let Some(w) = window {
            m = m.logical_and(&kpos.gt(&qpos.sub(&Array::scalar(w as i32))?)?)?;
        }
        let padding = c.lt(&col(&self.pad_arr)?)?;
        Ok(m.logical_or(&padding.logical_and(&j.eq(&Array::scalar(0i32))?)?)?)
    }

    /// Boolean `[B, L, 1]`: which positions of the current step are tokens (not padding), or
    /// `None` when every one is. A row's padding in a step always comes before its tokens.
    pub fn step_valid(&self) -> Result<Option<Array>> {
        let (start, l) = self.step;
        if self.step_pad.is_none() && self.pad.iter().all(|&p| p <= start) {
            return Ok(None);
        }
        let b = self.pad.len() as i32;
        let col = Array::arange(start as i64, (start + l) as i64, DType::I32)?
            .reshape(&[1, l as i32, 1])?;
        let mut valid = col.ge(&self.pad_arr.reshape(&[b, 1, 1])?)?;
        if let Some(sp) = &self.step_pad {
            let i = Array::arange(0, l as i64, DType::I32)?.reshape(&[1, l as i32, 1])?;
            valid = valid.logical_and(&i.ge(&sp.reshape(&[b, 1, 1])?)?)?;
        }
        Ok(Some(valid))
    }
}

/// The layout of a step whose tokens come packed, `[1, T, ..]` with no padding: row `b`'s
/// `counts[b]` tokens (possibly none) follow the rows before it. Per-token layers (embeddings,
/// norms, projections, MLPs, experts) run over the packed tokens as they are; attention splits
/// them by row ([`Ragged::rope`], [`Ragged::attend`]: each row's queries against its own keys,
/// a row of one query without a mask), and a recurrence runs over them laid out as rows
/// ([`Ragged::to_rows`], [`Ragged::to_packed`]).
#[derive(Clone)]
pub struct Ragged {
    counts: Vec<usize>,
    /// Each row's first packed column.
    offsets: Vec<usize>,
    /// The position of each row's first token in the step.
    first: Vec<usize>,
    /// Per kind of attention (`Some(window)`; `None`: every kind), each row's keys in the K/V the
    /// step fetches: columns `from..to` of its row, the row's queries being the last of them.
    keys: RowKeys,
}

/// [`Ragged`]'s keys of each row per kind of attention.
type RowKeys = Vec<(Option<Option<usize>>, Vec<(usize, usize)>)>;

impl Ragged {
    fn new(counts: Vec<usize>, first: Vec<usize>, keys: RowKeys) -> Self {
        let offsets = counts.iter().scan(0, |o, &c| {
            let at = *o;
            *o += c;
            Some(at)
        }).collect();
        Ragged { counts, offsets, first, keys }
    }

    /// Tokens of each row.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The widest row's token count.
    fn widest(&self) -> usize {
        self.counts.iter().copied().max().unwrap_or(0)
    }

    /// The step past a cut to each row's last token ([`Ragged::last_tokens`]): one token a row,
    /// at its last position, with the same keys.
    pub fn last_only(&self) -> Ragged {
        let first = self.first.iter().zip(&self.counts).map(|(&f, &c)| f + c.max(1) - 1).collect();
        Ragged::new(vec![1; self.counts.len()], first, self.keys.clone())
    }

    /// Each row's last token of packed `x` (`[1, T, ..]`), packed: `[1, B, ..]` (a row without
    /// tokens in the step gets some other row's, never read).
    pub fn last_tokens(&self, x: &Array) -> Result<Array> {
        let idx: Vec<i32> = self.offsets.iter().zip(&self.counts).map(|(&o, &c)| (o + c).max(1) as i32 - 1).collect();
        Ok(x.take(&Array::from_slice(&idx, &[idx.len()])?, 1)?)
    }

    /// Packed `x` (`[1, T, ..]`, or `[1, H, T, D]` with `axis` 2) laid out as rows: `[B, L, ..]`
    /// (`[B, H, L, D]`), `L` the widest row, each row's tokens right-aligned after zeros.
    pub fn to_rows(&self, x: &Array, axis: usize) -> Result<Array> {
        let (b, l) = (self.counts.len(), self.widest());
        let total: usize = self.counts.iter().sum();
        let mut zshape = x.shape();
        if !(axis == 1 || axis == 2 && zshape.len() == 4) || zshape[0] != 1 || zshape[axis] != total {
            return Err(ModelError::InvalidInput(format!("packed step of {total} tokens: input {:?} on axis {axis}", x.shape())));
        }
        zshape[axis] = 1;
        let xz = mlx_array::ops::concatenate(&[x, &Array::zeros(&zshape, x.dtype())?], axis as i32)?;
        let idx: Vec<i32> = self.counts.iter().zip(&self.offsets).flat_map(|(&c, &o)| (0..l).map(move |j| if j + c < l { total as i32 } else { (o + j + c - l) as i32 })).collect();
        let y = xz.take(&Array::from_slice(&idx, &[b * l])?, axis as i32)?;
        let mut shape: Vec<i32> = x.shape().iter().map(|&d| d as i32).collect();
        if axis == 1 {
            shape.splice(0..2, [b as i32, l as i32]);
            return Ok(y.reshape(&shape)?);
        }
        Ok(y.reshape(&[shape[1], b as i32, l as i32, shape[3]])?.transpose(&[1, 0, 2, 3])?)
    }

    /// Rows `y` (`[B, L, ..]`, each row's tokens right-aligned) packed: `[1, T, ..]`.
    pub fn to_packed(&self, y: &Array) -> Result<Array> {
        let l = self.widest();
        let idx: Vec<i32> = self.counts.iter().enumerate().flat_map(|(b, &c)| (l - c..l).map(move |j| (b * l + j) as i32)).collect();
        let mut shape: Vec<i32> = y.shape().iter().map(|&d| d as i32).collect();
        if shape.len() < 2 || shape[0] as usize != self.counts.len() || shape[1] as usize != l {
            return Err(ModelError::InvalidInput(format!("rows {:?} of a packed step of {:?} tokens", y.shape(), self.counts)));
        }
        shape.splice(0..2, [-1]);
        Ok(y.reshape(&shape)?.take(&Array::from_slice(&idx, &[idx.len()])?, 0)?.expand_dims(0)?)
    }

    /// Packed `x` (`[1, H, T, D]`) with each row's tokens rotated by `rope(part, first
    /// position)`.
    pub fn rope(&self, x: &Array, rope: impl Fn(&Array, usize) -> Result<Array>) -> Result<Array> {
        let parts = self.counts.iter().zip(&self.offsets).zip(&self.first).filter(|((&c, _), _)| c > 0).map(|((&c, &o), &p)| rope(&x.slice_axis(2, o, o + c)?, p)).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Array> = parts.iter().collect();
        Ok(mlx_array::ops::concatenate(&refs, 2)?)
    }

    /// Attention of packed queries `q` (`[1, Hq, T, D]`) over the step's fetched keys and values
    /// (`[B, Hkv, K, D]`, as the cache returns them): each row's queries against its own keys
    /// (causal, or a sliding `window`), one query without a mask. Returns `[1, Hq, T, D]`.
    pub fn attend(&self, q: &Array, k: &Array, v: &Array, scale: f32, window: Option<usize>) -> Result<Array> {
        let keys = &self.keys.iter().find(|(w, _)| w.is_none() || *w == Some(window)).ok_or_else(|| ModelError::Cache(format!("no keys for attention window {window:?} (internal error)")))?.1;
        let mut outs = Vec::with_capacity(self.counts.len());
        for (b, ((&c, &o), &(from, to))) in self.counts.iter().zip(&self.offsets).zip(keys).enumerate() {
            if c == 0 {
                continue;
            }
            // a window needs only the keys of its queries' windows
            let from = match window {
                Some(w) => from.max(to.saturating_sub(c + w - 1)),
                None => from,
            };
            let row = |a: &Array| -> Result<Array> { Ok(a.slice_axis(0, b, b + 1)?.slice_axis(2, from, to)?) };
            let mask = crate::layers::causal_mask(c, window);
            outs.push(crate::layers::sdpa(&q.slice_axis(2, o, o + c)?, &row(k)?, &row(v)?, scale, mask)?);
        }
        let refs: Vec<&Array> = outs.iter().collect();
        Ok(mlx_array::ops::concatenate(&refs, 2)?)
    }
}

/// The input of a causal depthwise convolution over `[prev | x]`: `prev` (`[B, K-1, C]`, the
/// last inputs before this step) then `x` (`[B, L, C]`, zero at the positions `valid` marks
/// false). Padding comes before a row's tokens; a row with `p` padding positions gets them moved
/// before its `prev`, so its tokens' windows see `prev` and the state kept after the step (the
/// last `K - 1` inputs) is the row's own: a padded step leaves a non-zero state as the row
/// alone would.
pub(crate) fn conv_input(prev: &Array, x: &Array, valid: Option<&Array>) -> Result<Array> {
    let full = ops::concatenate(&[prev, x], 1)?;
    let Some(v) = valid else { return Ok(full) };
    let (b, k1, l) = (x.dim(0)?, prev.dim(1)?, x.dim(1)?);
    let n = k1 + l;
    // each row's padding count [B, 1]; positions before it read column k1 (padding: zero)
    let p = Array::scalar(l as i32).sub(&v.astype(DType::I32)?.sum(&[1], false)?)?;
    let j = Array::arange(0, n as i64, DType::I32)?.reshape(&[1, n as i32])?;
    let shifted = ops::where_(&j.lt(&p.add(&Array::scalar(k1 as i32))?)?, &j.sub(&p)?, &j)?;
    let idx = ops::where_(&j.lt(&p)?, &Array::scalar(k1 as i32), &shifted)?;
    let idx = idx.reshape(&[b as i32, n as i32, 1])?.broadcast_to(&full.shape())?;
    Ok(full.take_along_axis(&idx, 1)?)
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
        if self.rows.is_some() {
            return self.select_paged_rows(keep);
        }
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
        if self.rows.is_some() && other.rows.is_some() {
            return self.merge_paged_rows(other);
        }
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
                        // rows that have not stepped yet hold no state: zeros
                        let zeros = |like: &Array, rows: usize| -> Result<Array> {
                            let mut s = like.shape();
                            s[0] = rows;
                            Ok(Array::zeros(&s, like.dtype())?)
                        };
                        *sx = match (sx.take(), sy) {
                            (Some(p), Some(q)) => Some(ops::concatenate(&[&p, &q], 0)?),
                            (Some(p), None) => Some(ops::concatenate(&[&p, &zeros(&p, nb)?], 0)?),
                            (None, Some(q)) => Some(ops::concatenate(&[&zeros(&q, na)?, &q], 0)?),
                            (None, None) => None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of 2, 0 and 3 tokens: laid out as rows, each right-aligned after zeros, and packed
    /// back; each row's last token; the rope and key ranges of the step past the cut.
    #[test]
    fn packed_steps_lay_out_as_rows_and_back() {
        let g = Ragged::new(vec![2, 0, 3], vec![5, 9, 0], vec![(None, vec![(1, 8), (8, 8), (5, 8)])]);
        let x = Array::from_slice(&[1f32, 2., 3., 4., 5.], &[1, 5, 1]).unwrap();
        let rows = g.to_rows(&x, 1).unwrap();
        assert_eq!(rows.shape(), vec![3, 3, 1]);
        assert_eq!(rows.to_vec::<f32>().unwrap(), vec![0., 1., 2., 0., 0., 0., 3., 4., 5.]);
        assert_eq!(g.to_packed(&rows).unwrap().to_vec::<f32>().unwrap(), vec![1., 2., 3., 4., 5.]);
        // [1, H, T, D] with H = 2, D = 1 on axis 2
        let h = Array::from_slice(&[1f32, 2., 3., 4., 5., 10., 20., 30., 40., 50.], &[1, 2, 5, 1]).unwrap();
        let hr = g.to_rows(&h, 2).unwrap();
        assert_eq!(hr.shape(), vec![3, 2, 3, 1]);
        assert_eq!(hr.to_vec::<f32>().unwrap(), vec![0., 1., 2., 0., 10., 20., 0., 0., 0., 0., 0., 0., 3., 4., 5., 30., 40., 50.]);
        // row 1 has no token: it gets row 0's last, never read
        assert_eq!(g.last_tokens(&x).unwrap().to_vec::<f32>().unwrap(), vec![2., 2., 5.]);
        let seen = RefCell::new(Vec::new());
        g.rope(&h, |a, p| {
            seen.borrow_mut().push((a.dim(2)?, p));
            Ok(a.clone())
        })
        .unwrap();
        assert_eq!(seen.into_inner(), vec![(2, 5), (3, 0)]);
        let cut = g.last_only();
        assert_eq!((cut.counts(), &cut.first[..]), (&[1, 1, 1][..], &[6, 9, 2][..]));
        assert!(g.to_rows(&x.slice_axis(1, 0, 4).unwrap(), 1).is_err());
    }
}
