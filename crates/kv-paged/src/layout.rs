//! The KV layout of a model: which layers keep K/V, in which cache group, with which shape.
use crate::allocator::{blocks_for_budget, DEFAULT_BLOCK_SIZE};
use crate::error::{Error, Result};

/// How one attention layer keeps its keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayerKind {
    /// Attends to the whole sequence.
    Full,
    /// Attends to the last `window` positions only (including the query's own); older blocks are
    /// given back as the sequence grows.
    Sliding { window: usize },
    /// Keeps no K/V of its own and reads those of layer `anchor` (KV sharing across layers).
    Shared { anchor: usize },
}

/// One attention layer's K/V shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: KvLayerKind,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The attention span of a cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    Full,
    Sliding { window: usize },
}

/// Layers that share one block table: all full layers, or all sliding layers of one window.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub attention: Attention,
    /// The layers with their own storage in this group.
    pub layers: Vec<usize>,
    /// K+V bytes of one token over the group's layers.
    pub bytes_per_token: usize,
    pub num_blocks: usize,
}

/// Sizing knobs of the cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvConfig {
    /// Tokens per block (default 16).
    pub block_size: usize,
    /// Memory for all K/V storage, in MB (10^6 bytes).
    pub budget_mb: f64,
    /// Bytes per K/V element (2 for f16/bf16, 4 for f32).
    pub dtype_bytes: usize,
    /// Sliding groups are sized for this many concurrent sequences.
    pub max_seqs: usize,
    /// Sliding groups are sized for steps of up to this many tokens (chunked prefill).
    pub max_step_tokens: usize,
    /// Sliding groups keep this many extra tokens before the window, so that a trim (speculative
    /// rollback) of up to this many tokens stays possible.
    pub rollback_tokens: usize,
    /// Blocks each group starts with: [`crate::KvCacheManager::new`] opens only these in its
    /// allocators ([`crate::BlockAllocator::with_opened`]: more open, doubling, when none is
    /// free), and [`crate::KvPool`] storage doubles, up to the group's `num_blocks` (which the
    /// budget sets), when a step needs a block beyond it. `None`: the whole budget up front.
    pub initial_blocks: Option<usize>,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig { block_size: DEFAULT_BLOCK_SIZE, budget_mb: 1024.0, dtype_bytes: 2, max_seqs: 8, max_step_tokens: 512, rollback_tokens: 16, initial_blocks: Some(32) }
    }
}

/// Layers and cache groups of a model, with block counts from the memory budget.
#[derive(Debug, Clone, PartialEq)]
pub struct KvLayout {
    pub config: KvConfig,
    pub layers: Vec<LayerSpec>,
    pub groups: Vec<Group>,
    /// For each layer: the group of its storage and the layer whose storage it uses.
    pub placement: Vec<(usize, usize)>,
}

