//! Temperature and the truncation filters (top-k, top-p, min-p) on `[B, V]` logits.
//!
//! Every filter is computed on the tempered, untruncated distribution and the kept set is the
//! intersection of the three (mlx-lm applies top-p, min-p, top-k in that order on unnormalised
//! masked log-probs, which amounts to the same). Unlike mlx-lm, which filters the temperature-1
//! distribution and applies the temperature only in the final draw, the temperature comes
//! first here (the Hugging Face / vLLM order), so that "top_p keeps the smallest set whose mass
//! reaches p" holds for the distribution the token is actually drawn from.
use crate::config::SamplingConfig;
use crate::error::Result;
use mlx_array::{ops::where_, Array};

fn neg_inf() -> Array {
    Array::scalar(f32::NEG_INFINITY)
}

/// `log_softmax(x)` along the last axis (one primitive on the CPU for `[B, V]`: `Array::log_softmax`).
pub fn log_softmax(x: &Array) -> Result<Array> {
    Ok(x.log_softmax(-1)?)
}

/// Keep exactly `k` tokens per row (the `k` largest; ties at the k-th value are broken by
/// MLX's `argpartition`, i.e. arbitrarily but deterministically). Tokens already at `-inf`
/// count among the `k` when fewer than `k` are finite. `k == 0` or `k >= V` is a no-op.
pub fn top_k(logits: &Array, k: usize) -> Result<Array> {
    let v = logits.dim(-1)?;
    if k == 0 || k >= v {
        return Ok(logits.clone());
    }
    let order = logits.neg()?.argpartition(k as i32 - 1, -1)?;
    let drop = order.slice_axis(-1, k, v)?;
    Ok(logits.put_along_axis(&drop, &neg_inf(), -1)?)
}

/// Nucleus filter on logits or log-probs (no normalisation needed): a token is kept when the
/// mass of the tokens strictly more likely than it (in sorted order) is below `p * total`,
/// i.e. the smallest most-likely prefix whose mass reaches `p`; every token tied with the
/// least likely kept one is kept too (the cut is a threshold on the value). `p >= 1` is a
/// no-op. mlx-lm's `apply_top_p` algorithm, with `exp(sorted - max)` so that unnormalised
/// logits work too.
pub fn top_p(logits: &Array, p: f32) -> Result<Array> {
    if p >= 1.0 {
        return Ok(logits.clone());
    }
    // `Array::nucleus` works on rows: one primitive on the CPU (no sort), MLX's ops elsewhere
    let v = logits.dim(-1)?;
    Ok(logits.reshape(&[-1, v as i32])?.nucleus(p)?.reshape(logits.dims())?)
}

/// Drop tokens with `p < min_p * p_max`, on logits or log-probs (`x < x_max + ln(min_p)`).
/// `min_p == 0` is a no-op; `min_p == 1` keeps the maximum and its ties.
pub fn min_p(logits: &Array, min_p: f32) -> Result<Array> {
    if min_p <= 0.0 {
        return Ok(logits.clone());
    }
    let thr = logits.max(&[-1], true)?.add_scalar(min_p.ln())?;
    Ok(where_(&logits.lt(&thr)?, &neg_inf(), logits)?)
}

/// The sampling distribution of non-greedy decoding, as normalised log-probs `[B, V]`:
/// `logits / temperature`, then top-p, min-p and top-k (kept set = intersection), renormalised.
/// Filtered tokens are `-inf`. `logits` are f32 and already penalised.
pub fn tempered_filtered(logits: &Array, cfg: &SamplingConfig) -> Result<Array> {
    let x = if cfg.temperature == 1.0 { logits.clone() } else { logits.mul_scalar(1.0 / cfg.temperature)? };
    // The filters need no normalised input, so there is one log-softmax pass in all (on MLX's
    // CPU backend each exp/logsumexp pass over V = 151936 costs as much as the whole rest
    // but the sort).
    let x = top_p(&x, cfg.top_p)?;
    let x = min_p(&x, cfg.min_p)?;
    let x = top_k(&x, cfg.top_k as usize)?;
    log_softmax(&x)
}
