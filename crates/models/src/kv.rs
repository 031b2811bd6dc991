//! Per-layer cache layout ([`CacheSpec`]) and the K/V storage of one attention layer
//! ([`KvCache`]): flat (contiguous, grown in steps, as mlx-lm's `KVCache`) or rotating
//! (sliding-window layers keep only the last `window` positions). Nothing here knows about
//! paging: the paged pool ([`crate::paged`]) uses a [`KvCache`] as a sequence's contiguous mirror.
use crate::{ModelError, Result};
use mlx_array::{ops, Array};

/// What one layer caches.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerKind {
    /// Full-attention K/V: `[B, kv_heads, T, head_dim]`.
    Attention { kv_heads: usize, head_dim: usize },
    /// Sliding-window attention: only the last `window` positions matter.
    SlidingAttention { kv_heads: usize, head_dim: usize, window: usize },
    /// Reuses the K/V of layer `anchor` (no storage of its own).
    SharedKv { anchor: usize },
    /// Recurrent state slots (conv state, SSM state): opaque to the cache.
    Recurrent { slots: usize },
}

/// A model's cache layout, layer by layer.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSpec {
    pub layers: Vec<LayerKind>,
}

/// Growth step of flat caches, in positions (as mlx-lm's KVCache).
const STEP: usize = 256;

/// Positions flat storage holds past its whole [`STEP`]s ([`flat_capacity`]).
const SPARE: usize = 8;

/// The positions a flat cache allocates when it must hold `positions` (a reserve or a step
/// past its storage): whole 256-position steps (as mlx-lm's KVCache) plus 8, never a multiple
/// of 256.
///
/// libmlx 0.32's CUDA attention sends a single query whose keys are a slice of a buffer of a
/// multiple of 256 positions, once there are 256 keys or more, to cuDNN. cuDNN builds a graph
/// for every buffer size at its first use, and each call pays cuDNN's host set-up. The 8 spare
/// positions keep one-query steps on libmlx's vector kernel instead: on an H100 the first step
/// past 256 keys no longer stalls (a speculative cycle there took 99 ms, now 22-31), and
/// fresh-process decoding of a Qwen3-8B-shaped model went from 143-144 to 152-154 tok/s
/// (BENCHMARKS.md, "CUDA, the 8B/0.6B pair"). On the CPU the spare positions cost nothing
/// measurable.
pub fn flat_capacity(positions: usize) -> usize {
    positions.div_ceil(STEP) * STEP + SPARE
}

/// The slots a rotating cache of window `window` allocates when it must hold `held` positions:
/// [`flat_capacity`] up to the window plus 8 (plus one where that would be a whole
/// number of steps), never a multiple of 256. Slots past the window stay unused: one-query steps
/// read a slice of the first `window`, so that libmlx's CUDA attention keeps them on its vector
/// kernel (cuDNN takes head sizes up to 128 in bf16 and f16, as Gemma 3 27B's sliding layers
/// with their 1024-position window), as it does for flat storage.
pub fn rotating_capacity(held: usize, window: usize) -> usize {
    let full = window + SPARE + usize::from((window + SPARE) % STEP == 0);
    flat_capacity(held).min(full)
}

/// K/V storage of one attention layer.
#[derive(Clone)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    /// `Some(w)`: rotating storage of the last `w` positions.
    window: Option<usize>,
    /// Rotating caches: positions held (the first `held` slots of the buffers).
    held: usize,
    /// Rotating caches holding a full window written in place: the slot of the oldest position
    /// (the next one overwritten). `None`: the slots are in temporal order.
    ring: Option<usize>,
    /// Flat caches: the first position written (positions before it were never given to this
    /// cache: a paged mirror restarted at it).
    first: usize,
    /// Flat caches: positions the storage is sized for at its next growth, at least
    /// ([`KvCache::reserve`]).
    reserve: usize,
}

impl KvCache {
    pub fn new(window: Option<usize>) -> Self {
        KvCache { keys: None, values: None, offset: 0, window, held: 0, ring: None, first: 0, reserve: 0 }
    }

