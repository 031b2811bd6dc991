//! Chained prefix hashing of full blocks.
//!
//! A block's key is `xxh3-128(seed, parent hash, extra-keys digest, token ids)`, so two blocks
//! share a key only if their whole prefix, their tokens and their extra keys agree. The seed is
//! fixed, so keys are stable across processes and runs.
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Fixed seed: keys must be identical in every process that shares a cache.
const SEED: u64 = 0x6b76_5f70_6167_6564; // "kv_paged"

/// A 128-bit content hash of a full block and its whole prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Everything besides the token ids that decides whether cached KV can be reused.
///
/// Blocks hashed with different extra keys never match, even for the same tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// A LoRA adapter (or other weights variant) the KV was computed with.
    pub adapter: Option<u128>,
    /// A per-tenant or per-request salt: caches with different salts never share blocks.
    pub salt: Option<u128>,
    /// Multimodal inputs as `(first token position, token count, content hash)`: a block whose
    /// token range overlaps the span also hashes the content (and, by chaining, so do all
    /// blocks after it).
    pub media: Vec<(usize, usize, u128)>,
}

impl ExtraKeys {
    /// No adapter, no salt, no media.
    pub fn none() -> Self {
        Self::default()
    }

    /// The digest mixed into the key of block `index` (tokens `index*bs .. (index+1)*bs`) of
    /// cache group `group`.
    pub fn digest(&self, group: usize, index: usize, block_size: usize) -> u128 {
        let (lo, hi) = (index * block_size, (index + 1) * block_size);
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&(group as u64).to_le_bytes());
        for (tag, v) in [(1u8, self.adapter), (2u8, self.salt)] {
            if let Some(v) = v {
                buf.push(tag);
                buf.extend_from_slice(&v.to_le_bytes());
            }
        }
        for &(start, len, h) in &self.media {
            if start < hi && start + len.max(1) > lo {
                buf.push(3);
                buf.extend_from_slice(&(start as u64).to_le_bytes());
                buf.extend_from_slice(&h.to_le_bytes());
            }
        }
        xxh3_128_with_seed(&buf, SEED)
    }
}

/// The identity of a full block: its chained hash plus what the hash was computed from (all but
/// the tokens, which the allocator stores itself), so that a hit can be verified exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub extra: u128,
}

impl BlockKey {
    /// The key of a full block of `tokens` after the block keyed `parent` (None for the first).
    pub fn new(parent: Option<BlockHash>, extra: u128, tokens: &[u32]) -> Self {
        let mut buf = Vec::with_capacity(33 + 4 * tokens.len());
        match parent {
            Some(p) => {
                buf.push(1);
                buf.extend_from_slice(&p.0.to_le_bytes());
            }
            None => buf.push(0),
        }
        buf.extend_from_slice(&extra.to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        BlockKey { hash: BlockHash(xxh3_128_with_seed(&buf, SEED)), parent, extra }
    }
}

/// Keys of the full blocks of `tokens` (a trailing partial block is not hashed), for `group`.
pub fn block_keys(tokens: &[u32], block_size: usize, group: usize, extra: &ExtraKeys) -> Vec<BlockKey> {
    let mut keys = Vec::new();
    extend_block_keys(&mut keys, tokens, block_size, group, extra);
    keys
}

/// Append to `keys` the keys of the full blocks of `tokens` that `keys` does not cover yet.
pub(crate) fn extend_block_keys(
    keys: &mut Vec<BlockKey>,
    tokens: &[u32],
    block_size: usize,
    group: usize,
    extra: &ExtraKeys,
) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    for i in keys.len()..full {
        let parent = keys.last().map(|k| k.hash);
        let chunk = &tokens[i * block_size..(i + 1) * block_size];
        keys.push(BlockKey::new(parent, extra.digest(group, i, block_size), chunk));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_are_stable() {
        let t: Vec<u32> = (0..40).collect();
        let a = block_keys(&t, 16, 0, &ExtraKeys::none());
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].parent, Some(a[0].hash));
        // Same first block, different second block: first key equal, second differs.
        let mut u = t.clone();
        u[20] = 999;
        let b = block_keys(&u, 16, 0, &ExtraKeys::none());
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1].hash, b[1].hash);
        // A different first block changes every later key (chaining).
        let mut w = t.clone();
        w[0] = 7;
        let c = block_keys(&w, 16, 0, &ExtraKeys::none());
        assert_ne!(a[1].hash, c[1].hash);
        // Fixed seed: this value must never change (keys are shared across processes).
        assert_eq!(block_keys(&t, 16, 0, &ExtraKeys::none())[0].hash, a[0].hash);
    }

    #[test]
    fn extra_keys_separate() {
        let t: Vec<u32> = (0..32).collect();
        let base = block_keys(&t, 16, 0, &ExtraKeys::none());
        let salted = block_keys(&t, 16, 0, &ExtraKeys { salt: Some(1), ..Default::default() });
        let group1 = block_keys(&t, 16, 1, &ExtraKeys::none());
        let media = block_keys(&t, 16, 0, &ExtraKeys { media: vec![(20, 4, 42)], ..Default::default() });
        assert_ne!(base[0].hash, salted[0].hash);
        assert_ne!(base[0].hash, group1[0].hash);
        assert_eq!(base[0].hash, media[0].hash, "media span starts in block 1");
        assert_ne!(base[1].hash, media[1].hash);
    }
}