impl KvLayout {
    /// Group the layers and split the budget: each sliding group gets what `max_seqs` sequences
    /// need (window + rollback + one step, in blocks), the full-attention group the rest.
    pub fn new(layers: Vec<LayerSpec>, config: KvConfig) -> Result<Self> {
        let bs = config.block_size;
        if bs == 0 || config.dtype_bytes == 0 || config.max_seqs == 0 || config.max_step_tokens == 0 {
            return Err(Error::Config(format!("{config:?}")));
        }
        let mut groups: Vec<Group> = Vec::new();
        let mut own_group = vec![None; layers.len()];
        for (i, l) in layers.iter().enumerate() {
            let att = match l.kind {
                KvLayerKind::Full => Attention::Full,
                KvLayerKind::Sliding { window: 0 } => return Err(Error::Config(format!("layer {i}: sliding window 0"))),
                KvLayerKind::Sliding { window } => Attention::Sliding { window },
                KvLayerKind::Shared { .. } => continue,
            };
            if l.kv_heads == 0 || l.head_dim == 0 {
                return Err(Error::Config(format!("layer {i}: {} kv heads, head dim {}", l.kv_heads, l.head_dim)));
            }
            let g = match groups.iter().position(|g| g.attention == att) {
                Some(g) => g,
                None => {
                    groups.push(Group { attention: att, layers: vec![], bytes_per_token: 0, num_blocks: 0 });
                    groups.len() - 1
                }
            };
            groups[g].layers.push(i);
            groups[g].bytes_per_token += 2 * l.kv_heads * l.head_dim * config.dtype_bytes;
            own_group[i] = Some(g);
        }
        if groups.is_empty() {
            return Err(Error::Config("no layer keeps K/V".into()));
        }
        let mut placement = Vec::with_capacity(layers.len());
        for (i, l) in layers.iter().enumerate() {
            match l.kind {
                KvLayerKind::Shared { anchor } => {
                    let g = own_group.get(anchor).copied().flatten().ok_or_else(|| {
                        Error::Config(format!("layer {i} shares layer {anchor}, which keeps no K/V of its own"))
                    })?;
                    placement.push((g, anchor));
                }
                _ => placement.push((own_group[i].expect("own storage"), i)),
            }
        }
        // Sliding groups: fixed size; the full group (if any) takes the rest of the budget.
        let budget = config.budget_mb * 1e6;
        let mut used = 0.0;
        for g in groups.iter_mut() {
            if let Attention::Sliding { window } = g.attention {
                let per_seq = (window + config.rollback_tokens + config.max_step_tokens).div_ceil(bs) + 1;
                g.num_blocks = per_seq * config.max_seqs;
                used += (g.num_blocks * bs * g.bytes_per_token) as f64;
            }
        }
        let has_full = groups.iter().any(|g| g.attention == Attention::Full);
        if used > budget || (has_full && used >= budget) {
            return Err(Error::Config(format!(
                "{} MB cannot hold the sliding-window groups ({:.1} MB)",
                config.budget_mb,
                used / 1e6
            )));
        }
        for g in groups.iter_mut().filter(|g| g.attention == Attention::Full) {
            g.num_blocks = blocks_for_budget((budget - used) / 1e6, g.bytes_per_token, bs)?;
        }
        Ok(KvLayout { config, layers, groups, placement })
    }

    /// The same layers, every group with exactly `num_blocks[g]` blocks (ignores the budget).
    pub fn with_blocks(mut self, num_blocks: &[usize]) -> Result<Self> {
        if num_blocks.len() != self.groups.len() || num_blocks.contains(&0) {
            return Err(Error::Config(format!("{num_blocks:?} blocks for {} groups", self.groups.len())));
        }
        for (g, &n) in self.groups.iter_mut().zip(num_blocks) {
            g.num_blocks = n;
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_like_layout() {
        let sw = LayerSpec { kind: KvLayerKind::Sliding { window: 512 }, kv_heads: 8, head_dim: 256 };
        let gl = LayerSpec { kind: KvLayerKind::Full, kv_heads: 2, head_dim: 512 };
        let sh = LayerSpec { kind: KvLayerKind::Shared { anchor: 1 }, kv_heads: 2, head_dim: 512 };
        let l = KvLayout::new(vec![sw, gl, sw, sh], KvConfig::default()).unwrap();
        assert_eq!(l.groups.len(), 2);
        assert_eq!(l.groups[0].attention, Attention::Sliding { window: 512 });
        assert_eq!(l.groups[0].layers, vec![0, 2]);
        assert_eq!(l.placement, vec![(0, 0), (1, 1), (0, 2), (1, 1)]);
        // (512 + 16 + 512) / 16 = 65, + 1, times 8 sequences.
        assert_eq!(l.groups[0].num_blocks, 66 * 8);
        assert!(l.groups[1].num_blocks > 0);
        let bad = LayerSpec { kind: KvLayerKind::Shared { anchor: 3 }, ..sh };
        assert!(KvLayout::new(vec![sw, gl, sw, bad], KvConfig::default()).is_err());
        assert!(KvLayout::new(vec![sw], KvConfig { budget_mb: 1.0, ..Default::default() }).is_err());
    }
}
