//! Data-parallel training over an MLX distributed group: every rank holds the whole model,
//! computes the gradients of its share of each global batch, and the ranks average them with
//! one `all_sum` before the (identical) optimizer update, so every rank applies the update a
//! single process would apply to the whole batch (up to f32 summation order).
//!
//! [`crate::SftTrainer::with_data_parallel`] hooks it into the SFT loop.
use crate::{Result, TrainError};
use mlx_array::distributed::Group;
use mlx_array::{Array, DType};

/// The examples `0..len` of a global batch that rank `rank` of `size` computes: contiguous,
/// as even as possible (the first `len % size` ranks take one more). Every rank needs one.
pub fn rank_share(len: usize, rank: usize, size: usize) -> Result<std::ops::Range<usize>> {
    if size == 0 || rank >= size {
        return Err(TrainError::InvalidInput(format!("rank {rank} of {size}")));
    }
    if len < size {
        return Err(TrainError::InvalidInput(format!("a batch of {len} examples cannot be shared by {size} data-parallel ranks (each needs at least one)")));
    }
    let (base, extra) = (len / size, len % size);
    let start = rank * base + rank.min(extra);
    Ok(start..start + base + usize::from(rank < extra))
}

/// What the ranks' shares of one batch add up to.
#[derive(Debug, Clone)]
pub struct Reduced {
    /// Mean loss over the whole batch's loss positions.
    pub loss: f32,
    /// Loss positions of the whole batch.
    pub positions: usize,
    /// Positions with a real next token, of the whole batch.
    pub tokens: usize,
    /// Gradients of the mean loss over the whole batch, in the order given.
    pub grads: Vec<Array>,
}

/// Combine the ranks' shares of one batch: each rank passes the mean `loss` over its
/// `positions` loss positions and that mean's `grads`; every rank gets the mean over all
/// positions, `Σ_r positions_r · g_r / Σ_r positions_r`, which is the gradient of the whole
/// batch's mean loss. One `all_sum` carries every gradient (flattened into one f32 buffer) and
/// the loss; gradients come back in their own dtypes and shapes.
/// `tokens` (positions with a real next token) are summed too.
pub fn reduce_gradients(group: &Group, loss: f32, positions: usize, tokens: usize, grads: &[Array]) -> Result<Reduced> {
    if positions.max(tokens) >= 1 << 24 {
        return Err(TrainError::InvalidInput(format!("{} positions on one rank exceed the f32 count the reduction carries", positions.max(tokens))));
    }
    let w = positions as f32;
    let (head, sums) = sum_over_ranks(group, &[loss * w, w, tokens as f32], grads, w)?;
    let total = head[1];
    if total <= 0.0 {
        return Err(TrainError::InvalidInput("the batch has no loss position on any rank".into()));
    }
    let out = sums.iter().zip(grads).map(|(s, g)| s.mul_scalar(1.0 / total)?.astype(g.dtype())).collect::<mlx_array::Result<Vec<_>>>()?;
    mlx_array::eval(&out.iter().collect::<Vec<_>>())?;
    Ok(Reduced { loss: head[0] / total, positions: total as usize, tokens: head[2] as usize, grads: out })
}

/// One `all_sum` over the ranks of some f32 scalars `head` and of the arrays `grads`, each
/// multiplied by `scale` first: the summed scalars, and the summed arrays in f32 with their
/// own shapes (evaluated). Every rank must pass the same number of scalars and arrays of the
/// same shapes.
pub fn sum_over_ranks(group: &Group, head: &[f32], grads: &[Array], scale: f32) -> Result<(Vec<f32>, Vec<Array>)> {
    let mut parts: Vec<Array> = Vec::with_capacity(grads.len() + 1);
    parts.push(Array::from_slice(head, &[head.len()])?);
    for g in grads {
        let flat = g.astype(DType::F32)?.reshape(&[-1])?;
        parts.push(if scale == 1.0 { flat } else { flat.mul_scalar(scale)? });
    }
    let flat = mlx_array::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?;
    let sum = group.all_sum(&flat)?;
    sum.eval()?;
    let summed = sum.slice_axis(0, 0, head.len())?.to_vec::<f32>()?;
    let mut out = Vec::with_capacity(grads.len());
    let mut at = head.len();
    for g in grads {
        let n = g.size();
        out.push(sum.slice_axis(0, at, at + n)?.reshape(g.dims())?);
        at += n;
    }
    Ok((summed, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_in_order() {
        for (len, size) in [(8, 2), (7, 3), (5, 5), (9, 4)] {
            let mut next = 0;
            for r in 0..size {
                let s = rank_share(len, r, size).unwrap();
                assert_eq!(s.start, next);
                assert!(s.len() == len / size || s.len() == len / size + 1);
                next = s.end;
            }
            assert_eq!(next, len);
        }
        assert!(rank_share(1, 0, 2).is_err());
        assert!(rank_share(4, 2, 2).is_err());
    }

    /// A group of one is the identity: the reduction returns the rank's own loss and gradients.
    #[test]
    fn one_rank_reduces_to_itself() {
        let g = Group::init_with(mlx_array::distributed::Backend::Ring, false).unwrap();
        assert_eq!(g.size(), 1);
        let grads = [Array::from_slice(&[1.0f32, -2.0, 3.5, 0.25], &[2, 2]).unwrap(), Array::from_slice(&[0.5f32], &[1]).unwrap().astype(DType::BF16).unwrap()];
        // 8 positions: scaling by 8 and back is exact in f32
        let r = reduce_gradients(&g, 1.25, 8, 9, &grads).unwrap();
        assert_eq!((r.loss, r.positions, r.tokens), (1.25, 8, 9));
        assert_eq!(r.grads[0].to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5, 0.25]);
        assert_eq!((r.grads[1].dtype(), r.grads[1].shape()), (DType::BF16, vec![1]));
    }
}
