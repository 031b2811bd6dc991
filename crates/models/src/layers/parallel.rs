//! Tensor parallelism (Megatron-style, as mlx-lm's `shard_linear`): each rank of a
//! [`mlx_array::distributed::Group`] holds a slice of every projection and the ranks combine
//! their partial results with collectives.
//!
//! - Output-sharded ("column-parallel") projections (q/k/v, gate/up) keep rows
//!   `rank * out / N ..` of the `[out, in]` weight: each rank computes its heads or channels.
//! - Input-sharded ("row-parallel") projections (o, down) keep the matching input columns; their
//!   partial products are summed over the ranks (`all_sum`) before the bias is added once.
//! - The vocabulary is split too: each rank holds `vocab / N` embedding rows (a lookup outside
//!   them contributes zeros to an `all_sum`, so every rank gets the exact row) and computes that
//!   slice of the logits, which an `all_gather` joins.
//!
//! - Families with other mixers split them by channel or head the same way: LFM2's short
//!   convolution (channels of B, C and x), Qwen3.5's GatedDeltaNet (key and value heads).
//! - Mixture-of-experts layers split the experts (expert parallelism): each rank holds `E / N`
//!   experts, runs them for every token with the other ranks' experts weighted 0, and the
//!   partial sums are added over the ranks; the router stays whole on every rank.
//!
//! - MLX-quantized layers shard packed ([`crate::weights::Vb::quantized_shard`]): split by
//!   output (and embeddings, stacked experts), each rank keeps whole rows of the packed weight,
//!   scales and biases; split by input, whole quantization groups of the packed columns, and a
//!   shard boundary inside a group is an error.
//!
//! A load shards when [`crate::LoadOptions::tensor_parallel`] gives a group; each rank reads
//! only its slices from the memory-mapped safetensors ([`crate::weights::Vb::get_shard`]).
use crate::weights::Vb;
use crate::{ModelError, Result};
use mlx_array::distributed::{depends, Group};
use mlx_array::{Array, DType};

/// Which dimension of a projection's `[out, in]` weight the ranks split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Output features ("column-parallel"): the output is this rank's slice.
    Output,
    /// Input features ("row-parallel"): the input is this rank's slice, and the partial
    /// products are summed over the ranks.
    Input,
}

/// The group of a tensor-parallel load under `vb`, if any.
pub(crate) fn group(vb: &Vb) -> Option<Group> {
    vb.weights().tensor_parallel().cloned()
}

/// `count / N` for `N` tensor-parallel ranks (`count` itself without a group); a count the
/// ranks cannot share equally (`what` names it: attention heads, KV heads) is an error.
pub(crate) fn per_rank(vb: &Vb, what: &str, count: usize) -> Result<usize> {
    let Some(g) = vb.weights().tensor_parallel() else { return Ok(count) };
    if count % g.size() != 0 {
        return Err(ModelError::UnsupportedOption(format!(
            "tensor parallelism over {} ranks: {} has {count} {what}, not a multiple of {}",
            g.size(),
            vb.prefix(),
            g.size()
        )));
    }
    Ok(count / g.size())
}

/// Join the ranks' vocabulary slices of logits `[..., V / N]` into `[..., V]` (rank order).
pub(crate) fn gather_last_axis(g: &Group, x: &Array) -> Result<Array> {
    let nd = x.ndim() as i32;
    // all_gather concatenates along axis 0: move the last axis there and back.
    let mut to_front: Vec<i32> = vec![nd - 1];
    to_front.extend(0..nd - 1);
    let mut back: Vec<i32> = (1..nd).collect();
    back.push(0);
    Ok(g.all_gather(&x.transpose(&to_front)?)?.transpose(&back)?)
}

/// The token (and its log-prob) that rank 0 samples from `logits`, on every rank.
///
/// Rank 0 runs `sample`; the other ranks do not sample: they contribute zeros to one
/// broadcast (`all_sum`) of `[token, logprob]` as f32 (token ids below 2^24 are exact in f32).
/// Their zeros are made to depend on their own `logits`, so that every rank evaluates the
/// logits' collectives before the broadcast, in the same order.
pub(crate) fn sample_on_root(
    g: &Group,
    logits: &Array,
    vocab: usize,
    sample: impl FnOnce(&Array) -> Result<(Array, Array)>,
) -> Result<(Array, Array)> {
    if vocab >= 1 << 24 {
        return Err(ModelError::UnsupportedOption(format!("tensor parallelism: a vocabulary of {vocab} ids does not fit the f32 token broadcast")));
    }
    let packed = if g.rank() == 0 {
        let (tokens, logprobs) = sample(logits)?;
        let t = tokens.reshape(&[-1])?.astype(DType::F32)?;
        mlx_array::ops::concatenate(&[&t, &logprobs.reshape(&[-1])?.astype(DType::F32)?], 0)?
    } else {
        let zeros = Array::zeros(&[2], DType::F32)?;
        depends(&[&zeros], &[logits])?.remove(0)
    };
    let got = g.all_sum(&packed)?;
    let tokens = got.slice_axis(0, 0, 1)?.astype(DType::U32)?;
    let logprobs = got.slice_axis(0, 1, 2)?;
    Ok((tokens, logprobs))
}