    /// Positions seen so far (the rope offset of the next token).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Flat caches: size the storage for at least `positions` positions when it next grows (at
    /// once if it already holds some), so that a generation of known length grows it once, at
    /// its prefill, rather than every 256 positions (each growth copies the held K/V into
    /// new buffers, and on the CUDA backend a fresh process pays one-time costs at each).
    /// Rotating caches ignore it (their storage is the window).
    pub fn reserve(&mut self, positions: usize) -> Result<()> {
        if self.window.is_some() || positions <= self.reserve {
            return Ok(());
        }
        self.reserve = positions;
        if let (Some(k), Some(v)) = (self.keys.clone(), self.values.clone()) {
            if positions > k.dim(2)? {
                self.grow_to(positions, &k, &v)?;
            }
        }
        Ok(())
    }

    /// Flat storage for at least `positions` (and the reserve), in whole steps, keeping the
    /// held positions; `k`, `v` give the shape and dtype when there is none yet.
    fn grow_to(&mut self, positions: usize, k: &Array, v: &Array) -> Result<()> {
        let grow = flat_capacity(positions.max(self.reserve)) - self.offset;
        let (keys, values) = (self.keys.take(), self.values.take());
        self.keys = Some(grow_axis2(keys, k, grow, self.offset)?);
        self.values = Some(grow_axis2(values, v, grow, self.offset)?);
        Ok(())
    }

