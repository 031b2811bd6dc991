//! [`KvPool`]: the K/V storage of every attention layer as MLX arrays, written at slot mappings
//! and gathered back into contiguous `[B, kv_heads, L, head_dim]` for attention.
//!
//! Each layer with its own K/V keeps two arrays of shape `[capacity * block_size + 1, kv_heads,
//! head_dim]` (the last row is a padding slot that is never written). KV-shared layers read their
//! anchor's arrays. A group's capacity starts at [`crate::KvConfig::initial_blocks`] and doubles,
//! up to the group's `num_blocks`, when a step or copy needs a block beyond it: memory follows
//! the blocks in use and in the prefix cache, not the budget.
use mlx_array::{ops::scatter_rows, Array, DType};

use crate::error::{Error, Result};
use crate::layout::{Attention, KvLayout};
use crate::manager::{BlockCopy, GroupStep, Step};

#[derive(Debug, Clone)]
struct Storage {
    k: Array,
    v: Array,
}

/// Runs of consecutive slots at most this many are written as that many slice updates (a copy
/// each), more as one scatter. On the GPU a scatter is one kernel and beats many small copies.
/// MLX's CPU scatter goes element by element: criterion's `write` group (512 rows of a
/// Qwen3-0.6B layer, f32) took 7.3 ms as a scatter over 32 runs against 1.1 ms for one run, so
/// on the CPU a fragmented prefill stays on slice updates. New blocks of a step come in id
/// order, so a prefill's slots are mostly one run or a few, and a decode block's 16 rows one.
fn max_runs() -> usize {
    match mlx_array::default_device() {
        Ok(mlx_array::Device::Gpu) => 8,
        _ => 4096,
    }
}

/// `dst` with rows `slots` replaced by `rows`.
fn put_rows(dst: &Array, slots: &[u32], rows: &Array, max_runs: usize) -> Result<Array> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new(); // (first slot, first row, length)
    for (i, &s) in slots.iter().enumerate() {
        match runs.last_mut() {
            Some((first, _, len)) if *first + *len == s as usize => *len += 1,
            _ => runs.push((s as usize, i, 1)),
        }
    }
    if runs.len() > max_runs {
        let idx: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
        return Ok(scatter_rows(dst, &Array::from_slice(&idx, &[idx.len()])?, rows)?);
    }
    let mut out = dst.clone();
    for (first, row, len) in runs {
        out = out.slice_update(&rows.slice_axis(0, row, row + len)?, &[first, 0, 0])?;
    }
    Ok(out)
}

/// K/V arrays for the layers of a [`KvLayout`].
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    dtype: DType,
    /// Per layer: its own storage, or None for KV-shared layers.
    storage: Vec<Option<Storage>>,
    /// Per group: blocks its storage holds now.
    capacity: Vec<usize>,
    /// Storage changed since the last [`KvPool::eval`] / [`KvPool::async_eval`].
    dirty: bool,
    /// [`max_runs`] on the device the pool was made for.
    max_runs: usize,
}

/// The index arrays of one forward step over a batch of sequences, built once and used by every
/// layer (see [`KvPool::batch`]).
#[derive(Debug, Clone)]
pub struct StepBatch {
    groups: Vec<GroupBatch>,
    /// Query (new token) count of each sequence.
    pub q_lens: Vec<usize>,
    /// Position of each sequence's first new token.
    pub q_starts: Vec<usize>,
}

#[derive(Debug, Clone)]
struct GroupBatch {
    attention: Attention,
    /// Slots of all new tokens, sequence-major: `sum(q_lens)` of them.
    write: Vec<u32>,
    /// The sequences' steps in this group without their write slots (those are in `write`),
    /// for the key slots...
    steps: Vec<GroupStep>,
    /// ...the slot padding the shorter ones...
    pad: u32,
    /// ...and the key slots (`B * max_len`) on the device, made by the first read that gathers:
    /// a decode step that reads a contiguous mirror never does (nor pays for the slot list).
    read: std::cell::OnceCell<Array>,
    max_len: usize,
    kv_lens: Vec<usize>,
    kv_starts: Vec<usize>,
}

