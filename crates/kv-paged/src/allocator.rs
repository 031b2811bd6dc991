//! [`BlockAllocator`]: fixed-size, reference-counted KV blocks with a prefix cache.
//!
//! A block is either *in use* (refcount > 0) or *free* (refcount 0, on the LRU free list). A
//! full block can be *registered* under its [`BlockKey`]; it stays registered after it is
//! freed, so a later prompt with the same prefix can take it back from the free list. Only when
//! a free block is handed out again for new content is its registration dropped (lazy eviction),
//! least recently freed first. Freed blocks without content are put at the front of the free
//! list: they are worth nothing and go first.
//!
//! [`BlockAllocator::with_opened`] starts with only the first blocks *opened* (handed out at
//! all); the rest open, doubling, only when no opened block is free, cached ones included. The
//! block ids in use then stay below the working set's high-water mark, and so does the storage
//! a pool that grows with the highest id needs; the prefix cache keeps what fits there.
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::hash::{BlockHash, BlockKey};
use crate::lru::FreeList;

/// The index of a block in its allocator (and of its slots in the KV storage:
/// slot = `id * block_size + offset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// The default number of tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug, Clone, Default)]
struct Meta {
    refs: u32,
    key: Option<BlockKey>,
}

/// Counters of a [`BlockAllocator`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllocatorStats {
    pub total: usize,
    pub free: usize,
    pub in_use: usize,
    /// Registered blocks (in use or free) whose content can be found by prefix lookup.
    pub cached: usize,
    /// Free blocks that still hold registered content (reusable until evicted).
    pub cached_free: usize,
    /// Counting [`BlockAllocator::lookup`] calls and the hits among them.
    pub lookups: u64,
    pub hits: u64,
    /// `hits / lookups` (0 before any lookup).
    pub hit_rate: f64,
    /// Registered blocks whose content was dropped to make room.
    pub evictions: u64,
    /// Bytes of the blocks in use, in MB (10^6 bytes).
    pub mb_used: f64,
}

/// Fixed-size, reference-counted blocks with an LRU free list and a content-addressed cache.
/// Every operation is O(1) (a [`BlockAllocator::register`] or lookup also compares one block of tokens).
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    group: usize,
    block_size: usize,
    bytes_per_block: u64,
    meta: Vec<Meta>,
    /// Tokens of registered blocks, `block_size` per block, to verify hash hits.
    tokens: Vec<u32>,
    free: FreeList,
    /// Blocks `0..opened` may be handed out; the rest are free but not opened yet.
    opened: u32,
    cache: HashMap<BlockHash, u32>,
    lookups: u64,
    hits: u64,
    evictions: u64,
}