    /// The storage arrays (keys, values) once written.
    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter())
    }

    /// Empty the cache, as if positions `0..offset` had been seen and dropped (a paged mirror
    /// refilled from the pool from `offset` on).
    pub(crate) fn restart_at(&mut self, offset: usize) {
        *self = KvCache { offset, first: offset, ..KvCache::new(self.window) };
    }

    /// Keys and values of positions `from..to` as stored: views of the storage (a copy only
    /// where a rotating cache's ring wraps inside the span), or `None` when the cache does not
    /// hold every one of them.
    pub(crate) fn span(&self, from: usize, to: usize) -> Result<Option<(Array, Array)>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        if from >= to || to > self.offset {
            return Ok(None);
        }
        let Some(w) = self.window else {
            if from < self.first {
                return Ok(None);
            }
            return Ok(Some((k.slice_axis(2, from, to)?, v.slice_axis(2, from, to)?)));
        };
        let start = self.offset - self.held;
        if from < start {
            return Ok(None);
        }
        // ring None: slots 0..held in temporal order; Some(r): a full window, slot r the oldest
        let slot = |p: usize| match self.ring {
            None => p - start,
            Some(r) => (r + p - start) % w,
        };
        // the slots in use (`w` once the ring is full; storage may hold spare ones past them)
        let (a, n, used) = (slot(from), to - from, self.held);
        let part = |x: &Array| -> Result<Array> {
            if a + n <= used {
                return Ok(x.slice_axis(2, a, a + n)?);
            }
            Ok(ops::concatenate(&[&x.slice_axis(2, a, used)?, &x.slice_axis(2, 0, a + n - used)?], 2)?)
        };
        Ok(Some((part(k)?, part(v)?)))
    }

    /// Append `k`, `v` (`[B, H, L, D]`) and return the keys/values attention should use now.
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let l = k.dim(2)?;
        if let Some(w) = self.window {
            return if l == 1 { self.rotating_step(k, v, w) } else { self.rotating_concat(k, v, l, w) };
        }
        let need = self.offset + l;
        let cap = self.keys.as_ref().map_or(Ok(0), |a| a.dim(2))?;
        if need > cap {
            // the held positions (`offset`, fewer than `cap` after a trim) are kept
            self.grow_to(need, k, v)?;
        }
        let kb = self.keys.as_ref().unwrap().slice_update(k, &[0, 0, self.offset, 0])?;
        let vb = self.values.as_ref().unwrap().slice_update(v, &[0, 0, self.offset, 0])?;
        self.offset = need;
        let out = (kb.slice_axis(2, 0, need)?, vb.slice_axis(2, 0, need)?);
        self.keys = Some(kb);
        self.values = Some(vb);
        Ok(out)
    }

    /// The held positions in temporal order (a copy only when the ring has wrapped).
    fn temporal(&self) -> Result<Option<(Array, Array)>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        let order = |a: &Array| -> Result<Array> {
            Ok(match self.ring {
                Some(0) | None => a.slice_axis(2, 0, self.held)?,
                Some(r) => ops::concatenate(&[&a.slice_axis(2, r, self.held)?, &a.slice_axis(2, 0, r)?], 2)?,
            })
        };
        Ok(Some((order(k)?, order(v)?)))
    }

    /// Several new positions (prefill, a verify step): the last `w - 1` held positions, in
    /// temporal order, then the new ones, so every new query sees its whole window (the
    /// attention mask limits each to `w`); the last `w - 1` of them are kept.
    fn rotating_concat(&mut self, k: &Array, v: &Array, l: usize, w: usize) -> Result<(Array, Array)> {
        let (keys, values) = match self.temporal()? {
            Some((pk, pv)) => {
                let drop = self.held.saturating_sub(w - 1);
                let (pk, pv) = (pk.slice_axis(2, drop, self.held)?, pv.slice_axis(2, drop, self.held)?);
                (ops::concatenate(&[&pk, k], 2)?, ops::concatenate(&[&pv, v], 2)?)
            }
            None => (k.clone(), v.clone()),
        };
        self.offset += l;
        let t = keys.dim(2)?;
        let keep = (w - 1).min(t);
        self.keys = Some(keys.slice_axis(2, t - keep, t)?);
        self.values = Some(values.slice_axis(2, t - keep, t)?);
        (self.held, self.ring) = (keep, None);
        Ok((keys, values))
    }

    /// One new position, written in place (as mlx-lm's RotatingKVCache): into the next free slot
    /// until the window is full, then over the oldest. The slots come back in storage order;
    /// with at most `w` keys a single query needs no mask, so their order does not matter
    /// (rope was applied before caching).
    fn rotating_step(&mut self, k: &Array, v: &Array, w: usize) -> Result<(Array, Array)> {
        let slot = match self.ring {
            Some(r) => r,
            None => {
                let cap = self.keys.as_ref().map_or(Ok(0), |a| a.dim(2))?;
                if self.held + 1 > cap {
                    // grow_axis2 keeps the first `held` slots and appends `grow` fresh ones
                    let grow = rotating_capacity(self.held + 1, w) - self.held;
                    let (keys, values) = (self.keys.take(), self.values.take());
                    self.keys = Some(grow_axis2(keys, k, grow, self.held)?);
                    self.values = Some(grow_axis2(values, v, grow, self.held)?);
                }
                self.held
            }
        };
        let kb = self.keys.as_ref().unwrap().slice_update(k, &[0, 0, slot, 0])?;
        let vb = self.values.as_ref().unwrap().slice_update(v, &[0, 0, slot, 0])?;
        self.offset += 1;
        if self.ring.is_some() {
            self.ring = Some((slot + 1) % w);
        } else {
            self.held += 1;
            if self.held == w {
                self.ring = Some(0);
            }
        }
        let out = if self.held == kb.dim(2)? { (kb.clone(), vb.clone()) } else { (kb.slice_axis(2, 0, self.held)?, vb.slice_axis(2, 0, self.held)?) };
        self.keys = Some(kb);
        self.values = Some(vb);
        Ok(out)
    }

    /// Number of positions currently stored (≤ offset for rotating caches).
    pub fn stored(&self) -> usize {
        match (&self.keys, self.window) {
            (Some(_), Some(_)) => self.held,
            (Some(_), None) => self.offset,
            _ => 0,
        }
    }

    /// Whether [`KvCache::trim`] of `n` positions would succeed (it changes nothing when not).
    pub fn can_trim(&self, n: usize) -> bool {
        if n > self.offset {
            return false;
        }
        match self.window {
            None => true,
            Some(w) => {
                let held = self.stored();
                n <= held && held - n >= (w - 1).min(self.offset - n)
            }
        }
    }

    /// Forget the last `n` positions (rollback, prefix reuse). A rotating cache refuses (and is
    /// left as it was) when what would remain is less than the next position's window needs:
    /// it keeps only the last `window` positions, so a deep rollback must re-prefill instead.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if n > self.offset {
            return Err(ModelError::Cache(format!("cannot trim {n} of {} positions", self.offset)));
        }
        if let Some(w) = self.window {
            let held = self.stored();
            let need = (w - 1).min(self.offset - n);
            if n > held || held - n < need {
                return Err(ModelError::Cache(format!(
                    "sliding-window cache holds the last {held} positions: after trimming {n} the next position's window needs {need} (re-prefill instead)"
                )));
            }
            if let Some((k, v)) = self.temporal()? {
                self.keys = Some(k.slice_axis(2, 0, held - n)?);
                self.values = Some(v.slice_axis(2, 0, held - n)?);
                (self.held, self.ring) = (held - n, None);
            }
        }
        self.offset -= n;
        self.first = self.first.min(self.offset);
        Ok(())
    }
}

