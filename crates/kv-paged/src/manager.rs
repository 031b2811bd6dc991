//! [`KvCacheManager`]: sequences over the block allocators of the cache groups.
//!
//! The life of a sequence: [`KvCacheManager::begin`] with the prompt (returns how many leading
//! tokens are already cached), then [`KvCacheManager::step`] to get slots for the next tokens
//! to compute, [`KvCacheManager::append`] for generated tokens, [`KvCacheManager::trim`] to roll
//! back, [`KvCacheManager::fork`] to share the prefix with a new sequence, and
//! [`KvCacheManager::finish`] to give the blocks back (they stay cached).
//!
//! Any call on a sequence after a step means that the step's K/V have been written: its full
//! blocks are then registered in the prefix cache, and sliding groups give back the blocks
//! that fell out of the window.
use std::collections::HashMap;

use crate::allocator::{AllocatorStats, BlockAllocator, BlockId};
use crate::error::{Error, Result};
use crate::hash::{extend_block_keys, BlockKey, ExtraKeys};
use crate::layout::{Attention, KvLayout};

/// A sequence handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Copy the K/V of block `src` into block `dst` in every layer of `group` (copy-on-write
/// after a fork or trim into a shared block). Apply before the sequence's next write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub group: usize,
    pub src: BlockId,
    pub dst: BlockId,
}

/// What one cache group needs for a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupStep {
    /// Where to write the K/V of the step's tokens (one slot each).
    pub slot_mapping: Vec<u32>,
    /// The first key position the step's queries attend to (0 for full attention).
    pub kv_start: usize,
    /// How many keys the step's queries attend to: positions `kv_start .. kv_start + kv_len`
    /// (`kv_start .. start + len`).
    pub kv_len: usize,
    /// The block table from block index `first_block` (`kv_start / block_size`) on; blocks
    /// before it were released.
    pub first_block: usize,
    pub block_table: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
}

impl GroupStep {
    /// The slots of the keys at positions `kv_start .. kv_start + kv_len`, in position order.
    /// Made from the block table on demand: a step whose attention reads a contiguous copy of
    /// its keys never needs them, and they grow with the context.
    pub fn kv_slots(&self) -> Vec<u32> {
        let bs = self.block_size;
        (self.kv_start..self.kv_start + self.kv_len).map(|p| self.block_table[p / bs - self.first_block] * bs as u32 + (p % bs) as u32).collect()
    }
}

/// The slots of one scheduled step of a sequence: tokens at positions `start .. start + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    /// One entry per cache group, in [`KvLayout::groups`] order.
    pub groups: Vec<GroupStep>,
}

/// The result of [`KvCacheManager::begin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begun {
    pub seq: SeqId,
    /// Leading prompt tokens whose K/V are already in the cache (a multiple of the block size,
    /// always less than the prompt length).
    pub cached_tokens: usize,
}

/// Counters of a [`KvCacheManager`].
#[derive(Debug, Clone, PartialEq)]
pub struct ManagerStats {
    pub groups: Vec<AllocatorStats>,
    pub sequences: usize,
    /// Prompt tokens seen by `begin` and how many of them were cache hits.
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    /// `cached_prompt_tokens / prompt_tokens`.
    pub prefix_hit_rate: f64,
}

#[derive(Debug, Clone)]
struct Table {
    /// Block per block index; `None` before `released` (sliding groups).
    blocks: Vec<Option<BlockId>>,
    /// Keys of the full blocks hashed so far.
    keys: Vec<BlockKey>,
    /// Blocks `0..registered` are registered (or were tried).
    registered: usize,
    /// Blocks `0..released` were given back (sliding groups).
    released: usize,
}

#[derive(Debug, Clone)]
struct Seq {
    tokens: Vec<u32>,
    /// Leading tokens whose ids are known; the rest were appended by
    /// [`KvCacheManager::append_pending`] and read 0 until [`KvCacheManager::resolve`].
    known: usize,
    computed: usize,
    scheduled: usize,
    extra: ExtraKeys,
    tables: Vec<Table>,
}

#[derive(Debug, Clone)]
struct GroupState {
    attention: Attention,
    alloc: BlockAllocator,
}