impl BlockAllocator {
    /// `num_blocks` blocks of `block_size` tokens, each token taking `bytes_per_token` bytes of
    /// KV (over all the layers the blocks serve; only used for [`AllocatorStats::mb_used`]).
    pub fn new(num_blocks: usize, block_size: usize, bytes_per_token: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::Config("block size must be positive".into()));
        }
        if num_blocks == 0 {
            return Err(Error::Config("an allocator needs at least one block".into()));
        }
        // Slots are u32 (block * block_size + offset); one slot value is kept for padding.
        if (num_blocks as u64) * (block_size as u64) >= u32::MAX as u64 {
            return Err(Error::Config(format!("{num_blocks} blocks of {block_size} tokens exceed u32 slots")));
        }
        Ok(BlockAllocator {
            group: 0,
            block_size,
            bytes_per_block: (block_size * bytes_per_token) as u64,
            meta: vec![Meta::default(); num_blocks],
            tokens: vec![0; num_blocks * block_size],
            free: FreeList::full(num_blocks as u32),
            opened: num_blocks as u32,
            cache: HashMap::new(),
            lookups: 0,
            hits: 0,
            evictions: 0,
        })
    }

    /// As many blocks as fit in `budget_mb` (10^6 bytes) at `bytes_per_token` bytes of KV per token.
    pub fn with_budget(budget_mb: f64, bytes_per_token: usize, block_size: usize) -> Result<Self> {
        let n = blocks_for_budget(budget_mb, bytes_per_token, block_size)?;
        Self::new(n, block_size, bytes_per_token)
    }

    /// Open only blocks `0..n` for now (at least 1): when none of the opened blocks is free,
    /// cached ones included, the opened count doubles (up to `num_blocks`).
    pub fn with_opened(mut self, n: usize) -> Self {
        let total = self.meta.len() as u32;
        self.opened = (n.max(1) as u32).min(total);
        self.free = FreeList::holding(total, self.opened);
        self
    }

    /// Blocks that may be handed out without opening more (see [`BlockAllocator::with_opened`]).
    pub fn num_opened(&self) -> usize {
        self.opened as usize
    }

    fn unopened(&self) -> usize {
        self.meta.len() - self.opened as usize
    }

    /// The cache group this allocator serves, reported in [`Error::OutOfBlocks`].
    pub fn with_group(mut self, group: usize) -> Self {
        self.group = group;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }
    /// Free blocks, including cached ones that an allocation would evict and unopened ones.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.unopened()
    }

    fn meta(&self, id: BlockId) -> Result<&Meta> {
        self.meta.get(id.0 as usize).ok_or_else(|| Error::Block { block: id.0, msg: format!("only {} blocks", self.meta.len()) })
    }

    /// The reference count of a block (0 = free).
    pub fn refcount(&self, id: BlockId) -> Result<u32> {
        Ok(self.meta(id)?.refs)
    }

    /// The key a block is registered under, if any.
    pub fn key(&self, id: BlockId) -> Result<Option<BlockKey>> {
        Ok(self.meta(id)?.key)
    }

    /// Whether a block is free (on the free list, or not opened yet).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.free.contains(id.0) || (id.0 >= self.opened && (id.0 as usize) < self.meta.len())
    }

    /// Opened free blocks from the next to be handed out (least recently freed) to the last.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.iter().map(BlockId).collect()
    }

    /// Take the least recently used free block (evicting its cached content) with refcount 1.
    pub fn allocate(&mut self) -> Result<BlockId> {
        if self.free.len() == 0 && self.unopened() > 0 {
            let new = (self.opened * 2).max(self.opened + 1).min(self.meta.len() as u32);
            // Fresh blocks hold nothing: they go first, in id order.
            for i in (self.opened..new).rev() {
                self.free.push_front(i);
            }
            self.opened = new;
        }
        let i = self.free.pop_front().ok_or(Error::OutOfBlocks {
            group: self.group,
            needed: 1,
            free: 0,
            total: self.meta.len(),
        })?;
        let m = &mut self.meta[i as usize];
        if let Some(k) = m.key.take() {
            if self.cache.get(&k.hash) == Some(&i) {
                self.cache.remove(&k.hash);
            }
            self.evictions += 1;
        }
        m.refs = 1;
        Ok(BlockId(i))
    }

    /// `n` blocks, or none at all (with the numbers) if fewer than `n` are free.
    pub fn allocate_n(&mut self, n: usize) -> Result<Vec<BlockId>> {
        self.ensure_free(n)?;
        (0..n).map(|_| self.allocate()).collect()
    }

    /// `Ok` if `n` blocks can be allocated now.
    pub fn ensure_free(&self, n: usize) -> Result<()> {
        if n > self.num_free() {
            return Err(Error::OutOfBlocks { group: self.group, needed: n, free: self.num_free(), total: self.meta.len() });
        }
        Ok(())
    }

    /// Add a reference (sharing a block, or taking a cached free block back into use).
    pub fn retain(&mut self, id: BlockId) -> Result<()> {
        self.meta(id)?;
        let m = &mut self.meta[id.0 as usize];
        if m.refs == 0 {
            self.free.remove(id.0);
        }
        m.refs = m.refs.checked_add(1).ok_or_else(|| Error::Block { block: id.0, msg: "refcount overflow".into() })?;
        Ok(())
    }

    /// Drop a reference; at zero the block goes on the free list, keeping its registration.
    pub fn release(&mut self, id: BlockId) -> Result<()> {
        self.meta(id)?;
        let m = &mut self.meta[id.0 as usize];
        if m.refs == 0 {
            return Err(Error::Block { block: id.0, msg: "released while free".into() });
        }
        m.refs -= 1;
        if m.refs == 0 {
            if m.key.is_some() {
                self.free.push_back(id.0);
            } else {
                self.free.push_front(id.0);
            }
        }
        Ok(())
    }

    /// Register the full in-use block `id` as holding `tokens` under `key`. Returns false (and
    /// leaves the block unregistered) when another block already holds that key.
    pub fn register(&mut self, id: BlockId, key: BlockKey, tokens: &[u32]) -> Result<bool> {
        let m = self.meta(id)?;
        if m.refs == 0 {
            return Err(Error::Block { block: id.0, msg: "registered while free".into() });
        }
        if m.key.is_some() {
            return Err(Error::Block { block: id.0, msg: "already registered".into() });
        }
        if tokens.len() != self.block_size {
            return Err(Error::Tokens(format!("{} tokens for a block of {}", tokens.len(), self.block_size)));
        }
        if self.cache.contains_key(&key.hash) {
            return Ok(false);
        }
        let bs = self.block_size;
        self.tokens[id.0 as usize * bs..(id.0 as usize + 1) * bs].copy_from_slice(tokens);
        self.cache.insert(key.hash, id.0);
        self.meta[id.0 as usize].key = Some(key);
        Ok(true)
    }

    /// Drop a block's registration (its content is about to be overwritten).
    pub fn unregister(&mut self, id: BlockId) -> Result<()> {
        self.meta(id)?;
        if let Some(k) = self.meta[id.0 as usize].key.take() {
            if self.cache.get(&k.hash) == Some(&id.0) {
                self.cache.remove(&k.hash);
            }
            if self.free.remove(id.0) {
                // A free block without content goes first.
                self.free.push_front(id.0);
            }
        }
        Ok(())
    }

    /// The registered block with exactly this key and these tokens, without counting it in the
    /// stats. A hash hit whose parent, extra keys or tokens differ is a miss.
    pub fn find(&self, key: &BlockKey, tokens: &[u32]) -> Option<BlockId> {
        let &i = self.cache.get(&key.hash)?;
        let m = &self.meta[i as usize];
        let bs = self.block_size;
        let stored = &self.tokens[i as usize * bs..(i as usize + 1) * bs];
        (m.key.as_ref() == Some(key) && stored == tokens).then_some(BlockId(i))
    }

    /// [`BlockAllocator::find`], counted in the hit-rate stats.
    pub fn lookup(&mut self, key: &BlockKey, tokens: &[u32]) -> Option<BlockId> {
        let r = self.find(key, tokens);
        self.lookups += 1;
        self.hits += r.is_some() as u64;
        r
    }

    /// Count `lookups` prefix lookups with `hits` hits done through [`BlockAllocator::find`].
    pub fn record_lookups(&mut self, lookups: u64, hits: u64) {
        self.lookups += lookups;
        self.hits += hits;
    }

    pub fn stats(&self) -> AllocatorStats {
        let free = self.num_free();
        let in_use = self.meta.len() - free;
        let cached_free = self.free.iter().filter(|&i| self.meta[i as usize].key.is_some()).count();
        AllocatorStats {
            total: self.meta.len(),
            free,
            in_use,
            cached: self.cache.len(),
            cached_free,
            lookups: self.lookups,
            hits: self.hits,
            hit_rate: if self.lookups == 0 { 0.0 } else { self.hits as f64 / self.lookups as f64 },
            evictions: self.evictions,
            mb_used: (in_use as u64 * self.bytes_per_block) as f64 / 1e6,
        }
    }
}