impl KvCache {
    /// Batch caches ([`crate::batch`]): keep the rows `idx` (all rows for `None`) and drop the
    /// first `drop` positions (padding in every kept row). Flat caches only.
    pub(crate) fn batch_select(&mut self, idx: Option<&Array>, drop: usize) -> Result<()> {
        if self.window.is_some() || drop > self.offset {
            return Err(ModelError::Cache(format!("batch_select: dropping {drop} of {} positions (flat caches only)", self.offset)));
        }
        let (Some(k), Some(v)) = (self.keys.take(), self.values.take()) else {
            self.offset -= drop;
            return Ok(());
        };
        let cut = |a: Array| -> Result<Array> {
            let a = a.slice_axis(2, drop, self.offset)?;
            Ok(match idx {
                Some(i) => a.take(i, 0)?,
                None => a,
            })
        };
        self.keys = Some(cut(k)?);
        self.values = Some(cut(v)?);
        self.offset -= drop;
        self.first = 0;
        Ok(())
    }

    /// Batch caches: the stored positions reordered along the time axis by `idx` (i32
    /// `[B, 1, T, 1]`, `T` the positions stored; [`crate::batch::BatchRows::realign`]). Returns the
    /// new keys and values.
    pub(crate) fn batch_realign(&mut self, idx: &Array) -> Result<(Array, Array)> {
        let (Some(k), Some(v)) = (self.keys.take(), self.values.take()) else {
            return Err(ModelError::Cache("batch_realign: an empty layer cache".into()));
        };
        let n = self.offset;
        let pick = |a: Array| -> Result<Array> {
            let a = a.slice_axis(2, 0, n)?;
            let s = a.shape();
            Ok(a.take_along_axis(&idx.broadcast_to(&[s[0], s[1], n, s[3]])?, 2)?)
        };
        let (k, v) = (pick(k)?, pick(v)?);
        self.keys = Some(k.clone());
        self.values = Some(v.clone());
        self.first = 0;
        Ok((k, v))
    }

    /// Batch caches: the `na` rows of `self` left-padded by `da` positions, then the `nb` rows of
    /// `other` left-padded by `db` (both then hold the same number of positions). A side that
    /// has stored nothing yet (rows that join before their first step) is all padding.
    pub(crate) fn batch_concat(&mut self, other: KvCache, da: usize, db: usize, na: usize, nb: usize) -> Result<()> {
        if self.window.is_some() || other.window.is_some() || self.offset + da != other.offset + db {
            return Err(ModelError::Cache(format!("batch_concat: {} + {da} and {} + {db} positions (flat caches only)", self.offset, other.offset)));
        }
        if self.keys.is_none() && other.keys.is_none() {
            self.offset += da;
            return Ok(());
        }
        // (shape, dtype) of the side that has storage, for the other's padding
        let like = |a: &Option<Array>, b: &Option<Array>| a.as_ref().or(b.as_ref()).map(|x| (x.shape(), x.dtype()));
        let (lk, lv) = (like(&self.keys, &other.keys), like(&self.values, &other.values));
        let part = |a: Option<Array>, used: usize, pad: usize, rows: usize, like: &Option<(Vec<usize>, mlx_array::DType)>| -> Result<Array> {
            let Some(a) = a else {
                let (s, dt) = like.as_ref().ok_or_else(|| ModelError::Cache("batch_concat: an empty layer cache".into()))?;
                return Ok(Array::zeros(&[rows, s[1], used + pad, s[3]], *dt)?);
            };
            let a = a.slice_axis(2, 0, used)?;
            if a.dim(0)? != rows {
                return Err(ModelError::Cache(format!("batch_concat: {} rows where {rows} were expected", a.dim(0)?)));
            }
            if pad == 0 {
                return Ok(a);
            }
            let s = a.shape();
            let z = Array::zeros(&[s[0], s[1], pad, s[3]], a.dtype())?;
            Ok(ops::concatenate(&[&z, &a], 2)?)
        };
        let (ka, va) = (part(self.keys.take(), self.offset, da, na, &lk)?, part(self.values.take(), self.offset, da, na, &lv)?);
        let (kb, vb) = (part(other.keys, other.offset, db, nb, &lk)?, part(other.values, other.offset, db, nb, &lv)?);
        self.keys = Some(ops::concatenate(&[&ka, &kb], 0)?);
        self.values = Some(ops::concatenate(&[&va, &vb], 0)?);
        self.offset += da;
        self.first = 0;
        Ok(())
    }
}