impl GroupBatch {
    /// The key slots on the device.
    fn read_slots(&self) -> Result<&Array> {
        if let Some(a) = self.read.get() {
            return Ok(a);
        }
        let mut read: Vec<u32> = Vec::with_capacity(self.steps.len() * self.max_len);
        for gs in &self.steps {
            read.extend(gs.kv_slots());
            read.extend(std::iter::repeat_n(self.pad, self.max_len - gs.kv_len));
        }
        let a = Array::from_slice(&read, &[read.len()])?;
        Ok(self.read.get_or_init(|| a))
    }
}

impl StepBatch {
    /// Number of sequences.
    pub fn batch_size(&self) -> usize {
        self.q_lens.len()
    }
    /// Position of the first key sequence `seq` attends to in `group` (0 for full attention;
    /// sliding groups start inside the window of the step's first query).
    pub fn kv_start(&self, group: usize, seq: usize) -> Option<usize> {
        self.groups.get(group).and_then(|g| g.kv_starts.get(seq).copied())
    }
    /// Key count (before padding) of each sequence in a group, and the padded length.
    pub fn kv_lens(&self, group: usize) -> Option<(&[usize], usize)> {
        self.groups.get(group).map(|g| (&g.kv_lens[..], g.max_len))
    }

    /// Boolean mask `[B, 1, T, max_len]` (true = attend) for the keys [`KvPool::read`] returns
    /// for a group: causal, within the window of sliding groups, and off the padding. Needs the
    /// same query count `T` in every sequence (e.g. batched decode). For one sequence,
    /// `AttentionMask::Causal` (or `SlidingWindow`) is equivalent and cheaper.
    pub fn mask(&self, group: usize) -> Result<Array> {
        let g = self.groups.get(group).ok_or_else(|| Error::Pool(format!("no group {group}")))?;
        let t = self.q_lens[0];
        if self.q_lens.iter().any(|&q| q != t) {
            return Err(Error::Pool(format!("mask needs equal query counts, got {:?}", self.q_lens)));
        }
        let b = self.q_lens.len();
        let mut m = Vec::with_capacity(b * t * g.max_len);
        for s in 0..b {
            for i in 0..t {
                let qp = self.q_starts[s] + i;
                for j in 0..g.max_len {
                    let kp = g.kv_starts[s] + j;
                    let in_window = match g.attention {
                        Attention::Full => true,
                        Attention::Sliding { window } => kp + window > qp,
                    };
                    m.push(j < g.kv_lens[s] && kp <= qp && in_window);
                }
            }
        }
        Ok(Array::from_slice(&m, &[b, 1, t, g.max_len])?)
    }
}