/// How many blocks of `block_size` tokens at `bytes_per_token` fit in `budget_mb` (10^6 bytes).
pub fn blocks_for_budget(budget_mb: f64, bytes_per_token: usize, block_size: usize) -> Result<usize> {
    if !(budget_mb.is_finite() && budget_mb > 0.0) {
        return Err(Error::Config(format!("memory budget {budget_mb} MB")));
    }
    if bytes_per_token == 0 || block_size == 0 {
        return Err(Error::Config(format!("{bytes_per_token} bytes per token, block size {block_size}")));
    }
    let n = (budget_mb * 1e6 / (bytes_per_token as f64 * block_size as f64)).floor() as usize;
    if n == 0 {
        return Err(Error::Config(format!(
            "{budget_mb} MB holds no block of {block_size} tokens at {bytes_per_token} bytes per token"
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::block_keys;
    use crate::ExtraKeys;

    #[test]
    fn budget_and_errors() {
        // Qwen3-0.6B: 28 layers * 8 kv heads * 128 * 2 (K,V) * 2 bytes = 114688 bytes per token.
        let a = BlockAllocator::with_budget(1024.0, 114_688, 16).unwrap();
        assert_eq!(a.num_blocks(), 558);
        assert!(BlockAllocator::with_budget(0.001, 114_688, 16).is_err());
        let mut a = BlockAllocator::new(2, 4, 1).unwrap();
        a.allocate_n(2).unwrap();
        match a.allocate() {
            Err(Error::OutOfBlocks { needed: 1, free: 0, total: 2, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(a.release(BlockId(9)).is_err());
    }

    #[test]
    fn opened_blocks_grow_only_when_none_is_free() {
        let mut a = BlockAllocator::new(8, 4, 1).unwrap().with_opened(2);
        assert_eq!((a.num_opened(), a.num_free()), (2, 8));
        let t = [1, 2, 3, 4];
        let k = block_keys(&t, 4, 0, &ExtraKeys::none())[0];
        let b0 = a.allocate().unwrap();
        assert!(a.register(b0, k, &t).unwrap());
        a.release(b0).unwrap(); // cached and free
        let b1 = a.allocate().unwrap();
        assert_eq!(b1, BlockId(1), "the empty opened block first");
        let b2 = a.allocate().unwrap();
        assert_eq!((b2, a.num_opened()), (b0, 2), "then the cached one is evicted rather than opening more");
        assert_eq!(a.stats().evictions, 1);
        let b3 = a.allocate().unwrap();
        assert_eq!((b3, a.num_opened()), (BlockId(2), 4), "none free: the opened count doubles");
        assert!(a.is_free(BlockId(3)) && a.is_free(BlockId(7)) && !a.is_free(b3));
        assert_eq!(a.allocate_n(5).unwrap().iter().map(|b| b.0).max(), Some(7));
        assert_eq!((a.num_opened(), a.num_free()), (8, 0));
        assert!(a.allocate().is_err());
    }

    #[test]
    fn cached_block_survives_free_until_evicted() {
        let mut a = BlockAllocator::new(2, 4, 1).unwrap();
        let t = [1, 2, 3, 4];
        let k = block_keys(&t, 4, 0, &ExtraKeys::none())[0];
        let b = a.allocate().unwrap();
        assert!(a.register(b, k, &t).unwrap());
        a.release(b).unwrap();
        assert_eq!(a.lookup(&k, &t), Some(b));
        assert_eq!(a.lookup(&k, &[1, 2, 3, 5]), None, "tokens are verified");
        // The other (empty) block is handed out first; then the cached one is evicted.
        let c = a.allocate().unwrap();
        assert_ne!(c, b);
        assert_eq!(a.find(&k, &t), Some(b));
        let d = a.allocate().unwrap();
        assert_eq!(d, b);
        assert_eq!(a.find(&k, &t), None);
        assert_eq!(a.stats().evictions, 1);
    }
}