/// Sequences, block tables and the prefix cache of every cache group.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    block_size: usize,
    rollback: usize,
    groups: Vec<GroupState>,
    seqs: HashMap<u64, Seq>,
    next_id: u64,
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
}

impl KvCacheManager {
    /// Allocators for the groups of `layout`.
    pub fn new(layout: &KvLayout) -> Result<Self> {
        let groups = layout
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let mut alloc = BlockAllocator::new(g.num_blocks, layout.config.block_size, g.bytes_per_token)?.with_group(i);
                // Hand out ids as a pool grown from initial_blocks holds them (KvPool::new).
                if let Some(n) = layout.config.initial_blocks {
                    alloc = alloc.with_opened(n);
                }
                Ok(GroupState { attention: g.attention, alloc })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_parts(layout.config.block_size, layout.config.rollback_tokens, groups))
    }

    /// A manager without a model layout: `groups[g] = (attention, number of blocks)`.
    pub fn with_groups(block_size: usize, rollback_tokens: usize, groups: &[(Attention, usize)]) -> Result<Self> {
        if groups.is_empty() {
            return Err(Error::Config("no cache group".into()));
        }
        let groups = groups
            .iter()
            .enumerate()
            .map(|(i, &(attention, n))| {
                if attention == (Attention::Sliding { window: 0 }) {
                    return Err(Error::Config("sliding window 0".into()));
                }
                Ok(GroupState { attention, alloc: BlockAllocator::new(n, block_size, 0)?.with_group(i) })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_parts(block_size, rollback_tokens, groups))
    }

    fn from_parts(block_size: usize, rollback: usize, groups: Vec<GroupState>) -> Self {
        KvCacheManager { block_size, rollback, groups, seqs: HashMap::new(), next_id: 0, prompt_tokens: 0, cached_prompt_tokens: 0 }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    /// The allocator of a group (for inspection).
    pub fn allocator(&self, group: usize) -> Option<&BlockAllocator> {
        self.groups.get(group).map(|g| &g.alloc)
    }
    /// Live sequences, in no particular order.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.seqs.keys().map(|&k| SeqId(k)).collect()
    }

    fn seq(&self, id: SeqId) -> Result<&Seq> {
        self.seqs.get(&id.0).ok_or(Error::UnknownSequence(id.0))
    }

    /// All tokens of a sequence (computed or not; unresolved ids read 0).
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tokens)
    }
    /// Tokens whose K/V are (or, for a step in flight, are being) written.
    pub fn num_scheduled(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.scheduled)
    }
    /// The block table of a sequence in a group (`None` = released out of the window).
    pub fn blocks(&self, id: SeqId, group: usize) -> Result<Vec<Option<BlockId>>> {
        let s = self.seq(id)?;
        let t = s.tables.get(group).ok_or_else(|| Error::Config(format!("no group {group}")))?;
        Ok(t.blocks.clone())
    }

    /// First key position a query at `pos` needs in a group.
    fn window_start(att: Attention, pos: usize) -> usize {
        match att {
            Attention::Full => 0,
            Attention::Sliding { window } => (pos + 1).saturating_sub(window),
        }
    }

    /// Start a sequence from its prompt. Reuses the longest cached prefix (in whole blocks, in
    /// every group, leaving at least the last prompt token to compute); allocates nothing else.
    pub fn begin(&mut self, prompt: &[u32], extra: ExtraKeys) -> Result<Begun> {
        if prompt.is_empty() {
            return Err(Error::Tokens("empty prompt".into()));
        }
        let bs = self.block_size;
        let max_n = (prompt.len() - 1) / bs;
        let mut keys = Vec::with_capacity(self.groups.len());
        let mut found = Vec::with_capacity(self.groups.len());
        for (g, st) in self.groups.iter().enumerate() {
            let mut k = Vec::new();
            extend_block_keys(&mut k, &prompt[..max_n * bs], bs, g, &extra);
            // Full attention needs every block: stop at the first miss.
            let mut f: Vec<Option<BlockId>> = Vec::with_capacity(max_n);
            for (i, key) in k.iter().enumerate() {
                let hit = st.alloc.find(key, &prompt[i * bs..(i + 1) * bs]);
                if hit.is_none() && st.attention == Attention::Full {
                    break;
                }
                f.push(hit);
            }
            f.resize(max_n, None);
            keys.push(k);
            found.push(f);
        }
        // The longest n such that every group has the blocks its next query needs.
        let mut n = max_n;
        while n > 0 {
            let ok = self.groups.iter().zip(&found).all(|(st, f)| {
                let first = Self::window_start(st.attention, n * bs) / bs;
                f[first..n].iter().all(Option::is_some)
            });
            if ok {
                break;
            }
            n -= 1;
        }
        let mut tables = Vec::with_capacity(self.groups.len());
        for ((st, f), k) in self.groups.iter_mut().zip(found).zip(keys) {
            let first = Self::window_start(st.attention, n * bs) / bs;
            let mut blocks = vec![None; first];
            for b in f[first..n].iter() {
                let b = b.expect("checked above");
                st.alloc.retain(b)?;
                blocks.push(Some(b));
            }
            st.alloc.record_lookups((n - first) as u64 + (n < max_n) as u64, (n - first) as u64);
            tables.push(Table { blocks, keys: k, registered: n, released: first });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.prompt_tokens += prompt.len() as u64;
        self.cached_prompt_tokens += (n * bs) as u64;
        self.seqs.insert(id, Seq { tokens: prompt.to_vec(), known: prompt.len(), computed: n * bs, scheduled: n * bs, extra, tables });
        Ok(Begun { seq: SeqId(id), cached_tokens: n * bs })
    }

    /// Declare the K/V of the step in flight written: its full blocks become findable by prefix
    /// lookup and sliding groups release the blocks that left the window. Every other call on
    /// the sequence does this first, so calling it is only needed to share blocks sooner.
    pub fn commit(&mut self, id: SeqId) -> Result<()> {
        let s = self.seqs.get_mut(&id.0).ok_or(Error::UnknownSequence(id.0))?;
        if s.scheduled == s.computed {
            return Ok(());
        }
        s.computed = s.scheduled;
        self.register(id)
    }

    /// Register the computed full blocks whose token ids are all known, and release the blocks
    /// that left sliding windows.
    fn register(&mut self, id: SeqId) -> Result<()> {
        let bs = self.block_size;
        let rollback = self.rollback;
        let s = self.seqs.get_mut(&id.0).ok_or(Error::UnknownSequence(id.0))?;
        let full = s.computed.min(s.known) / bs;
        for (g, (st, t)) in self.groups.iter_mut().zip(s.tables.iter_mut()).enumerate() {
            extend_block_keys(&mut t.keys, &s.tokens[..full * bs], bs, g, &s.extra);
            for i in t.registered.max(t.released)..full {
                if let Some(b) = t.blocks[i] {
                    if st.alloc.key(b)?.is_none() {
                        st.alloc.register(b, t.keys[i], &s.tokens[i * bs..(i + 1) * bs])?;
                    }
                }
            }
            t.registered = t.registered.max(full);
            let keep_from = Self::window_start(st.attention, s.computed.saturating_sub(rollback)) / bs;
            for i in t.released..keep_from.min(t.blocks.len()) {
                if let Some(b) = t.blocks[i].take() {
                    st.alloc.release(b)?;
                }
            }
            t.released = t.released.max(keep_from.min(t.blocks.len()));
        }
        Ok(())
    }

    /// Add tokens (generated ones) to the end of a sequence; they get slots at the next step.
    /// Fails while ids appended by [`KvCacheManager::append_pending`] are unresolved.
    pub fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        self.commit(id)?;
        let s = self.seqs.get_mut(&id.0).expect("committed");
        if s.known < s.tokens.len() {
            return Err(Error::Tokens(format!("append with {} token ids unresolved", s.tokens.len() - s.known)));
        }
        s.tokens.extend_from_slice(tokens);
        s.known = s.tokens.len();
        Ok(())
    }

    /// Add `n` tokens whose ids are not known yet (a decode step's input still being computed
    /// on the device). They are scheduled like any others; the blocks holding them join the
    /// prefix cache only once [`KvCacheManager::resolve`] gives their ids.
    pub fn append_pending(&mut self, id: SeqId, n: usize) -> Result<()> {
        self.commit(id)?;
        let s = self.seqs.get_mut(&id.0).expect("committed");
        s.tokens.resize(s.tokens.len() + n, 0);
        Ok(())
    }

    /// Give the ids of the oldest unresolved tokens (in order); full computed blocks that are
    /// now known are registered.
    pub fn resolve(&mut self, id: SeqId, ids: &[u32]) -> Result<()> {
        self.commit(id)?;
        let s = self.seqs.get_mut(&id.0).expect("committed");
        let end = s.known + ids.len();
        if end > s.tokens.len() {
            return Err(Error::Tokens(format!("resolve {} ids with {} unresolved", ids.len(), s.tokens.len() - s.known)));
        }
        s.tokens[s.known..end].copy_from_slice(ids);
        s.known = end;
        self.register(id)
    }

    /// Tokens whose ids are known (the rest await [`KvCacheManager::resolve`]).
    pub fn num_known(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.known)
    }

    /// Schedule the next up to `max_tokens` tokens not yet computed: allocate their slots and
    /// return where to write them and which keys their queries read. Nothing changes on error.
    pub fn step(&mut self, id: SeqId, max_tokens: usize) -> Result<Step> {
        self.commit(id)?;
        let bs = self.block_size;
        let s = self.seqs.get(&id.0).expect("committed");
        let start = s.computed;
        let len = (s.tokens.len() - start).min(max_tokens);
        if len == 0 {
            return Err(Error::Tokens(format!("nothing to schedule: {} tokens, {} computed", s.tokens.len(), start)));
        }
        let end = start + len;
        let nb = end.div_ceil(bs);
        for (st, t) in self.groups.iter().zip(&s.tables) {
            st.alloc.ensure_free(nb.saturating_sub(t.blocks.len()))?;
        }
        let s = self.seqs.get_mut(&id.0).expect("committed");
        let mut groups = Vec::with_capacity(self.groups.len());
        for (st, t) in self.groups.iter_mut().zip(s.tables.iter_mut()) {
            let first_new = t.blocks.len();
            while t.blocks.len() < nb {
                t.blocks.push(Some(st.alloc.allocate()?));
            }
            // A finished sequence's blocks are freed tail first (so its tails are evicted
            // first), and come back in reverse id order: a step's new blocks go in in id order
            // instead, so its rows land in a few runs of consecutive slots (KvPool writes each
            // run as one slice; many runs take a scatter, slow on MLX's CPU backend).
            t.blocks[first_new..].sort_unstable();
            let slot = |p: usize| t.blocks[p / bs].map(|b| b.0 * bs as u32 + (p % bs) as u32);
            let kv_start = Self::window_start(st.attention, start);
            let slot_mapping = (start..end).map(slot).collect::<Option<Vec<_>>>();
            let first_block = kv_start / bs;
            let block_table = t.blocks[first_block..].iter().copied().collect::<Option<Vec<_>>>();
            match (slot_mapping, block_table) {
                (Some(slot_mapping), Some(bt)) => groups.push(GroupStep {
                    slot_mapping,
                    kv_start,
                    kv_len: end - kv_start,
                    first_block,
                    block_table: bt.into_iter().map(|b| b.0).collect(),
                    block_size: bs,
                }),
                _ => return Err(Error::Tokens(format!("step at {start} needs released blocks"))),
            }
        }
        s.scheduled = end;
        Ok(Step { seq: id, start, len, groups })
    }

    /// Keep only the first `keep` tokens (speculative rollback). A kept partial block that is
    /// shared is copied first (the copies to apply are returned); a kept partial block that was
    /// registered is unregistered, as its tail is about to be overwritten.
    pub fn trim(&mut self, id: SeqId, keep: usize) -> Result<Vec<BlockCopy>> {
        self.commit(id)?;
        let bs = self.block_size;
        let s = self.seqs.get(&id.0).expect("committed");
        if keep > s.tokens.len() {
            return Err(Error::Tokens(format!("trim to {keep} of {} tokens", s.tokens.len())));
        }
        let nb = keep.div_ceil(bs);
        let partial = keep % bs != 0;
        for (g, (st, t)) in self.groups.iter().zip(&s.tables).enumerate() {
            let need_from = Self::window_start(st.attention, keep) / bs;
            if keep > 0 && need_from < t.released && need_from < nb {
                return Err(Error::TrimBeyondWindow { group: g, keep, released_before: t.released * bs });
            }
            if partial && nb <= t.blocks.len() {
                if let Some(b) = t.blocks[nb - 1] {
                    if st.alloc.refcount(b)? > 1 {
                        let freed = t.blocks[nb..].iter().flatten().filter(|&&b| matches!(st.alloc.refcount(b), Ok(1))).count();
                        if st.alloc.num_free() + freed == 0 {
                            st.alloc.ensure_free(1)?;
                        }
                    }
                }
            }
        }
        let s = self.seqs.get_mut(&id.0).expect("committed");
        s.tokens.truncate(keep);
        s.known = s.known.min(keep);
        s.computed = s.computed.min(keep);
        s.scheduled = s.computed;
        let mut copies = Vec::new();
        for (g, (st, t)) in self.groups.iter_mut().zip(s.tables.iter_mut()).enumerate() {
            while t.blocks.len() > nb {
                if let Some(b) = t.blocks.pop().flatten() {
                    st.alloc.release(b)?;
                }
            }
            t.keys.truncate(keep / bs);
            t.registered = t.registered.min(keep / bs);
            t.released = t.released.min(t.blocks.len());
            if partial && nb == t.blocks.len() {
                if let Some(b) = t.blocks[nb - 1] {
                    if st.alloc.refcount(b)? > 1 {
                        let dst = st.alloc.allocate()?;
                        st.alloc.release(b)?;
                        t.blocks[nb - 1] = Some(dst);
                        copies.push(BlockCopy { group: g, src: b, dst });
                    } else {
                        st.alloc.unregister(b)?;
                    }
                }
            }
        }
        Ok(copies)
    }

    /// A new sequence with the same tokens, sharing all full blocks; a partial last block is
    /// copied (apply the returned copies before either sequence writes again).
    pub fn fork(&mut self, id: SeqId) -> Result<(SeqId, Vec<BlockCopy>)> {
        self.commit(id)?;
        let bs = self.block_size;
        let s = self.seqs.get(&id.0).expect("committed");
        let partial = s.computed % bs != 0;
        if partial {
            for (st, t) in self.groups.iter().zip(&s.tables) {
                if t.blocks.last().copied().flatten().is_some() {
                    st.alloc.ensure_free(1)?;
                }
            }
        }
        let mut child = s.clone();
        let mut copies = Vec::new();
        for (g, (st, t)) in self.groups.iter_mut().zip(child.tables.iter_mut()).enumerate() {
            let n = t.blocks.len();
            for (i, slot) in t.blocks.iter_mut().enumerate() {
                let Some(b) = *slot else { continue };
                if partial && i + 1 == n {
                    let dst = st.alloc.allocate()?;
                    *slot = Some(dst);
                    copies.push(BlockCopy { group: g, src: b, dst });
                } else {
                    st.alloc.retain(b)?;
                }
            }
        }
        let cid = self.next_id;
        self.next_id += 1;
        self.seqs.insert(cid, child);
        Ok((SeqId(cid), copies))
    }

    /// End a sequence: its blocks go back (last block first, so a prefix outlives its tail in
    /// the cache); registered ones stay findable until evicted.
    pub fn finish(&mut self, id: SeqId) -> Result<()> {
        self.commit(id)?;
        let s = self.seqs.remove(&id.0).expect("committed");
        for (st, t) in self.groups.iter_mut().zip(s.tables) {
            for b in t.blocks.into_iter().rev().flatten() {
                st.alloc.release(b)?;
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> ManagerStats {
        let p = self.prompt_tokens;
        ManagerStats {
            groups: self.groups.iter().map(|g| g.alloc.stats()).collect(),
            sequences: self.seqs.len(),
            prompt_tokens: p,
            cached_prompt_tokens: self.cached_prompt_tokens,
            prefix_hit_rate: if p == 0 { 0.0 } else { self.cached_prompt_tokens as f64 / p as f64 },
        }
    }
}