fn grow_axis2(old: Option<Array>, like: &Array, grow: usize, used: usize) -> Result<Array> {
    let s = like.shape();
    let fresh = Array::zeros(&[s[0], s[1], grow, s[3]], like.dtype())?;
    Ok(match old {
        Some(o) => ops::concatenate(&[&o.slice_axis(2, 0, used)?, &fresh], 2)?,
        None => fresh,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trimmed flat cache takes a chunk longer than its free capacity (it regrows from what it
    /// still holds, not from its old capacity).
    #[test]
    fn flat_cache_grows_after_trim() {
        let mut c = KvCache::new(None);
        let kv = |l: usize, x: f32| Array::full(&[1, 2, l, 4], x, DType::F32).unwrap();
        c.update_and_fetch(&kv(200, 1.0), &kv(200, 1.0)).unwrap();
        c.trim(199).unwrap();
        let (k, _) = c.update_and_fetch(&kv(343, 2.0), &kv(343, 2.0)).unwrap();
        assert_eq!(k.shape(), &[1, 2, 344, 4]);
        let v = k.to_vec::<f32>().unwrap();
        assert_eq!((v[0], v[4]), (1.0, 2.0));
    }
    use mlx_array::random::{self, Key};
    use mlx_array::{AttentionMask, DType};

    /// A reserved flat cache allocates its storage once and holds the same keys and values as
    /// one grown step by step, through a trim and past the reserve (then it grows as before);
    /// reserving after writes keeps what is held.
    #[test]
    fn a_reserved_flat_cache_grows_once_and_holds_the_same() {
        let chunk = |n: usize, seed: u64| random::normal(&[1, 2, n, 4], DType::F32, &Key::new(seed).unwrap()).unwrap();
        let (mut grown, mut reserved) = (KvCache::new(None), KvCache::new(None));
        reserved.reserve(300).unwrap();
        let cap = |c: &KvCache| c.keys.as_ref().unwrap().dim(2).unwrap();
        for (i, n) in [40usize, 1, 200, 7, 30, 1, 100].into_iter().enumerate() {
            if i == 4 {
                grown.trim(5).unwrap();
                reserved.trim(5).unwrap();
            }
            let (k, v) = (chunk(n, i as u64), chunk(n, 100 + i as u64));
            let (a, b) = (grown.update_and_fetch(&k, &v).unwrap(), reserved.update_and_fetch(&k, &v).unwrap());
            assert_eq!(a.0.to_vec::<f32>().unwrap(), b.0.to_vec::<f32>().unwrap(), "keys after chunk {i}");
            assert_eq!(a.1.to_vec::<f32>().unwrap(), b.1.to_vec::<f32>().unwrap(), "values after chunk {i}");
            if reserved.offset() <= 300 {
                assert_eq!(cap(&reserved), 520, "one allocation for the reserve (300 rounded up to the step, and the spare 8)");
            }
        }
        assert_eq!(reserved.offset(), 374);
        assert_eq!(cap(&reserved), 520);
        // past the reserve: grows as an unreserved cache
        let (k, v) = (chunk(200, 7), chunk(200, 8));
        reserved.update_and_fetch(&k, &v).unwrap();
        assert_eq!(cap(&reserved), 776);
        // reserving a written cache grows it at once, keeping its positions
        let held = grown.span(0, grown.offset()).unwrap().unwrap();
        grown.reserve(1000).unwrap();
        assert_eq!(cap(&grown), 1032);
        let again = grown.span(0, grown.offset()).unwrap().unwrap();
        assert_eq!(held.0.to_vec::<f32>().unwrap(), again.0.to_vec::<f32>().unwrap());
        assert_eq!(held.1.to_vec::<f32>().unwrap(), again.1.to_vec::<f32>().unwrap());
    }

    /// Flat storage, grown step by step or reserved, is never a whole number of 256-position
    /// steps (libmlx's CUDA attention would send one query over it to cuDNN, see [`flat_capacity`]),
    /// and holds what it was grown for.
    #[test]
    fn flat_storage_is_never_whole_steps() {
        let kv = |l: usize| Array::zeros(&[1, 1, l, 2], DType::F32).unwrap();
        let mut c = KvCache::new(None);
        for n in [1usize, 255, 1, 7, 256, 300] {
            c.update_and_fetch(&kv(n), &kv(n)).unwrap();
            let cap = c.keys.as_ref().unwrap().dim(2).unwrap();
            assert!(cap % 256 != 0 && cap >= c.offset(), "{} positions in storage of {cap}", c.offset());
        }
        for p in [1usize, 255, 256, 257, 4096] {
            assert!(flat_capacity(p) >= p && flat_capacity(p) % 256 != 0, "{p} positions: {}", flat_capacity(p));
        }
    }

    /// Rotating storage, grown step by step up to its window, after a prefill, and as a full
    /// ring, is never a whole number of 256-position steps ([`rotating_capacity`]), and one-query
    /// steps get exactly the held positions (the window once full).
    #[test]
    fn rotating_storage_is_never_whole_steps() {
        let kv = |l: usize| Array::zeros(&[1, 1, l, 2], DType::F32).unwrap();
        for w in [4usize, 248, 256, 504, 520, 1024] {
            for prefill in [0usize, 300] {
                let mut c = KvCache::new(Some(w));
                if prefill > 0 {
                    c.update_and_fetch(&kv(prefill), &kv(prefill)).unwrap();
                }
                for _ in 0..w + 3 {
                    let (k, v) = c.update_and_fetch(&kv(1), &kv(1)).unwrap();
                    let held = c.stored();
                    assert!(held == c.offset().min(w) && k.dim(2).unwrap() == held && v.dim(2).unwrap() == held, "window {w}: {held} held at {}", c.offset());
                    let cap = c.keys.as_ref().unwrap().dim(2).unwrap();
                    assert!(cap % 256 != 0 && cap >= held && cap <= w + 9, "window {w}, prefill {prefill}: {held} held in storage of {cap}");
                    mlx_array::eval(&c.arrays().collect::<Vec<_>>()).unwrap();
                }
            }
        }
        for (held, w) in [(1usize, 4usize), (1, 1024), (257, 1024), (1024, 1024), (248, 248), (504, 504)] {
            let cap = rotating_capacity(held, w);
            assert!(cap >= held && cap % 256 != 0, "{held} of window {w}: {cap}");
        }
    }

    /// A rotating cache (ring buffer for single steps, concatenation for chunks, trims) gives
    /// the same attention as a flat cache of every position under the sliding-window mask.
    #[test]
    fn rotating_cache_matches_flat_with_window_mask() {
        let (w, h, d) = (4usize, 2usize, 8usize);
        let mut rot = KvCache::new(Some(w));
        let mut flat = KvCache::new(None);
        // chunk sizes (> 0) and trims (< 0: `Ok` expected when the bool is true): a trim before the
        // window fills, a prefill past the window, steps that wrap the ring, a trim of a wrapped
        // ring, trims deeper than what the next window needs (refused, cache unchanged), chunks
        // after a full ring
        let plan: &[(i64, bool)] = &[
            (2, true), (-1, true), (6, true), (1, true), (1, true), (1, true), (1, true), (1, true), (1, true), (1, true),
            (-1, true), (1, true), (-2, false), (3, true), (-1, false), (1, true), (-1, true), (1, true), (1, true), (2, true), (1, true),
        ];
        // Every span a rotating cache holds equals the flat cache's rows (ring wraps inside the
        // span included); one reaching before what it holds is `None`.
        let spans_match = |rot: &KvCache, flat: &KvCache, s: usize| {
            let (o, held) = (rot.offset(), rot.stored());
            for from in o - held..o {
                for to in from + 1..=o {
                    let (rk, rv) = rot.span(from, to).unwrap().unwrap_or_else(|| panic!("step {s}: span {from}..{to} held"));
                    let (fk, fv) = flat.span(from, to).unwrap().unwrap();
                    assert_eq!(rk.to_vec::<f32>().unwrap(), fk.to_vec::<f32>().unwrap(), "step {s}: keys {from}..{to}");
                    assert_eq!(rv.to_vec::<f32>().unwrap(), fv.to_vec::<f32>().unwrap(), "step {s}: values {from}..{to}");
                }
            }
            if held < o {
                assert!(rot.span(o - held - 1, o).unwrap().is_none(), "step {s}: a position no longer held");
            }
            assert!(rot.span(o, o + 1).unwrap().is_none() && flat.span(0, o + 1).unwrap().is_none(), "step {s}: past the end");
        };
        for (s, &(n, ok)) in plan.iter().enumerate() {
            spans_match(&rot, &flat, s);
            if n < 0 {
                let n = (-n) as usize;
                let before = (rot.offset(), rot.stored());
                assert_eq!(rot.trim(n).is_ok(), ok, "step {s}: trim {n} at offset {} holding {}", before.0, before.1);
                if ok {
                    flat.trim(n).unwrap();
                } else {
                    assert_eq!((rot.offset(), rot.stored()), before, "a refused trim leaves the cache as it was");
                }
                assert_eq!(rot.offset(), flat.offset());
                continue;
            }
            let l = n as usize;
            let ks = Key::new(100 + s as u64).unwrap().split_n(3).unwrap();
            let k = random::normal(&[1, h, l, d], DType::F32, &ks[0]).unwrap().add_scalar(s as f32).unwrap();
            let v = random::normal(&[1, h, l, d], DType::F32, &ks[1]).unwrap();
            let q = random::normal(&[1, h, l, d], DType::F32, &ks[2]).unwrap();
            let (rk, rv) = rot.update_and_fetch(&k, &v).unwrap();
            let (fk, fv) = flat.update_and_fetch(&k, &v).unwrap();
            assert!(rk.dim(2).unwrap() <= w - 1 + l, "step {s}: rotating cache returned {} keys", rk.dim(2).unwrap());
            assert!(rot.stored() <= w && rot.stored() <= rot.offset());
            let mask = AttentionMask::SlidingWindow(w);
            let got = q.sdpa(&rk, &rv, 0.5, mask).unwrap().to_vec::<f32>().unwrap();
            let want = q.sdpa(&fk, &fv, 0.5, mask).unwrap().to_vec::<f32>().unwrap();
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "step {s} (offset {}): {a} vs {b}", rot.offset());
            }
        }
        assert!(rot.stored() <= w);
        spans_match(&rot, &flat, plan.len());
    }

    /// A flat cache restarted at a position (a paged mirror) holds no span before it.
    #[test]
    fn restarted_flat_cache_spans_start_at_its_first_position() {
        let mut c = KvCache::new(None);
        c.restart_at(5);
        let k = Array::from_slice(&(0..12).map(|x| x as f32).collect::<Vec<_>>(), &[1, 1, 3, 4]).unwrap();
        c.update_and_fetch(&k, &k).unwrap();
        assert!(c.span(4, 8).unwrap().is_none());
        let (sk, _) = c.span(6, 8).unwrap().unwrap();
        assert_eq!(sk.to_vec::<f32>().unwrap(), (4..12).map(|x| x as f32).collect::<Vec<_>>());
        // back to 4, below where it started: it holds nothing, then what comes next
        c.trim(4).unwrap();
        assert!(c.span(3, 4).unwrap().is_none());
        c.update_and_fetch(&k.slice_axis(2, 2, 3).unwrap(), &k.slice_axis(2, 2, 3).unwrap()).unwrap();
        assert_eq!(c.span(4, 5).unwrap().unwrap().0.to_vec::<f32>().unwrap(), vec![8.0, 9.0, 10.0, 11.0]);
        assert!(c.span(3, 5).unwrap().is_none());
    }
}