impl KvPool {
    /// Zeroed storage of `dtype` for every layer that keeps its own K/V.
    pub fn new(layout: &KvLayout, dtype: DType) -> Result<Self> {
        let bs = layout.config.block_size;
        let capacity: Vec<usize> = layout
            .groups
            .iter()
            .map(|g| layout.config.initial_blocks.map_or(g.num_blocks, |n| n.clamp(1, g.num_blocks)))
            .collect();
        let storage = layout
            .layers
            .iter()
            .zip(&layout.placement)
            .enumerate()
            .map(|(i, (l, &(g, anchor)))| {
                if anchor != i {
                    return Ok(None);
                }
                let shape = [capacity[g] * bs + 1, l.kv_heads, l.head_dim];
                let k = Array::zeros(&shape, dtype)?;
                let v = Array::zeros(&shape, dtype)?;
                mlx_array::eval(&[&k, &v])?;
                Ok(Some(Storage { k, v }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvPool { layout: layout.clone(), dtype, storage, capacity, dirty: false, max_runs: max_runs() })
    }

    /// Blocks the storage of `group` holds now (at most the group's `num_blocks`).
    pub fn capacity(&self, group: usize) -> Option<usize> {
        self.capacity.get(group).copied()
    }

    /// Grow `group`'s storage to hold blocks `0..blocks` (doubling, capped at `num_blocks`).
    /// Slots keep their rows; the padding row moves to the new end.
    fn reserve(&mut self, group: usize, blocks: usize) -> Result<()> {
        let cap = self.capacity[group];
        if blocks <= cap {
            return Ok(());
        }
        let max = self.layout.groups[group].num_blocks;
        if blocks > max {
            return Err(Error::Pool(format!("block {} out of range for group {group} ({max} blocks)", blocks - 1)));
        }
        let new = blocks.max(2 * cap).min(max);
        let bs = self.layout.config.block_size;
        for &layer in &self.layout.groups[group].layers {
            let spec = self.layout.layers[layer];
            let Some(st) = self.storage[layer].as_mut() else { continue };
            let tail = Array::zeros(&[(new - cap) * bs + 1, spec.kv_heads, spec.head_dim], self.dtype)?;
            let grow = |x: &Array| -> Result<Array> { Ok(mlx_array::ops::concatenate(&[&x.slice_axis(0, 0, cap * bs)?, &tail], 0)?) };
            st.k = grow(&st.k)?;
            st.v = grow(&st.v)?;
        }
        self.capacity[group] = new;
        self.dirty = true;
        Ok(())
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn pad_slot(&self, group: usize) -> u32 {
        (self.capacity[group] * self.layout.config.block_size) as u32
    }

    /// The index arrays for one forward step over `steps` (one per sequence, in batch order).
    /// Grows the storage first if a step's blocks lie beyond it. A batch is meant for the step
    /// it was built for: a later `batch` or [`KvPool::copy_blocks`] that grows the storage moves
    /// the padding row its reads point at.
    pub fn batch(&mut self, steps: &[&Step]) -> Result<StepBatch> {
        if steps.is_empty() {
            return Err(Error::Pool("empty batch".into()));
        }
        let ng = self.layout.groups.len();
        let bs = self.layout.config.block_size;
        for g in 0..ng {
            // the highest block any step writes or reads
            let top = steps.iter().filter_map(|s| s.groups.get(g)).flat_map(|gs| gs.slot_mapping.iter().map(|&x| x as usize / bs).chain(gs.block_table.iter().map(|&b| b as usize))).max();
            if let Some(top) = top {
                self.reserve(g, top + 1)?;
            }
        }
        let mut groups = Vec::with_capacity(ng);
        for g in 0..ng {
            let mut write = Vec::new();
            let (mut kv_lens, mut kv_starts, mut gsteps) = (Vec::new(), Vec::new(), Vec::with_capacity(steps.len()));
            for s in steps {
                let gs = s.groups.get(g).ok_or_else(|| Error::Pool(format!("step has {} groups, pool {ng}", s.groups.len())))?;
                if gs.block_size != bs || gs.first_block != gs.kv_start / bs || gs.block_table.len() < (gs.kv_start + gs.kv_len).div_ceil(bs) - gs.first_block {
                    return Err(Error::Pool(format!("group {g}: step's block table does not cover its keys (block size {} vs {bs})", gs.block_size)));
                }
                write.extend(&gs.slot_mapping);
                kv_lens.push(gs.kv_len);
                kv_starts.push(gs.kv_start);
                // what the key slots need: the write slots are already in `write`
                gsteps.push(GroupStep {
                    slot_mapping: Vec::new(),
                    kv_start: gs.kv_start,
                    kv_len: gs.kv_len,
                    first_block: gs.first_block,
                    block_table: gs.block_table.clone(),
                    block_size: gs.block_size,
                });
            }
            let max_len = *kv_lens.iter().max().expect("non-empty");
            let pad = self.pad_slot(g);
            if write.iter().any(|&x| x >= pad) || gsteps.iter().flat_map(|gs| &gs.block_table).any(|&b| b as usize >= self.capacity[g]) {
                return Err(Error::Pool(format!("slot out of range for group {g} ({pad} slots)")));
            }
            groups.push(GroupBatch {
                attention: self.layout.groups[g].attention,
                write,
                steps: gsteps,
                pad,
                read: std::cell::OnceCell::new(),
                max_len,
                kv_lens,
                kv_starts,
            });
        }
        Ok(StepBatch { groups, q_lens: steps.iter().map(|s| s.len).collect(), q_starts: steps.iter().map(|s| s.start).collect() })
    }

    fn check_layer(&self, layer: usize) -> Result<(usize, usize)> {
        self.layout.placement.get(layer).copied().ok_or_else(|| Error::Pool(format!("no layer {layer} of {}", self.layout.layers.len())))
    }

    /// Write the step's new keys and values of `layer`, each `[B, kv_heads, T, head_dim]` with
    /// `B * T` the batch's new tokens in sequence order (ragged batches: `B = 1`, concatenated).
    pub fn write(&mut self, layer: usize, batch: &StepBatch, k: &Array, v: &Array) -> Result<()> {
        let (g, _) = self.check_layer(layer)?;
        let gb = &batch.groups[g];
        self.scatter(layer, &gb.write, k, v)
    }

    /// Write keys and values `[1, kv_heads, n, head_dim]` of `layer` at `slots` (`n` of them,
    /// each in a block the storage already holds: one a step of [`KvPool::batch`] handed out).
    /// For writes gathered over several steps (one scatter instead of one a step).
    pub fn write_rows(&mut self, layer: usize, slots: &[u32], k: &Array, v: &Array) -> Result<()> {
        let (g, _) = self.check_layer(layer)?;
        let pad = self.pad_slot(g);
        if let Some(s) = slots.iter().find(|&&s| s >= pad) {
            return Err(Error::Pool(format!("slot {s} beyond the storage of group {g} ({pad} slots)")));
        }
        self.scatter(layer, slots, k, v)
    }

    /// Rows `k`, `v` into `layer`'s storage at `slots`.
    fn scatter(&mut self, layer: usize, slots: &[u32], k: &Array, v: &Array) -> Result<()> {
        let (_, anchor) = self.check_layer(layer)?;
        if anchor != layer {
            return Err(Error::Pool(format!("layer {layer} shares the K/V of layer {anchor}; write through the anchor")));
        }
        let spec = self.layout.layers[layer];
        let n = slots.len();
        let rows = |x: &Array, what: &str| -> Result<Array> {
            let d = x.shape();
            if d.len() != 4 || d[1] != spec.kv_heads || d[3] != spec.head_dim || d[0] * d[2] != n {
                return Err(Error::Pool(format!(
                    "layer {layer} {what} {d:?}: want [B, {}, T, {}] with B*T = {n}",
                    spec.kv_heads, spec.head_dim
                )));
            }
            let x = if x.dtype() == self.dtype { x.clone() } else { x.astype(self.dtype)? };
            Ok(x.transpose(&[0, 2, 1, 3])?.reshape(&[n as i32, spec.kv_heads as i32, spec.head_dim as i32])?)
        };
        let (kr, vr) = (rows(k, "keys")?, rows(v, "values")?);
        let st = self.storage[layer].as_mut().expect("own storage");
        st.k = put_rows(&st.k, slots, &kr, self.max_runs)?;
        st.v = put_rows(&st.v, slots, &vr, self.max_runs)?;
        self.dirty = true;
        Ok(())
    }

    /// Keys and values for the batch's queries at `layer`: `[B, kv_heads, max_len, head_dim]`
    /// each, keys in position order from [`crate::GroupStep::kv_start`], padded at the end.
    pub fn read(&self, layer: usize, batch: &StepBatch) -> Result<(Array, Array)> {
        let (g, anchor) = self.check_layer(layer)?;
        let gb = &batch.groups[g];
        self.gather(anchor, gb.read_slots()?, batch.q_lens.len(), gb.max_len)
    }

    /// Rows `slots` (`[b * len]`) of `anchor`'s keys and values as `[b, kv_heads, len, head_dim]`.
    fn gather(&self, anchor: usize, slots: &Array, b: usize, len: usize) -> Result<(Array, Array)> {
        let spec = self.layout.layers[anchor];
        let st = self.storage[anchor].as_ref().expect("anchor storage");
        let shape = [b as i32, len as i32, spec.kv_heads as i32, spec.head_dim as i32];
        let g = |x: &Array| -> Result<Array> { Ok(x.take(slots, 0)?.reshape(&shape)?.transpose(&[0, 2, 1, 3])?) };
        Ok((g(&st.k)?, g(&st.v)?))
    }

    /// Keys and values of positions `from..to` of a one-sequence batch at `layer`:
    /// `[1, kv_heads, to - from, head_dim]` each (the span must lie within the keys
    /// [`KvPool::read`] would return).
    pub fn read_span(&self, layer: usize, batch: &StepBatch, from: usize, to: usize) -> Result<(Array, Array)> {
        let (g, anchor) = self.check_layer(layer)?;
        let gb = &batch.groups[g];
        if batch.q_lens.len() != 1 {
            return Err(Error::Pool(format!("read_span needs a one-sequence batch, got {}", batch.q_lens.len())));
        }
        let (start, len) = (gb.kv_starts[0], gb.kv_lens[0]);
        if from > to || from < start || to > start + len {
            return Err(Error::Pool(format!("read_span {from}..{to} outside the sequence's keys {start}..{}", start + len)));
        }
        self.gather(anchor, &gb.read_slots()?.slice_axis(0, from - start, to - start)?, 1, to - from)
    }

    /// Copy whole blocks (copy-on-write after [`crate::KvCacheManager::fork`] or `trim`).
    pub fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<()> {
        let bs = self.layout.config.block_size;
        for g in 0..self.layout.groups.len() {
            let mine: Vec<&BlockCopy> = copies.iter().filter(|c| c.group == g).collect();
            if mine.is_empty() {
                continue;
            }
            let nb = self.layout.groups[g].num_blocks as u32;
            if let Some(c) = mine.iter().find(|c| c.src.0 >= nb || c.dst.0 >= nb) {
                return Err(Error::Pool(format!("copy {c:?} out of range ({nb} blocks)")));
            }
            let top = mine.iter().map(|c| c.src.0.max(c.dst.0)).max().expect("non-empty");
            self.reserve(g, top as usize + 1)?;
            let rows = |f: fn(&BlockCopy) -> u32| -> Vec<i32> {
                mine.iter().flat_map(|c| (0..bs as u32).map(move |o| (f(c) * bs as u32 + o) as i32)).collect()
            };
            let (src, dst) = (rows(|c| c.src.0), rows(|c| c.dst.0));
            let src = Array::from_slice(&src, &[src.len()])?;
            let dst = Array::from_slice(&dst, &[dst.len()])?;
            for &layer in &self.layout.groups[g].layers {
                let st = self.storage[layer].as_mut().expect("own storage");
                st.k = scatter_rows(&st.k, &dst, &st.k.take(&src, 0)?)?;
                st.v = scatter_rows(&st.v, &dst, &st.v.take(&src, 0)?)?;
            }
            self.dirty = true;
        }
        Ok(())
    }

    /// The K and V arrays of every layer with its own storage.
    pub fn arrays(&self) -> Vec<&Array> {
        self.storage.iter().flatten().flat_map(|s| [&s.k, &s.v]).collect()
    }

    /// Evaluate the pending writes of every layer (bounds the lazy graph; call once per step).
    pub fn eval(&mut self) -> Result<()> {
        mlx_array::eval(&self.arrays())?;
        self.dirty = false;
        Ok(())
    }

    /// Queue the pending writes of every layer without waiting for them.
    pub fn async_eval(&mut self) -> Result<()> {
        mlx_array::async_eval(&self.arrays())?;
        self.dirty = false;
        Ok(())
    }

    /// The caller queued or computed [`KvPool::arrays`] itself (with other arrays, in one call).
    pub fn mark_queued(&mut self) {
        self.dirty = false;
    }

    /// Whether the storage changed (a write, copy or growth) since the last `eval` or
    /// `async_eval`: with nothing new, queueing again is wasted work (and MLX may block a
    /// queueing call while many tasks are in flight).
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Wait until every layer's storage is computed, one array at a time ([`Array::eval`]):
    /// works for writes queued by [`KvPool::async_eval`] on another thread.
    pub fn wait(&self) -> Result<()> {
        for a in self.arrays() {
            a.eval()?;
        }
        Ok(())
    }

    /// Bytes held by all K/V storage.
    pub fn nbytes(&self) -> usize {
        self.storage.iter().flatten().map(|s| s.k.nbytes() + s.v.nbytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row writes as slice updates (few runs of consecutive slots) and as a scatter (many runs)
    /// give the rows a naive copy gives.
    #[test]
    fn put_rows_runs_and_scatter() {
        let (n, w) = (40usize, 3usize);
        let dst: Vec<f32> = (0..n * w).map(|i| -(i as f32)).collect();
        for slots in [vec![4u32, 5, 6, 7, 20, 21], (0..20).map(|i| i * 2).collect::<Vec<u32>>(), vec![9, 3, 4, 30]] {
            let rows: Vec<f32> = (0..slots.len() * w).map(|i| 1000.0 + i as f32).collect();
            let mut want = dst.clone();
            for (r, &s) in slots.iter().enumerate() {
                want[s as usize * w..(s as usize + 1) * w].copy_from_slice(&rows[r * w..(r + 1) * w]);
            }
            let d = Array::from_slice(&dst, &[n, w, 1]).unwrap();
            let u = Array::from_slice(&rows, &[slots.len(), w, 1]).unwrap();
            for max_runs in [0, 1, 8, 4096] {
                let got = put_rows(&d, &slots, &u, max_runs).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(got, want, "slots {slots:?}, max runs {max_runs}");
            }
        }
    }
}
